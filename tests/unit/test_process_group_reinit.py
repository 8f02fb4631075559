"""A plain process (a notebook, a script) can tear its world of one down and start again."""

import os

import torch.distributed as dist

import atorch


def test_init_reset_init_in_one_plain_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    atorch.init_distributed("gloo")
    assert dist.get_world_size() == 1
    atorch.reset_distributed()
    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ   # the fill-in is undone
    atorch.init_distributed("gloo")          # would fail with EADDRINUSE on the first world's port
    assert dist.is_initialized() and dist.get_world_size() == 1 and os.environ["MASTER_PORT"]
    atorch.reset_distributed()


def test_a_users_own_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(atorch.distributed.find_free_port()))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    port = os.environ["MASTER_PORT"]
    atorch.init_distributed("gloo")
    atorch.reset_distributed()
    assert os.environ["MASTER_PORT"] == port and os.environ["MASTER_ADDR"] == "127.0.0.1"
