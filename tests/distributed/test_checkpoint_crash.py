"""A save killed midway (SIGKILL after the shards are written, before the manifest) leaves the previous
checkpoint loadable and `latest` unchanged; the partial directory is never taken for a checkpoint, and
the next save cleans it up."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint import save_load
from atorch.testing import DistributedTestError, run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset


def _save_twice_and_die(root: str) -> None:
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    assert status
    batches = iter(result.dataloader)
    train_step(result, next(batches))
    save_checkpoint(result, os.path.join(root, "step_1"), step=1)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in result.model.module.state_dict().items()},
                  os.path.join(root, "weights_at_step_1.safetensors"))
    train_step(result, next(batches))

    def die_before_manifest(staging: str) -> None:
        dist.barrier()  # every rank has written its shards and RNG file
        if dist.get_rank() == 0:
            with open(os.path.join(root, "staging_contents.txt"), "w") as f:
                f.write("\n".join(mf.list_files(staging)))
            os.kill(os.getpid(), signal.SIGKILL)

    save_load._before_commit_hook = die_before_manifest
    save_checkpoint(result, os.path.join(root, "step_2"), step=2)
    raise AssertionError("unreachable: rank 0 was killed inside save_checkpoint")


def test_killed_save_leaves_previous_checkpoint_and_latest(tmp_path):
    root = str(tmp_path)
    # Rank 0 dies; rank 1 then fails in the save's barrier (which one is reported first is a race).
    with pytest.raises(DistributedTestError):
        run_distributed(_save_twice_and_die, 2, root, timeout=180)

    # The killed save got as far as the shards.
    written = open(os.path.join(root, "staging_contents.txt")).read().split()
    assert any(n.endswith(".distcp") for n in written) and "meta.json" in written
    assert mf.MANIFEST_NAME not in written
    partial = [e for e in os.listdir(root) if e.startswith("step_2" + mf.STAGING_MARK)]
    assert len(partial) == 1 and not os.path.exists(os.path.join(root, "step_2"))

    # `latest` still names step_1, and only step_1 is a checkpoint.
    assert open(os.path.join(root, mf.LATEST_NAME)).read().strip() == "step_1"
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_1"]
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load_checkpoint(tiny_llama(seed=1), os.path.join(root, partial[0]))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tiny_llama(seed=1), os.path.join(root, "step_2"))

    # The previous checkpoint loads (through `latest`) with exactly the weights it was saved with.
    from safetensors.torch import load_file

    model = tiny_llama(seed=1)
    state = load_checkpoint(model, root)
    assert state.step == 1 and state.path == os.path.join(root, "step_1")
    expected = load_file(os.path.join(root, "weights_at_step_1.safetensors"))
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())

    # The next save of step_2 removes the partial directory and moves `latest`.
    save_checkpoint(model, os.path.join(root, "step_2"), step=2)
    assert not [e for e in os.listdir(root) if mf.STAGING_MARK in e]
    assert open(os.path.join(root, mf.LATEST_NAME)).read().strip() == "step_2"


def _async_save_and_die(root: str) -> None:
    import threading

    from atorch.checkpoint import wait_for_checkpoint

    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    assert status
    batches = iter(result.dataloader)
    train_step(result, next(batches))
    save_checkpoint(result, os.path.join(root, "step_1"), step=1, async_save=True)
    wait_for_checkpoint()
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in result.model.module.state_dict().items()},
                  os.path.join(root, "weights_at_step_1.safetensors"))
    train_step(result, next(batches))

    trained = threading.Event()

    def die_in_background(staging: str) -> None:
        # On the background thread, shards written, no manifest: rank 0 is killed once the
        # foreground has trained on while the save was in flight.
        assert trained.wait(120)
        if dist.get_rank() == 0:
            with open(os.path.join(root, "staging_contents.txt"), "w") as f:
                f.write("\n".join(mf.list_files(staging)))
            os.kill(os.getpid(), signal.SIGKILL)

    save_load._before_commit_hook = die_in_background
    save_checkpoint(result, os.path.join(root, "step_2"), step=2, async_save=True)
    train_step(result, next(batches))
    with open(os.path.join(root, f"trained_during_save_{dist.get_rank()}"), "w") as f:
        f.write("yes")
    trained.set()
    wait_for_checkpoint()  # rank 0 dies; rank 1's background barrier fails and is raised here
    raise AssertionError("unreachable: rank 0 was killed during its background save")


@pytest.mark.heavy
def test_killed_async_save_leaves_previous_checkpoint_and_latest(tmp_path):
    root = str(tmp_path)
    with pytest.raises(DistributedTestError):
        run_distributed(_async_save_and_die, 2, root, timeout=180)

    # Both ranks trained a step while the save was in the background, then rank 0 died before the manifest.
    assert all(os.path.exists(os.path.join(root, f"trained_during_save_{r}")) for r in range(2))
    written = open(os.path.join(root, "staging_contents.txt")).read().split()
    assert any(n.endswith(".distcp") for n in written) and "meta.json" in written
    assert mf.MANIFEST_NAME not in written
    partial = [e for e in os.listdir(root) if e.startswith("step_2" + mf.STAGING_MARK)]
    assert len(partial) == 1 and not os.path.exists(os.path.join(root, "step_2"))

    assert open(os.path.join(root, mf.LATEST_NAME)).read().strip() == "step_1"
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_1"]
    from safetensors.torch import load_file

    model = tiny_llama(seed=1)
    state = load_checkpoint(model, root)
    assert state.step == 1 and state.path == os.path.join(root, "step_1")
    expected = load_file(os.path.join(root, "weights_at_step_1.safetensors"))
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
