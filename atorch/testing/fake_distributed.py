"""A process group that communicates nothing, for simulating one rank of a large job in one process.

The only module of atorch that imports `torch.testing._internal` (torch's fake process group
lives there and registers the "fake" backend on import). Collectives return at once with
their inputs' shapes, so together with `FakeTensorMode` (no storage) the real sharding code
(FSDP2, atorch's optimizations) runs for a 7B model on 64 ranks on a laptop, and
`torch.distributed._tools` memory trackers report what one rank would allocate.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Initialize the default process group as rank `rank` of `world_size` fake ranks; destroy it on exit."""
    if not 0 <= rank < world_size:
        raise ValueError(f"fake_process_group: rank={rank} must be in [0, world_size={world_size})")
    if dist.is_initialized():
        raise ValueError("fake_process_group: a process group is already initialized in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
