"""Every single optimization and every valid pair among the core ones, on 2 gloo ranks, trains
like plain single-process training on the same global batches (fp32 strategies here; those
with amp_native are in test_opt_parity_amp.py, DeepSpeed in test_opt_parity_deepspeed.py).

The matrix is built from the registry: a pair is left out only when the optimizations' own
`conflicts` metadata says so, and a name the registry does not know stays in the matrix and
fails loudly. One spawn trains every strategy of a group (a spawn costs 5-20 s here); each
strategy is then its own test. Besides the losses, each run reports what was built (DDP,
DTensor shards, ZeroRedundancyOptimizer), so a strategy cannot pass by silently doing nothing.

Why rel 1e-5 holds in fp32: every rank computes the mean loss of its half of the global batch,
and gradients are averaged over the 2 ranks (DDP all-reduce / FSDP reduce-scatter), which is
the gradient of the global-batch mean up to the summation order; AdamW then applies the same
update. The observed differences are ~1e-7.
"""

from __future__ import annotations

import functools
import itertools
import traceback
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.auto.opt_lib import get_optimization
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, GLOBAL_BATCH, LR = 5, 8, 1e-3
# Tokens drawn from 16 ids only: the model learns their frequencies within 5 steps (the loss falls
# ~6%, from 6.96 to 6.53), so even the bf16 tolerance (2%) fails a strategy that does not train. On
# uniform tokens over the whole vocabulary the loss barely moves and 2% would accept anything.
LEARNABLE_VOCAB = 20
WORLD = 2
# The optimizations of the parity matrix.
CORE = ("parallel_mode", "amp_native", "fsdp", "zero1", "zero2", "checkpoint", "module_replace")
FP32_REL = 1e-5
BF16_REL = 2e-2
# An explicit parallel_mode config, so the pairs with parallel_mode differ from the singles (where
# parallel_mode is added implicitly) by going through the explicit-config path.
EXPLICIT_PARALLEL_MODE = ("parallel_mode", ([("data", WORLD)], None))


def conflicting(a: str, b: str) -> bool:
    """True when the registry metadata forbids the pair; unknown names are kept (to fail loudly)."""
    try:
        return b in get_optimization(a).conflicts or a in get_optimization(b).conflicts
    except ValueError:
        return False


def matrix() -> List[Tuple[str, ...]]:
    singles = [(name,) for name in CORE]
    pairs = [pair for pair in itertools.combinations(CORE, 2) if not conflicting(*pair)]
    return singles + pairs


def strategy_for(names: Sequence[str]) -> List[Any]:
    return [EXPLICIT_PARALLEL_MODE if n == "parallel_mode" and len(names) > 1 else n for n in names]


def key(names: Sequence[str]) -> str:
    return "+".join(names)


def is_bf16(names: Sequence[str]) -> bool:
    return "amp_native" in names  # amp_native's default dtype is bfloat16


def dataset() -> TokenDataset:
    return TokenDataset(vocab_size=LEARNABLE_VOCAB)


@functools.lru_cache(maxsize=None)  # each parametrized test compares with the same few references
def reference(autocast_dtype=None) -> Tuple[float, ...]:
    """Plain single-process training on the same global batches."""
    return tuple(reference_losses(tiny_llama(seed=0), global_batches(dataset(), GLOBAL_BATCH, STEPS), lr=LR,
                                  autocast_dtype=autocast_dtype))


def untrained_losses() -> List[float]:
    """Losses of a strategy whose optimizer never steps: what every tolerance must reject."""
    model = tiny_llama(seed=0)
    with torch.no_grad():
        return [model(**b).loss.item() for b in global_batches(dataset(), GLOBAL_BATCH, STEPS)]


def _global_loss(loss: torch.Tensor) -> float:
    # Per-rank losses are means over the local half-batch; the global-batch loss is their mean.
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _facts(result) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from atorch.auto.opt_lib._precision import has_autocast_forward

    model = result.model
    inner = getattr(model, "module", model)
    return {
        "model": type(model).__name__,
        "dtensor_params": any(isinstance(p, DTensor) for p in model.parameters()),
        "optim": type(result.optim).__name__,
        "inner_optim": type(getattr(result.optim, "optimizer", result.optim)).__name__,
        "engine": result.args.get("engine") is not None,
        "autocast_forward": has_autocast_forward(model) or has_autocast_forward(inner),
        "grad_scaler": result.args.get("grad_scaler") is not None,
        "param_dtype": str(next(model.parameters()).dtype),
        "applied": list(result.args["strategy"]),
    }


