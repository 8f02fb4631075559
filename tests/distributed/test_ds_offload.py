"""DeepSpeed ZeRO offload through `ds_config` on 2 CPU ranks (DS_ACCELERATOR=cpu, gloo) trains like
plain single-process AdamW training.

Offload runs DeepSpeed's CPU Adam (its C++ op, prebuilt by `make install`): either built by
DeepSpeed from ds_config's `optimizer` section (optim_func=None), or passed as optim_func. CPU
Adam is a different implementation of the AdamW update (fused, vectorized, fp32), so the
tolerance is rel 1e-4 rather than the 1e-5 of the client-optimizer tests; it still fails a run
that does not train (the loss falls ~6% in 5 steps, see test_opt_parity.py). One spawn runs all.
"""

import traceback

import pytest
import torch
import torch.distributed as dist

from test_opt_parity import GLOBAL_BATCH, LR, STEPS, WORLD, _global_loss, dataset, reference, untrained_losses

from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import assert_close_losses

pytestmark = pytest.mark.heavy   # one spawn, 4 DeepSpeed engines: ~1-3 min on the 2-core machine

OFFLOAD_REL = 1e-4
WEIGHT_DECAY = 0.01   # torch AdamW's default, which the reference uses
ADAMW_SECTION = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
OFFLOAD_OPTIMIZER = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_BOTH = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def _cpu_adam():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


# A checkpoint saved before step SAVE_AT of this run is resumed by a fresh engine: CPU Adam keeps its
# step count as a Python int, which the checkpoint once left out (bias correction restarted).
RESUMED = "zero2 offload optimizer (DeepSpeedCPUAdam)"
SAVE_AT = 3

# name -> (strategy, optim_func name, optim_args)
RUNS = {
    "zero1 offload optimizer (ds_config optimizer)":
        ([("zero1", {"use_ds_zero": True, "ds_config": {"zero_optimization": OFFLOAD_OPTIMIZER,
                                                          "optimizer": ADAMW_SECTION}})], None, {}),
    "zero2 offload optimizer (DeepSpeedCPUAdam)":
        ([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": OFFLOAD_OPTIMIZER}})], "cpu_adam",
         {"lr": LR, "weight_decay": WEIGHT_DECAY, "adamw_mode": True}),
    "fsdp offload optimizer and params (ds_config optimizer)":
        ([("fsdp", {"use_ds_zero": True, "ds_config": {"zero_optimization": OFFLOAD_BOTH,
                                                         "optimizer": ADAMW_SECTION}})], None, {}),
    "zero2 offload with a torch optimizer":
        ([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": OFFLOAD_OPTIMIZER}})], "adamw",
         {"lr": LR}),
}


def _accelerate(strategy, optim_name, optim_args):
    optim_func = {"cpu_adam": _cpu_adam() if optim_name == "cpu_adam" else None, "adamw": torch.optim.AdamW,
                  None: None}[optim_name]
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=optim_func, dataset=dataset(), optim_args=optim_args,
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, f"auto_accelerate returned status=False for {strategy} (see the log above)"
    return result


def _resumed_losses(strategy, optim_name, optim_args, path):
    """The steps after the checkpoint at `path`, trained again by a fresh engine that loads it."""
    from atorch.checkpoint import load_checkpoint

    result = _accelerate(strategy, optim_name, optim_args)
    state = load_checkpoint(result, path)
    losses = [_global_loss(train_step(result, batch)) for _, batch in zip(range(STEPS - SAVE_AT), state.dataloader)]
    result.args["engine"].destroy()
    return losses


def _train(strategy, optim_name, optim_args, resume_dir=None):
    from atorch.checkpoint import save_checkpoint

    result = _accelerate(strategy, optim_name, optim_args)
    losses = []
    for step, batch in zip(range(STEPS), result.dataloader):
        if resume_dir is not None and step == SAVE_AT:
            path = save_checkpoint(result, resume_dir, step=step)
        losses.append(_global_loss(train_step(result, batch)))
    engine = result.args["engine"]
    zero = engine.zero_optimization_stage(), bool(engine.zero_offload_optimizer()), bool(engine.zero_offload_param())
    out = {"losses": losses, "optim": type(engine.optimizer).__name__,
           "basic_optim": type(engine.basic_optimizer).__name__, "zero": zero,
           "summary": dict(result.summaries.get(strategy[0][0], {}))}
    engine.destroy()
    del result, engine
    dist.barrier()
    if resume_dir is not None:
        out["resumed"] = _resumed_losses(strategy, optim_name, optim_args, path)
    return out


def _train_offload(root):
    out = {}
    for name, (strategy, optim_name, optim_args) in RUNS.items():
        resume_dir = f"{root}/resume" if name == RESUMED else None
        try:
            out[name] = _train(strategy, optim_name, optim_args, resume_dir)
        except ValueError:   # raised on every rank before any collective: the ranks stay in step
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    return run_distributed(_train_offload, WORLD, str(tmp_path_factory.mktemp("offload")), timeout=600)


@pytest.mark.parametrize("name", [n for n in RUNS if "torch optimizer" not in n])
def test_offload_trains_like_plain_adamw(name, offload_runs):
    expected = list(reference())
    with pytest.raises(AssertionError):   # the tolerance rejects a run that does not train
        assert_close_losses(untrained_losses(), expected, rel=OFFLOAD_REL)
    for rank, runs in enumerate(offload_runs):
        run = runs[name]
        assert "error" not in run, f"{name} (rank {rank}) was rejected:\n{run['error']}"
        assert_close_losses(run["losses"], expected, rel=OFFLOAD_REL, what=f"{name} (rank {rank})")
        strategy = RUNS[name][0]
        stage = {"zero1": 1, "zero2": 2, "fsdp": 3}[strategy[0][0]]
        params_offloaded = "offload_param" in strategy[0][1]["ds_config"]["zero_optimization"]
        assert run["zero"] == (stage, True, params_offloaded), run["zero"]
        assert run["basic_optim"] == "DeepSpeedCPUAdam", run["basic_optim"]
        assert run["summary"]["offload_optimizer"] == "cpu"
        assert run["summary"]["offload_param"] == ("cpu" if params_offloaded else "none")


def test_offload_with_a_torch_optimizer_is_refused_on_every_rank(offload_runs):
    for runs in offload_runs:
        error = runs["zero2 offload with a torch optimizer"].get("error", "")
        assert "zero2: ds_config offloads the optimizer, which runs DeepSpeed's CPU Adam; optim_func='AdamW'" in error


def test_a_resume_of_cpu_adam_continues_exactly(offload_runs):
    for rank, runs in enumerate(offload_runs):
        run = runs[RESUMED]
        assert "error" not in run, run.get("error")
        # Same layout, same engine: the resumed steps are the straight run's, bit for bit.
        assert run["resumed"] == run["losses"][SAVE_AT:], (rank, run["resumed"], run["losses"])
