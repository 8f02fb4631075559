"""Checkpoints across layouts on 4 gloo ranks: exact resume in new processes, resharding, merge to Hugging Face.

Resume parity: 6 steps straight vs 3 steps, save, new processes, load, 3 steps: identical
losses and weights, for DDP, FSDP2, tensor parallel 2 x data 2 and DeepSpeed ZeRO-2 (fp32,
same layout on both sides, so the arithmetic is the same: exact equality is required).
Resharding: the (tensor=2, data=2) checkpoint loads into DDP over 4 ranks, FSDP2 over 2
ranks and one process with identical weights (a load copies bits: exact). Merge: the merged
directory loads with `from_pretrained` and gives the trained model's logits (rel 1e-5: the
tensor-parallel forward sums its matmuls in a different order than the plain model).

Three spawns: save (4 ranks), resume (4), reshard to FSDP2 (2). The other layouts (zero1,
zero2, DeepSpeed ZeRO-1/3, LoRA) are in test_checkpoint_more_layouts.py.
"""

import os

import pytest
import torch
import torch.distributed as dist
from typing import Dict, List, Tuple

from atorch import distributed as adist
from atorch.auto import auto_accelerate
from atorch.auto.accelerate import AutoAccelerateResult
from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses

pytestmark = pytest.mark.heavy

LAYOUTS = ("ddp", "fsdp", "tp2dp2", "ds_zero2")
STEPS, SAVE_AT = 6, 3
# Exact everywhere but DDP on 4 ranks. Measured: there the resumed weights differ by ~5e-8 (rel ~1e-8) from
# the first resumed step on, while every restored tensor is bit-identical: DDP's first iteration in a new
# process all-reduces in its initial bucket layout (the straight run had rebuilt its buckets after its
# first iteration), and gloo's ring sums each chunk in a rank order that depends on the layout. Two-rank
# DDP, whose sums have a single order, resumes bit-exactly. 1e-6 is the bound.
RESUME_TOLERANCE = {"ddp": 1e-6, "fsdp": 0.0, "tp2dp2": 0.0, "ds_zero2": 0.0}
GLOBAL_BATCH = 8
LR = 1e-3
SCHEDULER = (torch.optim.lr_scheduler.StepLR, {"step_size": 2, "gamma": 0.5})


