"""The fake process group helper: one process plays rank r of N, and leaves no group behind."""

import pytest
import torch
import torch.distributed as dist

from atorch.testing.fake_distributed import fake_process_group


def test_fake_process_group_plays_one_rank_of_many():
    with fake_process_group(3, 64):
        assert (dist.get_rank(), dist.get_world_size()) == (3, 64)
        t = torch.ones(4)
        dist.all_reduce(t)          # communicates nothing; shapes are kept
        assert t.shape == (4,)
        with pytest.raises(ValueError, match="already initialized"):
            with fake_process_group(0, 2):
                pass
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"rank=8 must be in \[0, world_size=8\)"):
        with fake_process_group(8, 8):
            pass


def test_auto_accelerate_runs_under_a_fake_process_group():
    """auto_accelerate's error votes use the fake group itself (benchmarks/memory_model.py relies on it)."""
    from atorch.auto import auto_accelerate
    from atorch.testing import tiny_llama

    with fake_process_group(0, 2):
        ok, result, _ = auto_accelerate(tiny_llama(), torch.optim.AdamW, load_strategy=["parallel_mode", "fsdp"])
        assert ok
        ids = torch.randint(0, 100, (1, 8))
        result.model(input_ids=ids, labels=ids).loss.backward()
        del result
    assert not dist.is_initialized()


def test_auto_accelerate_shards_a_model_built_under_fake_tensor_mode():
    """The memory benchmarks' way at scale (benchmarks/memory_model.py): the model's parameters are fake
    tensors, which have no values for the replica check to compare; FSDP2 shards them and a step runs
    on shapes alone, with torch's memory tracker counting it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from atorch.auto import auto_accelerate
    from atorch.testing import tiny_llama

    with fake_process_group(0, 8):
        mode = FakeTensorMode()
        with mode:
            model = tiny_llama()
            ids = torch.randint(0, 100, (1, 8))
        ok, result, _ = auto_accelerate(model, torch.optim.AdamW, load_strategy=["parallel_mode", "fsdp"])
        assert ok
        tracker = FSDPMemTracker(result.model, result.optim)
        with mode, tracker:
            result.model(input_ids=ids, labels=ids).loss.backward()
        peak = max(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())
        assert peak > sum(p.numel() for p in model.parameters()) * 4 / 8      # at least the fp32 shards
        del result, tracker
    assert not dist.is_initialized()
