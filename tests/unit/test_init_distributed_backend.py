"""`init_distributed`'s backend: nccl without CUDA GPUs says so, and another backend than the running group's
is refused instead of silently kept (single process, a world of one on gloo)."""

import os

import pytest
import torch
import torch.distributed as dist

import atorch
from atorch.distributed import find_free_port


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    atorch.reset_distributed()


def test_nccl_without_cuda_gpus_says_to_use_gloo(world_of_one, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # also on a machine with GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    port = os.environ["MASTER_PORT"]
    for backend in ("nccl", "NCCL"):
        with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA GPUs, but .*; use backend='gloo' to run on "
                                             r"CPUs, or None \(the default\)") as info:
            atorch.init_distributed(backend)
        assert "LOCAL_RANK" not in str(info.value) and "Slurm" not in str(info.value)
    assert not dist.is_initialized() and os.environ["MASTER_PORT"] == port    # raised before any network use
    assert atorch.init_distributed(None) and dist.get_backend() == "gloo"     # the default picks gloo there


def test_another_backend_than_the_groups_is_refused(world_of_one):
    assert atorch.init_distributed("gloo")
    with pytest.raises(ValueError, match=r"init_distributed\(backend='nccl'\): the process group is already "
                                         r"initialized with backend 'gloo'.*reset_distributed\(\).*pass "
                                         r"backend='gloo' or None"):
        atorch.init_distributed("nccl")
    assert dist.get_backend() == "gloo"
    # The same backend again, in any case, or None: no-ops, as before.
    assert atorch.init_distributed("gloo") and atorch.init_distributed("GLOO") and atorch.init_distributed()
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1


def test_none_keeps_a_gloo_group_where_the_default_would_be_nccl(world_of_one, monkeypatch):
    assert atorch.init_distributed("gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # default_backend() now says nccl
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert atorch.init_distributed(None) and dist.get_backend() == "gloo"
