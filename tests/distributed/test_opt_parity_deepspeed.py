"""DeepSpeed ZeRO stages 1, 2 and 3 (`zero1` / `zero2` / `fsdp` with use_ds_zero=True) on 2 gloo ranks
(DeepSpeed's CPU accelerator) train like plain single-process training, in fp32 and in bf16.

DeepSpeed receives the user's torch AdamW as its client optimizer, so the update rule is the
reference's; fp32 holds rel 1e-5 for the same reason as in test_opt_parity.py (observed ~1e-7).
bf16 is DeepSpeed's bf16 mode (bf16 weights in compute, fp32 master copies), compared with
the autocast reference at rel 2e-2 (observed ~1e-4). One spawn runs everything.
"""

import pytest
import torch
import torch.distributed as dist

from test_opt_parity import (
    BF16_REL,
    FP32_REL,
    GLOBAL_BATCH,
    STEPS,
    WORLD,
    check_run,
    dataset,
    reference,
    train_all,
)

from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed, tiny_llama

FP32 = {
    "zero1(ds)": [("zero1", {"use_ds_zero": True})],
    "zero2(ds)": [("zero2", {"use_ds_zero": True})],
    "fsdp(ds)": [("fsdp", {"use_ds_zero": True})],
}
BF16 = {f"amp_native+{name}": [("amp_native", {"dtype": torch.bfloat16}), *strategy]
        for name, strategy in FP32.items()}
GAMMA = 0.5


def _scheduler_is_stepped_by_the_engine():
    """An lr_scheduler_cls is built on the user's optimizer and stepped by engine.step()."""
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=dataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": GAMMA},
        load_strategy=[("zero2", {"use_ds_zero": True})])
    assert status
    for _, batch in zip(range(STEPS), result.dataloader):
        train_step(result, batch)
    lrs = [g["lr"] for g in result.optim.param_groups]
    result.args["engine"].destroy()
    del result
    dist.barrier()
    return lrs


def _train_deepspeed():
    out = train_all({**FP32, **BF16})
    out["scheduler_lrs"] = _scheduler_is_stepped_by_the_engine()
    return out


@pytest.fixture(scope="module")
def ds_runs():
    return run_distributed(_train_deepspeed, WORLD, timeout=600)


@pytest.mark.parametrize("name", list(FP32))
def test_deepspeed_fp32_parity(name, ds_runs):
    expected = reference()
    for rank, runs in enumerate(ds_runs):
        check_run(f"{name} (rank {rank})", runs[name], expected, FP32_REL)


@pytest.mark.parametrize("name", list(BF16))
def test_deepspeed_bf16_parity(name, ds_runs):
    expected = reference(autocast_dtype=torch.bfloat16)
    for rank, runs in enumerate(ds_runs):
        check_run(f"{name} (rank {rank})", runs[name], expected, BF16_REL)


def test_deepspeed_engine_steps_the_lr_scheduler(ds_runs):
    for runs in ds_runs:
        assert runs["scheduler_lrs"] == pytest.approx([1e-3 * GAMMA ** STEPS]), runs["scheduler_lrs"]
