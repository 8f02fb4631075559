"""Save / load for the other layouts on 2 gloo ranks: torch zero1 (ZeroRedundancyOptimizer, with a parameter
group of one parameter, so empty on the other rank) and zero2
(FSDP2 without resharding), DeepSpeed ZeRO-1, ZeRO-2 with AdamW in two parameter groups (decay / no decay)
and ZeRO-3, and LoRA under DDP; a DeepSpeed checkpoint
loads into torch FSDP2; the LoRA checkpoint merges to a plain model and to adapters.

Each layout: 4 steps straight vs 2 steps, save, a fresh model (other seed) and optimizer, load, 2 steps
(one spawn: fresh objects, same processes; the new-process resume is test_checkpoint_layouts.py). Same
layout on both sides, fp32: exact. Cross-layout continuation (DeepSpeed -> FSDP2): rel 1e-5, the two sum
gradients in different orders. Last in the spawn: a DeepSpeed save where rank 0 alone fails to read its
optimizer state raises on both ranks (rank 1 was left in DeepSpeed's all-reduce). The two-group DeepSpeed
checkpoint is refused by optimizers grouped otherwise (DeepSpeed's one group, torch ZeRO-1's final-norm split).
A plain model with a layer no step reaches before the save (no optimizer state there) resumes exactly under
DDP(find_unused_parameters), FSDP2 and zero2.
"""

import os

import pytest
import torch
import torch.distributed as dist

from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.testing import run_distributed, tiny_llama
from test_checkpoint_layouts import SCHEDULER, LR, build, compare_weights, full_weights, portable, train

pytestmark = pytest.mark.heavy

LAYOUTS = ("zero1_small_group", "zero2", "ds_zero1", "ds_zero2_groups", "ds_zero3", "lora_ddp")
STEPS, SAVE_AT = 4, 2
PROBE = torch.randint(4, 1000, (2, 12), generator=torch.Generator().manual_seed(3))


