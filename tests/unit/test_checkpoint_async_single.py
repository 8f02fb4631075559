"""`async_save=True` in one process: the checkpoint holds the state of the moment of the call even when the
model changes at once, appears only when committed, and a synchronous save or load waits for it."""

import os
import threading

import torch
from torch import nn

from atorch.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint import save_load
from atorch.checkpoint.async_save import checkpointer


def test_async_save_snapshots_then_commits_in_the_background(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    release = threading.Event()
    monkeypatch.setattr(save_load, "_before_commit_hook", lambda staging: release.wait(30))
    out = save_checkpoint(model, str(tmp_path / "step_1"), step=1, optimizer=optim, async_save=True)
    assert checkpointer().pending() and not os.path.exists(out) and mf.read_latest(str(tmp_path)) is None
    with torch.no_grad():  # the live weights change while the save is in flight
        for p in model.parameters():
            p.add_(1.0)
    release.set()
    wait_for_checkpoint()
    assert not checkpointer().pending() and mf.read_latest(str(tmp_path)) == out

    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    assert load_checkpoint(fresh, str(tmp_path)).step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())

    # A synchronous save after an async one waits for it (one save in flight at a time).
    never = threading.Event()
    monkeypatch.setattr(save_load, "_before_commit_hook",
                        lambda staging: never.wait(2.0) if "step_2" in staging else None)
    save_checkpoint(model, str(tmp_path / "step_2"), step=2, async_save=True)
    save_checkpoint(model, str(tmp_path / "step_3"), step=3)
    assert not checkpointer().pending()
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(str(tmp_path))] == ["step_1", "step_2", "step_3"]
    checkpointer().release()
