"""Pipeline layouts on 4 gloo ranks: native `pipeline_parallel` (data 2 x pipeline 2) and DeepSpeed 3D
(tensor 2 x pipeline 2, ZeRO 0; data 2 x pipeline 2, ZeRO-1; data 2 x pipeline 2 in bf16, ZeRO 0).

Per layout: 4 steps straight vs 2 steps, save, a fresh build whose weights are then scaled by 0.5 (so a
load that missed anything shows), load, 2 steps: identical losses (same layout, fp32: exact). Then one
process, no process group, loads each checkpoint (the stages' keys together, tensor-parallel shards
resharded) into a plain Hugging Face model with its optimizer and continues: the same losses as the
pipeline within rel 1e-4 (the bound of the pipeline parity tests: micro-batch sums and Adam's
normalization of near-zero gradients; the bf16 pipeline against bf16 autocast within rel 2e-2, the bf16
parity bound). The native checkpoint also merges for `from_pretrained`.

A tied embedding/head (native_d2p2_tied), which the stages keep as two copies: its checkpoint loads with
the optimizer into a tied one-process model and into FSDP2 over 4 ranks (continuing within rel 1e-4), and
FSDP2's checkpoint of it, saved right after that load, resumes the pipeline with the straight losses exactly;
the untied pipeline's checkpoint (embedding and head differ) is refused by the tied pipeline on every rank.
"""

import os

import pytest
import torch
import torch.distributed as dist

from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.testing import run_distributed, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, global_batches

pytestmark = pytest.mark.heavy

LAYERS, LR, STEPS, SAVE_AT, MICRO, GAS = 4, 1e-3, 4, 2, 2, 2
CASES = {
    "native_d2p2": ([("data", 2), ("pipeline", 2)], "pipeline_parallel", {"chunks": 2}),
    # Tied embedding/head: the stages keep two copies (gradients summed), every other layout one parameter.
    "native_d2p2_tied": ([("data", 2), ("pipeline", 2)], "pipeline_parallel", {"chunks": 2}),
    "ds3d_t2p2": ([("tensor", 2), ("data", 1), ("pipeline", 2)], "deepspeed_3d_parallel", {}),
    "ds3d_d2p2_zero1": ([("tensor", 1), ("data", 2), ("pipeline", 2)], "deepspeed_3d_parallel",
                        {"zero_optimization": {"stage": 1}}),
    # bf16 at ZeRO 0: DeepSpeed's BF16_Optimizer (fp32 master partitions over "data"), once saved without its state.
    "ds3d_d2p2_bf16": ([("tensor", 1), ("data", 2), ("pipeline", 2)], "deepspeed_3d_parallel",
                       {"bf16": {"enabled": True}}),
}
TIED = {"native_d2p2_tied"}
# The one-process continuation of a bf16 pipeline runs under bf16 autocast: within the bf16 parity bound.
ONE_PROCESS_REL = {"ds3d_d2p2_bf16": 2e-2}


def _global_batch(name: str) -> int:
    dims, kind, _ = CASES[name]
    return 8 if kind == "pipeline_parallel" else MICRO * GAS * dict(dims)["data"]


def _build(name: str, fsdp: bool = False):
    """`name`'s layout, or (`fsdp`) its model under FSDP2 over all 4 ranks."""
    from atorch.auto import auto_accelerate
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig
    from atorch.utils.meta_model_utils import record_module_init
    from transformers import LlamaForCausalLM

    dims, kind, extra = CASES[name]
    config = tiny_llama_config(num_hidden_layers=LAYERS, tie_word_embeddings=name in TIED)
    if fsdp:  # FSDP2 takes a model built on a real device, the same on every rank (its weights are loaded next)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    else:
        with record_module_init():
            model = LlamaForCausalLM(config)
    if fsdp:
        dims, kind = [("data", 4)], "fsdp"
        config, loader_args = None, {"batch_size": _global_batch(name)}
    elif kind == "pipeline_parallel":
        config = extra
        loader_args = {"batch_size": _global_batch(name)}
    else:
        config = DeepSpeed3DParallelConfig(ds_config={"train_micro_batch_size_per_gpu": MICRO,
                                                      "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 9,
                                                      "torch_adam": True, **extra})
        loader_args = {}
    status, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                        dataset=TokenDataset(), dataloader_args=loader_args,
                                        load_strategy=[("parallel_mode", (dims, None)),
                                                       (kind, config) if config is not None else kind])
    assert status, name
    return result


def _train(result, name: str, steps: int, dataloader=None):
    from atorch import distributed as adist
    from atorch.auto import train_step

    loader = iter(dataloader if dataloader is not None else result.dataloader)
    losses = []
    for _ in range(steps):
        if CASES[name][1] == "pipeline_parallel" or adist.parallel_size_or_one("pipeline") == 1:
            loss = train_step(result, next(loader))
            data = adist.parallel_size_or_one("data")
            if data > 1:
                dist.all_reduce(loss, group=adist.parallel_group("data"))
            losses.append(loss.item() / data)
        else:  # the DeepSpeed dataloader yields micro-batches; one step takes GAS of them
            losses.append(train_step(result, [next(loader) for _ in range(GAS)]).item())
    return losses


