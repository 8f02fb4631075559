"""Per-rank training-state bytes under sharding, on 2 gloo ranks, measured with memory_breakdown after
one optimizer step (gradients still present):

- fsdp and zero2 (FSDP2): parameters, gradients and optimizer state each <= 1.05 x unsharded / N
  (the issue's bound), and the ranks' shares add up to the unsharded bytes (nothing dropped);
- zero1 (ZeroRedundancyOptimizer): full parameters and gradients, optimizer state split;
- DeepSpeed ZeRO-3: parameter partitions and optimizer state (fp32 master partition + Adam
  moments) within the same 1.05 bound of their unsharded sizes.
The unsharded baseline is the same model and AdamW after one step in this process.
"""

from typing import Dict

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate
from atorch.auto.model_context import call_model
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset
from atorch.utils.memory import MemoryBreakdown, memory_breakdown

WORLD, BATCH = 2, 8
BOUND = 1.05
STRATEGIES = {
    "fsdp": ["fsdp"],
    "zero2": ["zero2"],
    "zero1": ["zero1"],
    "fsdp(ds)": [("fsdp", {"use_ds_zero": True})],
}


def _one_step_breakdown(strategy) -> Dict[str, int]:
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": BATCH}, load_strategy=strategy)
    assert status
    batch = result.prepare_input(next(iter(result.dataloader)))
    loss = result.loss_func(batch, call_model(result.model, batch, "unpack_dict"))
    engine = result.args["engine"]
    if engine is not None:
        engine.backward(loss)
        engine.step()
        breakdown = memory_breakdown(engine.module, engine.optimizer)
        engine.destroy()
    else:
        loss.backward()
        result.optim.step()
        breakdown = memory_breakdown(result.model, result.optim)
    del result, engine
    dist.barrier()
    return breakdown.as_dict()


def _measure_all():
    return {name: _one_step_breakdown(strategy) for name, strategy in STRATEGIES.items()}


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_measure_all, WORLD, timeout=600)


@pytest.fixture(scope="module")
def unsharded() -> MemoryBreakdown:
    model = tiny_llama(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = TokenDataset().tokens[:BATCH]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optim.step()
    return memory_breakdown(model, optim)


def _check_sharded(name: str, ranks, full: MemoryBreakdown, fields) -> None:
    for field in fields:
        limit = BOUND * getattr(full, field) / WORLD
        for rank, measured in enumerate(ranks):
            assert measured[field] <= limit, (f"{name} rank {rank}: {field}={measured[field]} > {BOUND} x "
                                              f"{getattr(full, field)} / {WORLD} = {limit:.0f}")


@pytest.mark.parametrize("name", ["fsdp", "zero2"])
def test_fsdp_holds_one_nth_of_the_training_state(name, per_rank, unsharded):
    ranks = [r[name] for r in per_rank]
    _check_sharded(name, ranks, unsharded, ("param_bytes", "grad_bytes", "optim_state_bytes", "total_bytes"))
    # The shares cover everything: each parameter element lives on exactly one rank.
    assert sum(r["param_bytes"] for r in ranks) == unsharded.param_bytes
    assert sum(r["grad_bytes"] for r in ranks) == unsharded.grad_bytes


def test_zero1_splits_only_the_optimizer_state(per_rank, unsharded):
    ranks = [r["zero1"] for r in per_rank]
    for r in ranks:
        assert r["param_bytes"] == unsharded.param_bytes and r["grad_bytes"] == unsharded.grad_bytes
        assert 0 < r["optim_state_bytes"] < unsharded.optim_state_bytes
    # Whole parameters are assigned to ranks, so the split is uneven but complete.
    assert sum(r["optim_state_bytes"] for r in ranks) == unsharded.optim_state_bytes


def test_deepspeed_zero3_partitions_params_and_optimizer_state(per_rank, unsharded):
    ranks = [r["fsdp(ds)"] for r in per_rank]
    # DeepSpeed also keeps an fp32 master partition: optimizer state = moments + master copy.
    full_state = MemoryBreakdown(unsharded.param_bytes, 0, unsharded.optim_state_bytes + unsharded.param_bytes)
    _check_sharded("fsdp(ds)", ranks, full_state, ("param_bytes", "optim_state_bytes"))
    assert sum(r["param_bytes"] for r in ranks) == unsharded.param_bytes
