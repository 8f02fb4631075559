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
