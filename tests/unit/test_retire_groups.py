"""`retire_groups` / `forget_library_groups`: DeepSpeed's cached process groups are dropped.

A stand-in for `deepspeed.utils.groups` (module globals holding groups, dicts of groups) checks
both paths: DeepSpeed's own release function when it has one, and the attribute scan for older
releases. The real 2-rank case (a DeepSpeed candidate after another) is
tests/distributed/test_dry_run_sequence.py.
"""

import sys
import types

import pytest
import torch.distributed as dist

from atorch.distributed.process_group import forget_library_groups, retire_groups


def _group() -> dist.ProcessGroup:
    return dist.ProcessGroup(dist.HashStore(), 0, 1)


@pytest.fixture
def fake_ds(monkeypatch):
    module = types.ModuleType("deepspeed.utils.groups")
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", module)
    return module


def test_old_deepspeed_attributes_are_scanned(fake_ds):
    old, kept = _group(), _group()
    fake_ds._WORLD_GROUP = old
    fake_ds._DATA_PARALLEL_GROUP = kept
    fake_ds._EXPERT_PARALLEL_GROUP = {"ep_1": old, "ep_2": kept}
    retire_groups([old], destroy=False)
    assert fake_ds._WORLD_GROUP is None
    assert fake_ds._DATA_PARALLEL_GROUP is kept
    assert fake_ds._EXPERT_PARALLEL_GROUP == {"ep_2": kept}
    forget_library_groups(None)     # the world is gone: every cached group goes
    assert fake_ds._DATA_PARALLEL_GROUP is None and fake_ds._EXPERT_PARALLEL_GROUP == {}


def test_deepspeed_release_function_is_used(fake_ds):
    released = []
    fake_ds._release_process_group_references = released.append
    group = _group()
    retire_groups([group], destroy=False)
    forget_library_groups(None)
    assert released == [group, None]


def test_nothing_to_do_without_deepspeed(monkeypatch):
    monkeypatch.delitem(sys.modules, "deepspeed.utils.groups", raising=False)
    retire_groups([_group()], destroy=False)    # no import, no error
    assert "deepspeed.utils.groups" not in sys.modules
