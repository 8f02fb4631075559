"""`save_checkpoint(..., async_save=True)` on 2 FSDP2 ranks: the call returns once the state is on the host,
training (collectives on the default group) goes on while the background part runs on its own gloo group,
the checkpoint appears (with `latest`) only when committed, holds the weights of the moment of the call,
and a background failure is raised by the next wait while the previous checkpoint stays `latest`."""

import os
import threading
from typing import Dict

import torch

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, wait_for_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint import save_load
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset


def _build(seed: int):
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode", "fsdp"])
    assert status
    return result


def _full(model) -> Dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def _async_rank(root: str) -> Dict[str, object]:
    result = _build(seed=0)
    batches = iter(result.dataloader)
    train_step(result, next(batches))
    at_save = {k: v.clone() for k, v in _full(result.model).items()}

    # The background part stops before its manifest until the foreground has trained a step.
    trained, in_background = threading.Event(), threading.Event()

    def hold(staging: str) -> None:
        in_background.set()
        assert trained.wait(120), "the training step did not run while the save was in the background"

    save_load._before_commit_hook = hold
    out = save_checkpoint(result, os.path.join(root, "step_1"), step=1, async_save=True)
    assert in_background.wait(120)
    # Training collectives on the default group while the background one holds its own group.
    train_step(result, next(batches))
    not_yet = (os.path.exists(out), mf.read_latest(root))
    trained.set()
    wait_for_checkpoint()
    save_load._before_commit_hook = None
    committed = (mf.is_checkpoint(out), os.path.basename(mf.read_latest(root)))

    # The checkpoint holds the weights of the moment of the call, not those after the next step.
    fresh = _build(seed=1)
    state = load_checkpoint(fresh, root)
    loaded = _full(fresh.model)
    same = all(torch.equal(loaded[k], v) for k, v in at_save.items())
    moved = any(not torch.equal(_full(result.model)[k], v) for k, v in at_save.items())

    # A second async save (sha256, keep_last=1) rotates the first once committed.
    save_checkpoint(result, os.path.join(root, "step_2"), step=2, async_save=True, checksum="sha256", keep_last=1)
    wait_for_checkpoint()
    algorithms = {r.algorithm for r in mf.Manifest.read(os.path.join(root, "step_2")).files.values()}
    remaining = [os.path.basename(p) for p, _ in mf.list_checkpoints(root)]

    # A failure in the background (here on every rank) is raised by the next wait; `latest` stays.
    def fail(staging: str) -> None:
        raise OSError("disk full (simulated)")

    save_load._before_commit_hook = fail
    save_checkpoint(result, os.path.join(root, "step_3"), step=3, async_save=True)
    error = None
    try:
        wait_for_checkpoint()
    except OSError as e:
        error = str(e)
    save_load._before_commit_hook = None
    wait_for_checkpoint()  # the error is raised once
    return {"not_yet": not_yet, "committed": committed, "step": state.step, "same": same, "moved": moved,
            "algorithms": algorithms, "remaining": remaining, "error": error,
            "latest_after_failure": os.path.basename(mf.read_latest(root)),
            "step_3_exists": os.path.exists(os.path.join(root, "step_3"))}


def test_async_save_on_two_fsdp_ranks(tmp_path):
    root = str(tmp_path)
    for r in run_distributed(_async_rank, 2, root, timeout=300):
        assert r["not_yet"] == (False, None), "the checkpoint or `latest` appeared before the commit"
        assert r["committed"] == (True, "step_1")
        assert r["step"] == 1 and r["same"] and r["moved"]
        assert r["algorithms"] == {"sha256"} and r["remaining"] == ["step_2"]
        assert r["error"].endswith("failed on ranks [0, 1]: disk full (simulated)"), r["error"]
        assert r["latest_after_failure"] == "step_2" and not r["step_3_exists"]
    # The failed save left nothing: no checkpoint, and its staging directory was removed.
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_2"]
    assert not [e for e in os.listdir(root) if mf.STAGING_MARK in e], os.listdir(root)
    try:
        load_checkpoint(tiny_llama(seed=2), os.path.join(root, "step_3"))
        raise AssertionError("step_3 must not load")
    except CheckpointError as e:
        assert "no such checkpoint" in str(e)