def _pipeline_round_trips(root: str) -> dict:
    out = {}
    for name in CASES:
        result = _build(name)
        straight = _train(result, name, STEPS)
        del result
        dist.barrier()

        result = _build(name)
        first = _train(result, name, SAVE_AT)
        path = save_checkpoint(result, os.path.join(root, name, f"step_{SAVE_AT}"), step=SAVE_AT)
        del result
        dist.barrier()

        result = _build(name)
        with torch.no_grad():
            for p in result.model.parameters():
                p.mul_(0.5)
        state = load_checkpoint(result, path)
        resumed = _train(result, name, STEPS - SAVE_AT, dataloader=state.dataloader)
        out[name] = dict(straight=straight, first=first, resumed=resumed, path=path)
        del result, state
        dist.barrier()
        if name in TIED:
            out[name].update(_tied_across_layouts(name, path))
    return out


def _tied_across_layouts(name: str, path: str) -> dict:
    """The tied pipeline's checkpoint with its optimizer into FSDP2 (one tied parameter), saved there at once,
    and that checkpoint back into the pipeline (both copies from the one parameter's state); each continues."""
    result = _build(name, fsdp=True)
    state = load_checkpoint(result, path)
    tied_path = save_checkpoint(result, os.path.join(os.path.dirname(os.path.dirname(path)), "tied_fsdp",
                                                     f"step_{SAVE_AT}"), step=SAVE_AT)
    from_pipeline = _train(result, name, STEPS - SAVE_AT, dataloader=state.dataloader)
    del result, state
    dist.barrier()
    result = _build(name)
    state = load_checkpoint(result, tied_path)
    back = _train(result, name, STEPS - SAVE_AT, dataloader=state.dataloader)
    del state
    dist.barrier()
    # The untied pipeline's checkpoint (its embedding and head differ) into the tied one: refused on every rank
    # (each stage holds one copy), nothing loaded.
    before = [p.detach().clone() for p in result.model.parameters()]
    try:
        load_checkpoint(result, os.path.join(os.path.dirname(os.path.dirname(path)), "native_d2p2",
                                             f"step_{SAVE_AT}"), load_optimizer=False)
        untied = "loaded"
    except ValueError as e:
        untied = str(e)
    assert all(torch.equal(p, b) for p, b in zip(result.model.parameters(), before))
    del result
    dist.barrier()
    return {"fsdp_from_pipeline": from_pipeline, "pipeline_from_fsdp": back, "untied_into_tied": untied}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pipeline_ckpt"))
    return run_distributed(_pipeline_round_trips, 4, root, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_checkpoint_resumes_exactly_and_loads_into_one_process(runs, name):
    for rank_out in runs:
        r = rank_out[name]
        assert r["first"] == r["straight"][:SAVE_AT], (name, r)
        assert r["resumed"] == r["straight"][SAVE_AT:], (name, r["resumed"], r["straight"])
    # One process: the stages' checkpoint into a plain model + AdamW, then the same next global batches.
    expected = runs[0][name]["straight"][SAVE_AT:]
    model = tiny_llama(seed=5, num_hidden_layers=LAYERS, tie_word_embeddings=name in TIED)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    state = load_checkpoint(model, runs[0][name]["path"], optimizer=optim)
    assert state.optimizer_restored and not state.rng_restored  # 4 ranks saved, 1 loads
    # The fp32 master weights were saved (in bf16 too, not the module's bf16 copies: some are not bf16 numbers).
    weight = model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(weight, weight.to(torch.bfloat16).float())
    batches = global_batches(TokenDataset(), _global_batch(name), STEPS)[SAVE_AT:]
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name in ONE_PROCESS_REL):
            loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    rel = ONE_PROCESS_REL.get(name, 1e-4)
    for a, e in zip(losses, expected):
        assert abs(a - e) <= rel * abs(e), (name, losses, expected)
    if name in TIED:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        for rank_out in runs:
            # Into FSDP2: its arithmetic, within the one-process bound. Back into the pipeline: the copies' states
            # were equal (one weight, one summed gradient), so both come back from the one parameter bit for bit.
            for a, e in zip(rank_out[name]["fsdp_from_pipeline"], expected):
                assert abs(a - e) <= 1e-4 * abs(e), (rank_out[name]["fsdp_from_pipeline"], expected)
            assert rank_out[name]["pipeline_from_fsdp"] == expected, (rank_out[name]["pipeline_from_fsdp"], expected)
            assert "holds 'lm_head.weight' and 'model.embed_tokens.weight' as two different tensors" in \
                rank_out[name]["untied_into_tied"] or "holds 'model.embed_tokens.weight' and 'lm_head.weight' as two" \
                in rank_out[name]["untied_into_tied"], rank_out[name]["untied_into_tied"]


def test_native_pipeline_checkpoint_merges_for_from_pretrained(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    path = runs[0]["native_d2p2"]["path"]
    model, info = AutoModelForCausalLM.from_pretrained(merge_checkpoint(path, str(tmp_path / "hf")),
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    plain = tiny_llama(seed=5, num_hidden_layers=LAYERS)
    load_checkpoint(plain, path)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