def train_strategy(strategy: List[Any], lr: float = LR, seed: int = 0) -> Dict[str, Any]:
    """Build with auto_accelerate, train STEPS steps with train_step, report losses and facts."""
    status, result, chosen = auto_accelerate(
        tiny_llama(seed=seed), optim_func=torch.optim.AdamW, dataset=dataset(), optim_args={"lr": lr},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, f"auto_accelerate returned status=False for {strategy} (see the log above)"
    losses = [_global_loss(train_step(result, batch)) for _, batch in zip(range(STEPS), result.dataloader)]
    use_ds_zero = any(isinstance(item.config, dict) and item.config.get("use_ds_zero") for item in chosen)
    out = {"losses": losses, "names": chosen.names(), "use_ds_zero": use_ds_zero, **_facts(result)}
    engine = result.args.get("engine")
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    # Measured: destroying the group while a DDP model is alive can hang; drop it, then barrier.
    del result, engine
    dist.barrier()
    return out


def train_all(strategies: Dict[str, List[Any]], lr: float = LR) -> Dict[str, Dict[str, Any]]:
    """Spawned on every rank: train each strategy in turn.

    A ValueError from validation is raised identically on every rank before any collective,
    so it is recorded and the next strategy runs; anything else is re-raised (with the
    strategy named) because the ranks may no longer be in step.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for name, strategy in strategies.items():
        try:
            out[name] = train_strategy(strategy, lr)
        except ValueError:
            out[name] = {"error": traceback.format_exc()}
        except Exception as e:
            raise RuntimeError(f"strategy {name} ({strategy}) failed: {e}") from e
    return out


def check_run(name: str, run: Dict[str, Any], expected: List[float], rel: float) -> None:
    """Losses within `rel` of the reference, and the wrappers the names promise were really built."""
    assert "error" not in run, f"{name} was rejected:\n{run['error']}"
    assert_close_losses(run["losses"], expected, rel=rel, what=name)
    names = run["names"]
    if run["use_ds_zero"]:
        assert run["engine"] and run["model"] == "DeepSpeedEngine", f"{name}: no DeepSpeed engine ({run['model']})"
        assert not run["autocast_forward"], f"{name}: DeepSpeed owns precision; autocast must not be added"
        return
    assert not run["engine"]
    sharded = any(n in names for n in ("fsdp", "zero2"))
    if sharded:
        assert run["dtensor_params"], f"{name}: parameters are not sharded DTensors"
        assert run["model"] != "DistributedDataParallel", f"{name}: a sharded model must not be wrapped in DDP"
    else:
        assert not run["dtensor_params"]
        assert run["model"] == "DistributedDataParallel", f"{name}: expected DDP, got {run['model']}"
    if "zero1" in names:
        assert run["inner_optim"] == "ZeroRedundancyOptimizer", f"{name}: optimizer is {run['inner_optim']}"
    # Sharded models compute in half precision through FSDP's MixedPrecisionPolicy, and a model
    # cast by `half` to the same dtype needs no autocast.
    expect_autocast = "amp_native" in names and not sharded and "half" not in names
    assert run["autocast_forward"] is expect_autocast, f"{name}: autocast_forward={run['autocast_forward']}"


def fp32_strategies() -> Dict[str, List[Any]]:
    return {key(names): strategy_for(names) for names in matrix() if not is_bf16(names)}


def bf16_strategies() -> Dict[str, List[Any]]:
    return {key(names): strategy_for(names) for names in matrix() if is_bf16(names)}


@pytest.fixture(scope="module")
def fp32_runs():
    return run_distributed(train_all, WORLD, fp32_strategies(), timeout=600)


@pytest.fixture(scope="module")
def fp32_reference():
    return reference()


def test_matrix_covers_singles_and_every_non_conflicting_pair():
    names = [key(m) for m in matrix()]
    assert len(names) == len(set(names))
    # With the registry's metadata, exactly the three sharding pairs are invalid.
    left_out = {key(p) for p in itertools.combinations(CORE, 2)} - set(names)
    assert left_out == {"fsdp+zero1", "fsdp+zero2", "zero1+zero2"}, left_out
    assert len(names) == len(CORE) + 21 - 3


def test_tolerances_can_fail(fp32_reference):
    # Both tolerances reject a strategy that does not train (its losses are the untrained model's).
    untrained = untrained_losses()
    for rel in (FP32_REL, BF16_REL):
        with pytest.raises(AssertionError):
            assert_close_losses(untrained, fp32_reference, rel=rel)


@pytest.mark.parametrize("name", list(fp32_strategies()))
def test_fp32_parity(name, fp32_runs, fp32_reference):
    for rank, runs in enumerate(fp32_runs):
        check_run(f"{name} (rank {rank})", runs[name], fp32_reference, FP32_REL)
