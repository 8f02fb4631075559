"""A 2-rank save reads none of its data files back to checksum them. An async save whose background part
fails on one rank only: every rank raises at its next wait, naming the failing rank and the error, and
none waits for the collective timeout; the previous checkpoint stays `latest`, and the next save works.

The collectives' timeout is 30 minutes (ATORCH_COLLECTIVE_TIMEOUT below) and the test's is 180 s: a rank
left waiting in a background collective for the failed one would be killed at 180 s and fail the test.
"""

import os
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from atorch.checkpoint import save_checkpoint, wait_for_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint import save_load
from atorch.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


def _raises(fn) -> str:
    try:
        fn()
    except OSError as e:
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
    return {"errors": errors, "latest": latest, "read_back": read_back,
            "failed_exist": [os.path.exists(os.path.join(root, n)) for n in ("step_2", "step_3")]}


def test_async_background_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_failing_rank, 2, root, timeout=180, env={"ATORCH_COLLECTIVE_TIMEOUT": "1800"})
    for r in results:
        first, second = r["errors"]
        assert first.startswith("OSError: ") and "failed on rank [1]" in first and "disk full" in first, first
        assert second.startswith("OSError: ") and "failed on rank [0]" in second and "I/O error" in second, second
        assert r["latest"] == ["step_1", "step_1", "step_4"]
        assert r["failed_exist"] == [False, False]
        assert r["read_back"] and not [n for n in r["read_back"] if n.endswith(".distcp")], r["read_back"]
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_1", "step_4"]
