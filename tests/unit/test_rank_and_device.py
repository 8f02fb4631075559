"""One rank reader (atorch.distributed's `rank()`), used by the logging and metrics helpers: an empty RANK is
unset, not a crash; and `set_cuda_device_using_local_rank` picks the device `cuda_index()` picks."""

import logging

import pytest
import torch
import torch.distributed as dist

from atorch.distributed import init_distributed, local_rank, rank, world_size
from atorch.utils.quiet import log_level
from atorch.utils.trackers import MetricsLogger


def test_an_empty_rank_variable_counts_as_unset(monkeypatch, tmp_path):
    monkeypatch.delenv("ATORCH_LOG_LEVEL", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")
    assert (rank(), world_size(), local_rank()) == (0, 1, 0)
    assert MetricsLogger(str(tmp_path / "a"), log_with="jsonl").enabled   # rank 0 logs
    assert log_level() == logging.INFO
    monkeypatch.setenv("RANK", "3")
    assert rank() == 3 and not MetricsLogger(str(tmp_path / "b"), log_with="jsonl").enabled
    assert log_level() == logging.WARNING
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="environment variable RANK='x' must be an integer"):
        MetricsLogger(str(tmp_path / "c"), log_with="jsonl")


def test_set_cuda_device_using_local_rank_never_shares_a_gpu_silently(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)   # only the keyword is applied
    for local, expected in (("0", 0), ("1", 1)):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert init_distributed("gloo", set_cuda_device_using_local_rank=True)
        assert chosen[-1] == expected
    # LOCAL_RANK 3 with 2 GPUs visible: it used to take cuda:1 (3 % 2), the GPU of LOCAL_RANK 1.
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but this process sees 2 GPU"):
        init_distributed("gloo", set_cuda_device_using_local_rank=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)   # --gpus-per-task=1: its one GPU
    assert init_distributed("gloo", set_cuda_device_using_local_rank=True) and chosen[-1] == 0