def _round_trips(root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        result = build(layout)
        straight = train(result, STEPS)
        straight_weights = full_weights(result)
        del result
        dist.barrier()

        result = build(layout)
        first = train(result, SAVE_AT)
        path = save_checkpoint(result, os.path.join(root, layout, f"step_{SAVE_AT}"), step=SAVE_AT)
        saved_weights = full_weights(result)
        logits = None
        if layout == "lora_ddp":
            with torch.no_grad():
                logits = result.model(input_ids=PROBE).logits
        del result
        dist.barrier()

        result = build(layout, seed=77)
        state = load_checkpoint(result, path)
        lr = [g["lr"] for g in result.optim.param_groups]
        resumed = train(result, STEPS - SAVE_AT, dataloader=state.dataloader)
        out[layout] = dict(straight=straight, first=first, resumed=resumed, lr=lr, weights=full_weights(result),
                           straight_weights=straight_weights, saved_weights=saved_weights, logits=logits)
        del result, state
        dist.barrier()

    # DeepSpeed ZeRO-1 checkpoint -> torch FSDP2: weights, moments and schedule carry over.
    result = build("fsdp", seed=77)
    state = load_checkpoint(result, os.path.join(root, "ds_zero1"))
    out["ds_zero1->fsdp"] = dict(weights=full_weights(result),
                                 resumed=train(result, STEPS - SAVE_AT, dataloader=state.dataloader))
    # The convenience names auto_accelerate attaches to the result's model (FSDP2 here).
    result.model.save_parallelized(os.path.join(root, "fsdp_sharded"))
    result.model.save_parallelized(os.path.join(root, "fsdp_hf"), merge_checkpoints=True)
    fsdp_weights = full_weights(result)
    del result, state
    dist.barrier()
    result = build("ddp", seed=5)
    result.model.from_parallelized(os.path.join(root, "fsdp_sharded"))
    got = full_weights(result)
    result.model.from_parallelized(os.path.join(root, "fsdp_hf"))  # the merged form, into DDP
    out["from_parallelized"] = dict(expected=fsdp_weights, got=got, got_hf=full_weights(result))
    del result
    dist.barrier()
    # The two-group DeepSpeed checkpoint into one group (DeepSpeed ZeRO-1) and into other groups (torch ZeRO-1):
    # each group's hyperparameters would come from its first parameter, so both are refused before any load.
    out["groups_mismatch"] = {}
    for layout in ("ds_zero1", "zero1_small_group"):
        result = build(layout, seed=77)
        before = full_weights(result)
        try:
            load_checkpoint(result, os.path.join(root, "ds_zero2_groups"))
            out["groups_mismatch"][layout] = "loaded"
        except ValueError as e:
            out["groups_mismatch"][layout] = str(e)
        assert compare_weights(full_weights(result), before) == [], layout
        del result
        dist.barrier()
    out["late_layer"] = _late_layer_resumes(root)
    # Last: without the agreement rank 1 is left in a DeepSpeed gather while rank 0 goes on.
    out["ds_state_failure"] = _save_failing_on_rank_0(build("ds_zero2_groups"), os.path.join(root, "ds_failure"))
    return portable(out)


class _LateLayer(torch.nn.Module):
    """`late` first gets a gradient at step 3 (an MoE expert no token reached before, a branch not taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.late = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_late: bool) -> torch.Tensor:
        y = self.used(x)
        return self.late(y) if use_late else y


LATE_STRATEGIES = {"ddp": [("ddp", {"find_unused_parameters": True})], "fsdp": ["fsdp"], "zero2": ["zero2"]}


def _late_layer_resumes(root: str) -> dict:
    """Per strategy: losses of 4 steps straight, and of 2 steps, save, fresh objects, load, 2 steps."""
    from atorch.auto import auto_accelerate

    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * dist.get_rank() + i)) for i in range(4)]

    def make(strategy, seed):
        torch.manual_seed(seed)
        status, result, _ = auto_accelerate(_LateLayer(), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-2},
                                            load_strategy=strategy)
        assert status
        return result

    def step(result, i):
        loss = result.model(batches[i], i >= 3).square().mean()
        loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        return loss.item()

    out = {}
    for name, strategy in LATE_STRATEGIES.items():
        result = make(strategy, 0)
        straight = [step(result, i) for i in range(4)]
        result = make(strategy, 0)
        first = [step(result, i) for i in range(2)]
        path = save_checkpoint(result, os.path.join(root, f"late_{name}"), step=2)
        result = make(strategy, 1)
        try:
            load_checkpoint(result, path)
        except Exception as e:   # reported per strategy, so that every strategy is tried
            out[name] = f"{type(e).__name__}: {e}"
            continue
        out[name] = dict(straight=straight, resumed=first + [step(result, i) for i in range(2, 4)])
        dist.barrier()
    return out


def _save_failing_on_rank_0(result, path: str) -> str:
    """save_checkpoint of a DeepSpeed engine where rank 0 alone fails to read its optimizer state (a
    local step, before DeepSpeed's gathering collectives): the error each rank raised."""
    from atorch.checkpoint.deepspeed_layout import DeepSpeedHandler

    original = DeepSpeedHandler._ensure_state

    def fails_on_rank_0(self):
        if dist.get_rank() == 0:
            raise ValueError("injected: rank 0 cannot read its optimizer state")
        original(self)

    DeepSpeedHandler._ensure_state = fails_on_rank_0
    try:
        save_checkpoint(result, path, step=1)
    except ValueError as e:
        return str(e)
    finally:
        DeepSpeedHandler._ensure_state = original
    return "saved"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("more_layouts"))
    return root, run_distributed(_round_trips, 2, root, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_load_continues_exactly(runs, layout):
    _, per_rank = runs
    for rank_out in per_rank:
        r = rank_out[layout]
        assert r["first"] == r["straight"][:SAVE_AT]
        assert r["resumed"] == r["straight"][SAVE_AT:], (layout, r["resumed"], r["straight"])
        assert compare_weights(r["weights"], r["straight_weights"]) == [], layout
        # StepLR(step_size=2, gamma=0.5) after 2 steps, restored into the fresh optimizer.
        assert r["lr"] == [LR * SCHEDULER[1]["gamma"]] * len(r["lr"]), r["lr"]


@pytest.mark.parametrize("strategy", sorted(LATE_STRATEGIES))
def test_a_layer_without_gradient_before_the_save_resumes_exactly(runs, strategy):
    """It had no optimizer state in the checkpoint; the load leaves it none, and its first step is the
    straight run's (AdamW's first-step bias correction)."""
    _, per_rank = runs
    for rank_out in per_rank:
        r = rank_out["late_layer"][strategy]
        assert isinstance(r, dict), r
        assert r["resumed"] == r["straight"], r


def test_a_deepspeed_optimizer_state_failure_on_one_rank_is_raised_on_every_rank(runs):
    """Rank 0 failed before DeepSpeed's all-reduce of a parameter's state, rank 1 waited in it: agreed first."""
    _, per_rank = runs
    for rank_out in per_rank:
        assert "failed on rank [0]" in rank_out["ds_state_failure"], rank_out["ds_state_failure"]
        assert "injected: rank 0 cannot read its optimizer state" in rank_out["ds_state_failure"]


def test_a_checkpoint_of_other_parameter_groups_is_refused_on_every_rank(runs):
    """decay / no-decay groups saved by DeepSpeed ZeRO-2; loaded into one group (DeepSpeed) and into a split
    at the final norm (torch ZeRO-1, whose small group is empty on rank 1): the same error on both ranks, naming
    the first parameter whose group differs, nothing loaded."""
    _, per_rank = runs
    for rank_out in per_rank:
        for layout, message in rank_out["groups_mismatch"].items():
            assert "optimizer parameter 'model.layers.0." in message and "is in param group" in message, message
            assert "the checkpoint's [['model.embed_tokens.weight'," in message and "load_optimizer=False" in message
    assert per_rank[0]["groups_mismatch"] == per_rank[1]["groups_mismatch"]


def test_deepspeed_checkpoint_loads_into_torch_fsdp(runs):
    _, per_rank = runs
    for rank_out in per_rank:
        got, ds = rank_out["ds_zero1->fsdp"], rank_out["ds_zero1"]
        assert compare_weights(got["weights"], ds["saved_weights"]) == []
        for a, e in zip(got["resumed"], ds["straight"][SAVE_AT:]):
            assert abs(a - e) <= 1e-5 * abs(e), (got["resumed"], ds["straight"])


def test_lora_checkpoint_merges_to_a_plain_model_and_to_adapters(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, per_rank = runs
    expected = torch.as_tensor(per_rank[0]["lora_ddp"]["logits"])
    merged = merge_checkpoint(os.path.join(root, "lora_ddp"), str(tmp_path / "merged"), lora="merge")
    model, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        # W + B A * scale folded into W: the same function up to float rounding.
        assert torch.allclose(model(input_ids=PROBE).logits, expected, rtol=1e-5, atol=1e-5)
    adapters = merge_checkpoint(os.path.join(root, "lora_ddp"), str(tmp_path / "adapters"), lora="adapters")
    # LoRA trains only the adapters: the base is the seed-0 model.
    peft_model = PeftModel.from_pretrained(tiny_llama(seed=0), adapters)
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=PROBE).logits, expected)


def test_save_parallelized_and_from_parallelized_on_the_result_model(runs):
    from transformers import AutoModelForCausalLM

    root, per_rank = runs
    for rank_out in per_rank:
        got = rank_out["from_parallelized"]
        assert compare_weights(got["got"], got["expected"]) == []
        assert compare_weights(got["got_hf"], got["expected"]) == []
    model, info = AutoModelForCausalLM.from_pretrained(os.path.join(root, "fsdp_hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert compare_weights(dict(model.state_dict()), per_rank[0]["from_parallelized"]["expected"]) == []
    assert not [e for e in os.listdir(root) if ".tmp-" in e]  # no staging or temporary sharded copy left
