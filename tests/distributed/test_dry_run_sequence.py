"""Candidates in sequence in one process: no candidate inherits state from the previous one.

The dry runner destroys a clean candidate's process groups with torch.distributed; DeepSpeed
caches groups in module globals (the clone of the world its ZeRO engines reduce over) and used
to hand the destroyed one to the next DeepSpeed engine ("Group ... is not registered"). Here a
DeepSpeed engine follows another DeepSpeed engine (stage 1, then stage 3 with gradient
accumulation: the `make demo` failure) and torch FSDP2 and DeepSpeed alternate, in one process
per rank; every dry run must succeed and DeepSpeed must hold no group of a finished candidate.

Nor its memory: a DeepSpeed engine's hooks close over its optimizer from inside autograd's and
the modules' C++ side, cycles gc cannot see, so until the dry runner destroyed the engine (and, for
ZeRO-3, emptied what destroy() leaves referenced) every DeepSpeed candidate kept its model, master
weights and optimizer state alive (a 35M-parameter model's sweep of the default space reached 12 GB
a rank). The live tensor bytes after a DeepSpeed dry run may not exceed those before it by half the
model's bytes (2-2.5x the model without the fix).
"""

import pytest
import torch

from atorch.testing import run_distributed, tiny_llama

SEQUENCE = [
    ["parallel_mode", ("zero1", {"use_ds_zero": True})],
    [("parallel_mode", ([("data", 2)], None)), ("gradient_accumulation", {"steps": 4}),
     ("fsdp", {"use_ds_zero": True})],
    ["parallel_mode", "fsdp"],
    ["parallel_mode", ("zero2", {"use_ds_zero": True})],
    ["parallel_mode", "fsdp"],
]


def _sequence():
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.testing.live_memory import live_tensor_bytes
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=64, seq_len=32), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 8})
    config = DryRunConfig(warmup_steps=1, profile_steps=1, max_profile_steps=1, timeout_s=120)
    out = []
    for spec in SEQUENCE:
        strategy = Strategy(spec)
        before = live_tensor_bytes()
        result = dry_run(ctx, strategy, config)
        cached = ds_groups._WORLD_GROUP
        out.append((strategy.describe(), result.ok, result.error,
                    cached is None or cached in dist.distributed_c10d._world.pg_map,
                    live_tensor_bytes() - before, sum(p.numel() * p.element_size() for p in ctx.model.parameters())))
    return out


@pytest.mark.distributed
@pytest.mark.heavy
def test_deepspeed_and_fsdp_candidates_in_sequence():
    pytest.importorskip("deepspeed")
    rank0, rank1 = run_distributed(_sequence, 2, timeout=600)
    assert [r[:4] for r in rank0] == [r[:4] for r in rank1]
    for (name, ok, error, cache_valid, grown, model_bytes), spec in zip(rank0, SEQUENCE):
        assert ok, (name, error)
        assert cache_valid, f"DeepSpeed still caches a destroyed group after {name}"
        if "deepspeed" in name:
            assert grown < model_bytes / 2, f"{name} left {grown} bytes of tensors alive (model: {model_bytes})"