# Strategies by layout name; `world` is the number of ranks.
def strategy_for(layout: str, world: int) -> list:
    return {
        "ddp": ["parallel_mode"],
        "fsdp": ["parallel_mode", "fsdp"],
        "tp2dp2": [("parallel_mode", ([("tensor", 2), ("data", world // 2)], None)), "tensor_parallel"],
        "ds_zero2": ["parallel_mode", ("zero2", {"use_ds_zero": True})],
        "zero1": ["parallel_mode", "zero1"],
        # One group of a single parameter: ZeroRedundancyOptimizer leaves it empty on every other rank.
        "zero1_small_group": ["parallel_mode", "zero1"],
        "zero2": ["parallel_mode", "zero2"],
        "ds_zero1": ["parallel_mode", ("zero1", {"use_ds_zero": True})],
        "ds_zero3": ["parallel_mode", ("fsdp", {"use_ds_zero": True})],
        # AdamW in two groups (see `decay_groups`): ZeRO-1/2 step and link each group's state separately.
        "ds_zero2_groups": ["parallel_mode", ("zero2", {"use_ds_zero": True})],
        "lora_ddp": ["parallel_mode", ("lora", {"r": 4, "alpha": 8})],
    }[layout]


def decay_groups(model: torch.nn.Module) -> List[dict]:
    """AdamW's usual two parameter groups: weight decay on the matrices, none on norms and biases."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or "norm" in n]
    decay = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def final_norm_group(model: torch.nn.Module) -> List[dict]:
    """The final norm's weight alone in a group without decay, everything else in another."""
    named = list(model.named_parameters())
    last = [p for n, p in named if n.endswith("model.norm.weight")]
    assert len(last) == 1, [n for n, _ in named]
    return [{"params": [p for p in model.parameters() if p is not last[0]], "weight_decay": 0.1},
            {"params": last, "weight_decay": 0.0}]


PARAM_GROUPS = {"_groups": decay_groups, "_small_group": final_norm_group}


def build(layout: str, seed: int = 0) -> AutoAccelerateResult:
    """A result for `layout` (see `strategy_for`) on the current world, through auto_accelerate."""
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": LR},
        optim_param_func=next((f for end, f in PARAM_GROUPS.items() if layout.endswith(end)), None),
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
        lr_scheduler_cls=SCHEDULER[0], lr_scheduler_args=dict(SCHEDULER[1]),
        load_strategy=strategy_for(layout, dist.get_world_size()))
    assert status, f"auto_accelerate failed for {layout}"
    return result


def full_weights(result: AutoAccelerateResult) -> Dict[str, torch.Tensor]:
    """The full model state dict (Hugging Face keys and shapes), on every rank, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    engine = result.args.get("engine")
    if engine is not None:
        import deepspeed

        # Under ZeRO-3 the parameters are partitioned; gather them to read the full weights.
        params = list(engine.module.parameters()) if engine.zero_optimization_stage() == 3 else []
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    if result.args.get("tensor_parallel_size"):
        from atorch.utils.manual_tp_utils import gather_tp_state_dict

        return gather_tp_state_dict(result.model)
    state = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def train(result: AutoAccelerateResult, steps: int, dataloader=None) -> List[float]:
    """`steps` optimizer steps; the global-batch loss of each (per-rank means averaged over data ranks)."""
    from atorch.auto import train_step

    losses = []
    dp_group = adist.parallel_group("data")
    for _, batch in zip(range(steps), dataloader if dataloader is not None else result.dataloader):
        loss = train_step(result, batch)
        dist.all_reduce(loss, group=dp_group)
        losses.append(loss.item() / dist.get_world_size(dp_group))
    return losses


def compare_weights(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rel: float = 0.0
                    ) -> List[Tuple[str, float]]:
    """(key, max abs difference) for every key whose tensors differ beyond `rel`; keys must match."""
    assert sorted(actual) == sorted(expected), (sorted(set(actual) ^ set(expected)))
    bad = []
    for k in expected:
        a, e = torch.as_tensor(actual[k]).float(), torch.as_tensor(expected[k]).float()
        assert a.shape == e.shape, (k, a.shape, e.shape)
        diff = (a - e).abs().max().item() if a.numel() else 0.0
        if diff > rel * max(e.abs().max().item(), 1e-12):
            bad.append((k, diff))
    return bad


def portable(value):
    """Tensors as numpy arrays: torch would pass tensors between processes through shared memory
    that is gone once the rank exits."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value


def probe_input() -> torch.Tensor:
    return TokenDataset(n=2, seq_len=12, seed=7).tokens


def probe_logits(result: AutoAccelerateResult) -> torch.Tensor:
    """Full-vocabulary logits of the trained model on `probe_input()` (every rank computes them)."""
    from atorch.auto.model_context import call_model

    model = result.model
    with torch.no_grad():
        out = call_model(model, {"input_ids": probe_input()}, "unpack_dict")
    logits = out.logits
    if result.args.get("tensor_parallel_size"):
        from atorch.utils.manual_tp_utils import gather_tp_logits

        logits = gather_tp_logits(model, logits)
    return logits.detach().cpu()


def _first_run(root: str) -> Dict[str, dict]:
    """Per layout: 6 straight steps; then a fresh run of 3 steps that saves."""
    out = {}
    for layout in LAYOUTS:
        result = build(layout)
        straight = train(result, STEPS)
        straight_weights = full_weights(result)
        del result
        dist.barrier()

        result = build(layout)
        first = train(result, SAVE_AT)
        path = save_checkpoint(result, os.path.join(root, layout, f"step_{SAVE_AT}"), step=SAVE_AT,
                               extra={"layout": layout}, keep_last=2)
        rng_after_save = torch.rand(4)
        saved_weights = full_weights(result)
        logits = probe_logits(result) if layout == "tp2dp2" else None
        del result
        dist.barrier()
        out[layout] = dict(straight=straight, straight_weights=straight_weights, first=first, path=path,
                           rng=rng_after_save, saved_weights=saved_weights, logits=logits)
    return portable(out)


def _resume_run(root: str) -> Dict[str, dict]:
    """New processes: per layout load (into a model built from another seed) and 3 more steps; plus a reshard."""
    out = {}
    for layout in LAYOUTS:
        result = build(layout, seed=123)
        state = load_checkpoint(result, os.path.join(root, layout))  # the parent: `latest` names step_3
        rng_after_load = torch.rand(4)
        lr_after_load = [g["lr"] for g in result.optim.param_groups]
        resumed = train(result, STEPS - SAVE_AT, dataloader=state.dataloader)
        out[layout] = dict(resumed=resumed, weights=full_weights(result), rng=rng_after_load, step=state.step,
                           extra=state.extra, rng_restored=state.rng_restored,
                           lr=lr_after_load)
        del result, state
        dist.barrier()
    # Reshard: (tensor=2, data=2) -> DDP over all 4 ranks, model and optimizer.
    result = build("ddp", seed=123)
    state = load_checkpoint(result, os.path.join(root, "tp2dp2", f"step_{SAVE_AT}"))
    out["tp2dp2->ddp"] = dict(weights=full_weights(result), rng_restored=state.rng_restored,
                              resumed=train(result, STEPS - SAVE_AT, dataloader=state.dataloader))
    del result, state
    dist.barrier()
    return portable(out)


def _reshard_to_fsdp(root: str) -> Dict[str, dict]:
    result = build("fsdp", seed=123)
    state = load_checkpoint(result, os.path.join(root, "tp2dp2", f"step_{SAVE_AT}"))
    out = dict(weights=full_weights(result), rng_restored=state.rng_restored, world=dist.get_world_size(),
               resumed=train(result, STEPS - SAVE_AT, dataloader=state.dataloader))
    del result, state
    dist.barrier()
    return portable(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_layouts"))
    first = run_distributed(_first_run, 4, root, timeout=600)
    resumed = run_distributed(_resume_run, 4, root, timeout=600)
    return root, first, resumed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_in_new_processes_matches_straight_training(runs, layout):
    root, first, resumed = runs
    for rank in range(4):
        f, r = first[rank][layout], resumed[rank][layout]
        assert f["first"] == f["straight"][:SAVE_AT], (layout, f["first"], f["straight"])
        assert_close_losses(r["resumed"], f["straight"][SAVE_AT:], rel=RESUME_TOLERANCE[layout], what=layout)
        assert compare_weights(r["weights"], f["straight_weights"], rel=RESUME_TOLERANCE[layout]) == [], layout
        assert r["step"] == SAVE_AT and r["extra"] == {"layout": layout}
        assert r["rng_restored"] and (r["rng"] == f["rng"]).all(), (layout, rank)
        assert r["lr"] == [0.5 * LR] * len(r["lr"]), r["lr"]  # StepLR(2, 0.5) after 3 steps: restored
    assert open(os.path.join(root, layout, "latest")).read().strip() == f"step_{SAVE_AT}"


def test_reshard_tensor2_data2_into_ddp4_and_single_process(runs):
    root, first, resumed = runs
    saved = first[0]["tp2dp2"]["saved_weights"]
    for rank in range(4):
        got = resumed[rank]["tp2dp2->ddp"]
        assert compare_weights(got["weights"], saved) == []
        assert got["rng_restored"]  # same world size (4): each rank's generators come back
        # The optimizer state resharded too: the continued run matches TP's own continuation (rel 1e-5:
        # TP and DDP sum the same products in different orders).
        expected = first[0]["tp2dp2"]["straight"][SAVE_AT:]
        for a, e in zip(got["resumed"], expected):
            assert abs(a - e) <= 1e-5 * abs(e), (got["resumed"], expected)
    # One process, no process group: a plain Hugging Face model.
    model = tiny_llama(seed=99)
    load_checkpoint(model, os.path.join(root, "tp2dp2", f"step_{SAVE_AT}"))
    assert compare_weights({k: v for k, v in model.state_dict().items()}, saved) == []


def test_reshard_tensor2_data2_into_fsdp_on_2_ranks(runs):
    root, first, _ = runs
    saved = first[0]["tp2dp2"]["saved_weights"]
    for got in run_distributed(_reshard_to_fsdp, 2, root, timeout=300):
        assert got["world"] == 2
        assert compare_weights(got["weights"], saved) == []
        expected = first[0]["tp2dp2"]["straight"][SAVE_AT:]
        for a, e in zip(got["resumed"], expected):
            assert abs(a - e) <= 1e-5 * abs(e), (got["resumed"], expected)


def test_merge_loads_in_transformers_with_the_trained_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, first, _ = runs
    out = merge_checkpoint(os.path.join(root, "tp2dp2", f"step_{SAVE_AT}"), str(tmp_path / "hf"))
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert compare_weights(dict(model.state_dict()), first[0]["tp2dp2"]["saved_weights"]) == []
    with torch.no_grad():
        logits = model(probe_input()).logits
    expected = torch.as_tensor(first[0]["tp2dp2"]["logits"])
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-5), (logits - expected).abs().max()
