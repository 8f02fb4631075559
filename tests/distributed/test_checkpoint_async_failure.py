"""Failures on one rank only are raised on every rank, promptly, with the same error naming that rank:

- a 2-rank save reads none of its data files back to checksum them;
- an async save whose background part fails on one rank: every rank raises at its next wait and none
  waits for the collective timeout; the previous checkpoint stays `latest`, and the next save works;
- an async save whose foreground host copy fails on one rank: `save_checkpoint` raises on every rank and
  nothing is left running in the background;
- `load_hf_weights` into a model that only one rank finds different from the folder (a pipeline stage);
- `save_parallelized(merge_checkpoints=True)` whose merge fails on rank 0 after longer than the default
  group's collective timeout: the waiting rank raises rank 0's error, not a timeout;
- save/load arguments given differently on one rank (async_save, save_optimizer, an optimizer, step, path,
  load_optimizer): every rank raises the same ValueError naming the argument and each rank's value, within
  seconds, before anything is written, and the next load works;
- a parent directory whose `latest` rank 1 reads differently: every rank loads the checkpoint rank 0 read, and
  one rank 1 cannot see raises on both ranks.
Every failed save removes its staging directory.

The collectives' timeout is 30 minutes (ATORCH_COLLECTIVE_TIMEOUT below) and the test's is 180 s: a rank
left waiting in a collective for the failed one would be killed at 180 s and fail the test.
"""
import datetime
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from atorch.checkpoint import load_checkpoint, merge, model_methods, save_checkpoint, save_load, wait_for_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint.async_save import AsyncCheckpointer
from atorch.checkpoint.model_methods import attach_checkpoint_methods, load_hf_weights
from atorch.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _failing_rank(root: str) -> Dict[str, object]:
    rank = dist.get_rank()
    model = _model()
    # On 2 ranks too, no rank reads a data file back to checksum it (each is hashed while written).
    read_back: List[str] = []
    real_checksum_file = mf.checksum_file

    def spy(path, algorithm=mf.DEFAULT_CHECKSUM):
        read_back.append(os.path.basename(path))
        return real_checksum_file(path, algorithm)

    mf.checksum_file = spy  # type: ignore[assignment]
    try:
        save_checkpoint(model, os.path.join(root, "step_1"), step=1)
    finally:
        mf.checksum_file = real_checksum_file  # type: ignore[assignment]
    errors: List[str] = []
    latest: List[str] = []

    # 1. Rank 1's background write fails after DCP wrote its shard (before the manifest).
    def disk_full(staging: str) -> None:
        raise OSError("disk full (simulated on rank 1)")

    save_load._before_commit_hook = disk_full if rank == 1 else None
    save_checkpoint(model, os.path.join(root, "step_2"), step=2, async_save=True)
    errors.append(_raises(wait_for_checkpoint))
    save_load._before_commit_hook = None
    latest.append(os.path.basename(mf.read_latest(root) or ""))

    # 2. Rank 0's checksums of its share of the files fail (after every rank wrote its data).
    real_record_files = mf.record_files

    def unreadable(root_dir, names, algorithm=mf.DEFAULT_CHECKSUM):
        raise OSError("I/O error reading back (simulated on rank 0)")

    mf.record_files = unreadable if rank == 0 else real_record_files  # type: ignore[assignment]
    try:
        save_checkpoint(model, os.path.join(root, "step_3"), step=3, async_save=True)
        errors.append(_raises(wait_for_checkpoint))
    finally:
        mf.record_files = real_record_files  # type: ignore[assignment]
    latest.append(os.path.basename(mf.read_latest(root) or ""))

    # The error is raised once; the next async save commits.
    save_checkpoint(model, os.path.join(root, "step_4"), step=4, async_save=True)
    wait_for_checkpoint()
    latest.append(os.path.basename(mf.read_latest(root) or ""))

    # 3. Rank 1 cannot copy its tensors to host memory (the foreground part of an async save).
    real_copy = AsyncCheckpointer._copy

    def no_memory(self, key, src):
        raise MemoryError("cannot allocate a host buffer (simulated on rank 1)")

    AsyncCheckpointer._copy = no_memory if rank == 1 else real_copy  # type: ignore[method-assign]
    try:
        errors.append(_raises(lambda: save_checkpoint(model, os.path.join(root, "step_5"), step=5,
                                                      async_save=True)))
    finally:
        AsyncCheckpointer._copy = real_copy  # type: ignore[method-assign]
    errors.append(_raises(wait_for_checkpoint))   # nothing was left in the background
    latest.append(os.path.basename(mf.read_latest(root) or ""))

    # 4. A Hugging Face folder, then a model that only rank 1 finds different from it (a pipeline stage).
    hf_dir = os.path.join(root, "hf")
    attach_checkpoint_methods(model).save_parallelized(hf_dir, merge_checkpoints=True)
    other = _model()
    if rank == 1:
        other.extra = nn.Parameter(torch.zeros(3))
    errors.append(_raises(lambda: load_hf_weights(other, hf_dir)))

    # 5. Rank 0's merge fails after longer than the default group's collective timeout (shortened once
    # the sharded save is done): the waiting rank gets rank 0's error, not a timeout.
    real_merge, real_save = merge.merge_checkpoint, model_methods.save_checkpoint

    def slow_failing_merge(*args, **kwargs):
        time.sleep(5)
        raise OSError("disk full while merging (simulated on rank 0)")

    def save_then_short_timeout(*args, **kwargs):
        out = real_save(*args, **kwargs)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2))
        return out

    merge.merge_checkpoint = slow_failing_merge  # type: ignore[assignment]
    model_methods.save_checkpoint = save_then_short_timeout  # type: ignore[assignment]
    start = time.monotonic()
    try:
        errors.append(_raises(lambda: model_methods.save_parallelized(model, os.path.join(root, "hf_failed"),
                                                                      merge_checkpoints=True)))
    finally:
        merge.merge_checkpoint, model_methods.save_checkpoint = real_merge, real_save  # type: ignore[assignment]
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=1800))
    merge_s = time.monotonic() - start

    # 6. Arguments that only one rank gets different: agreed on before any other collective (async_save on
    # one rank used to hang in its background group's creation, save_optimizer in the optimizer gather).
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step_7, step_4 = os.path.join(root, "step_7"), os.path.join(root, "step_4")
    disagreements = [
        lambda: save_checkpoint(model, step_7, step=7, async_save=rank == 0),
        lambda: save_checkpoint(model, step_7, step=7, optimizer=optim, save_optimizer=rank == 0),
        lambda: save_checkpoint(model, step_7, step=7, optimizer=optim if rank == 0 else None),
        lambda: save_checkpoint(model, step_7, step=7 + rank),
        lambda: save_checkpoint(model, f"{step_7}_rank{rank}", step=7),
        lambda: load_checkpoint(model, os.path.join(root, ("step_1", "step_4")[rank])),
        lambda: load_checkpoint(model, step_4, optimizer=optim, load_optimizer=rank == 0),
    ]
    start = time.monotonic()
    disagreed = [_raises(call) for call in disagreements]
    disagree_s = time.monotonic() - start

    # 7. `<root>/latest` read differently on rank 1 (a save committing between the ranks' reads, a node whose view
    # lags): every rank loads the checkpoint rank 0 read; one that rank 1 cannot see raises on both ranks.
    real_resolve, real_is_checkpoint = mf.resolve_checkpoint_dir, mf.is_checkpoint
    latest_name = os.path.basename(mf.read_latest(root) or "")
    if rank == 1:
        mf.resolve_checkpoint_dir = lambda p: os.path.join(root, "step_1")  # type: ignore[assignment]
    try:
        latest_step = load_checkpoint(model, root).step
    finally:
        mf.resolve_checkpoint_dir = real_resolve  # type: ignore[assignment]
    if rank == 1:
        mf.is_checkpoint = lambda p: (real_is_checkpoint(p)  # type: ignore[assignment]
                                      and os.path.basename(os.path.normpath(p)) != "step_4")
    try:
        latest_unseen = _raises(lambda: load_checkpoint(model, root))
    finally:
        mf.is_checkpoint = real_is_checkpoint  # type: ignore[assignment]
    loaded_after = load_checkpoint(model, step_4).step   # nothing was left half-done on either rank
    dist.barrier()
    return {"errors": errors, "latest": latest, "read_back": read_back, "merge_s": merge_s,
            "failed_exist": [os.path.exists(os.path.join(root, n)) for n in ("step_2", "step_3", "step_5")],
            "disagreed": disagreed, "disagree_s": disagree_s, "loaded_after": loaded_after,
            "resolved": (latest_name, latest_step, latest_unseen)}


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_failing_rank, 2, root, timeout=180, env={"ATORCH_COLLECTIVE_TIMEOUT": "1800"})
    for r in results:
        disk_full, unreadable, no_memory, after_no_memory, hf_mismatch, merge_failed = r["errors"]
        assert disk_full.startswith("OSError: ") and "failed on rank [1]" in disk_full and "disk full" in disk_full
        assert unreadable.startswith("OSError: ") and "failed on rank [0]" in unreadable and "I/O error" in unreadable
        assert no_memory.startswith("MemoryError: ") and "copying the tensors to host memory" in no_memory
        assert "failed on rank [1]" in no_memory and "simulated on rank 1" in no_memory, no_memory
        assert after_no_memory == "no error"
        assert hf_mismatch.startswith("CheckpointError: ") and "failed on rank [1]" in hf_mismatch, hf_mismatch
        assert "extra" in hf_mismatch, hf_mismatch
        assert merge_failed.startswith("OSError: ") and "failed on rank [0]" in merge_failed, merge_failed
        assert "disk full while merging" in merge_failed, merge_failed
        assert r["merge_s"] < 60, r["merge_s"]
        assert r["latest"] == ["step_1", "step_1", "step_4", "step_4"]
        assert r["failed_exist"] == [False, False, False]
        assert r["read_back"] and not [n for n in r["read_back"] if n.endswith(".distcp")], r["read_back"]
    # 6. The same error on every rank, naming the argument and what each rank had.
    root_real = os.path.abspath(root)
    expected = [("save_checkpoint", "async_save: True on rank [0]; False on rank [1]"),
                ("save_checkpoint", "save_optimizer: True on rank [0]; False on rank [1]"),
                ("save_checkpoint", "save_optimizer: True on rank [0]; True, but the target has no optimizer on "
                                    "rank [1]"),
                ("save_checkpoint", "step: 7 on rank [0]; 8 on rank [1]"),
                ("save_checkpoint", f"path: {root_real}/step_7_rank0 on rank [0]; {root_real}/step_7_rank1 on rank "
                                    "[1]"),
                ("load_checkpoint", f"path: {root_real}/step_1 on rank [0]; {root_real}/step_4 on rank [1]"),
                ("load_checkpoint", "load_optimizer: True on rank [0]; False on rank [1]")]
    assert results[0]["disagreed"] == results[1]["disagreed"]
    for got, (func, values) in zip(results[0]["disagreed"], expected):
        assert got.startswith(f"ValueError: {func}: the ranks were given different "), got
        assert got.endswith(values), got
    for r in results:
        assert r["disagree_s"] < 30, r["disagree_s"]
        assert r["loaded_after"] == 4
    # 7. Rank 1's own reading of `latest` (step_1) is not used: both ranks loaded the checkpoint rank 0 read.
    # One that rank 1 cannot see raises the same error on both ranks, naming it.
    assert [r["resolved"][:2] for r in results] == [("step_4", 4), ("step_4", 4)]
    unseen = results[0]["resolved"][2]
    assert unseen == results[1]["resolved"][2]
    assert unseen.startswith("CheckpointError: load_checkpoint(") and "locating the checkpoint failed on rank [1]" \
        in unseen and "resolved to 'step_4' on rank 0, which is not a complete checkpoint here" in unseen, unseen
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_1", "step_4"]
    # Every failed save (and the failed merge's temporary sharded copy) left nothing behind.
    assert sorted(os.listdir(root)) == ["hf", "latest", "step_1", "step_4"]
