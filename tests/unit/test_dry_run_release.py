"""What a DeepSpeed dry run leaves behind in the process is put back when its engine is released."""

import types

import torch

from atorch.auto.dry_runner import release_engine


def test_releasing_a_zero3_engine_puts_torchs_linear_back(monkeypatch):
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = torch.nn.functional.linear
    monkeypatch.setattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", original, raising=False)
    # What building a ZeRO-3 engine does (memory_efficient_linear), and destroy() does not undo.
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    engine = types.SimpleNamespace(destroy=lambda: None, module=None, optimizer=None)
    release_engine(types.SimpleNamespace(engine=engine))
    assert torch.nn.functional.linear is original
