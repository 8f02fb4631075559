"""Named parallel groups ("tensor", "data", "pipeline", ...) over the default process group.

The groups are the dimensions of one torch `DeviceMesh`, so DTensor, FSDP2 and tensor
parallel use exactly the process groups that `parallel_group(name)` returns. The rank
tables come from the pure `ParallelLayout`, which validates the input on every rank
before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from atorch.distributed.distributed import device_type, rank as global_rank, world_size as global_world_size
from atorch.distributed.layout import Dims, ParallelLayout

ParallelConfig = Tuple[Dims, Optional[List[int]]]


@dataclass
class _ParallelState:
    layout: ParallelLayout
    mesh: DeviceMesh


# One layout per process: process groups are process-wide objects in torch.distributed too.
_STATE: Optional[_ParallelState] = None


def _split_config(config) -> Tuple[Sequence[Tuple[str, int]], Optional[Sequence[int]]]:
    if isinstance(config, (tuple, list)) and len(config) == 2 and (
            config[1] is None or (isinstance(config[1], (list, tuple)) and all(isinstance(r, int) for r in config[1]))
    ) and isinstance(config[0], (list, tuple)) and all(isinstance(d, (list, tuple)) for d in config[0]):
        return config[0], config[1]
    raise ValueError(
        f"parallel config {config!r} must be (dims, rank_order), e.g. ([('tensor', 2), ('data', 2)], None)")


def create_parallel_group(config: ParallelConfig) -> DeviceMesh:
    """Create the groups of `config = (dims, rank_order)`; the first dim varies fastest.

    Every rank must call it with the same config. Replaces any previous layout.
    """
    dims, rank_order = _split_config(config)
    if not dist.is_initialized():
        raise RuntimeError("create_parallel_group needs a process group: call atorch.init_distributed() first")
    layout = ParallelLayout.create(dims, global_world_size(), rank_order)
    destroy_parallel_group()
    # DeviceMesh is row-major (its last dimension varies fastest), so the names are reversed.
    order = list(layout.rank_order) if layout.rank_order is not None else list(range(layout.world_size))
    shape = tuple(size for _, size in reversed(layout.dims))
    mesh_tensor = torch.tensor(order, dtype=torch.int).reshape(shape)
    mesh = DeviceMesh(device_type(), mesh_tensor, mesh_dim_names=tuple(reversed(layout.names)))
    global _STATE
    _STATE = _ParallelState(layout, mesh)
    return mesh


def _state() -> _ParallelState:
    if _STATE is None:
        raise RuntimeError("no parallel groups exist: call atorch.distributed.create_parallel_group first")
    return _STATE


def is_parallel_group_created() -> bool:
    return _STATE is not None


def parallel_layout() -> ParallelLayout:
    return _state().layout


def device_mesh(*names: str) -> DeviceMesh:
    """The whole mesh, or its sub-mesh over `names` (given in the atorch order, fastest first)."""
    state = _state()
    if not names:
        return state.mesh
    for n in names:
        state.layout._check_name(n)
    if len(names) == 1:
        return state.mesh[names[0]]
    return state.mesh[tuple(reversed(names))]


def parallel_group(name: str) -> dist.ProcessGroup:
    state = _state()
    state.layout._check_name(name)
    return state.mesh.get_group(name)


def parallel_rank(name: str) -> int:
    state = _state()
    return state.layout.coords(global_rank())[state.layout._check_name(name)]


def parallel_group_size(name: str) -> int:
    return _state().layout.size(name)


def parallel_group_ranks(name: str) -> List[int]:
    """Global ranks of this rank's group along `name`."""
    return _state().layout.group_of(name, global_rank())


def parallel_config() -> ParallelConfig:
    layout = _state().layout
    return [tuple(d) for d in layout.dims], (list(layout.rank_order) if layout.rank_order is not None else None)


def parallel_size_or_one(name: str) -> int:
    """Size of dimension `name`, or 1 when there is no layout or no such dimension."""
    if _STATE is None or name not in _STATE.layout.names:
        return 1
    return _STATE.layout.size(name)


def parallel_rank_or_zero(name: str) -> int:
    if _STATE is None or name not in _STATE.layout.names:
        return 0
    return parallel_rank(name)


def destroy_parallel_group() -> None:
    """Forget the layout; torch destroys the sub-groups with the default group."""
    global _STATE
    _STATE = None
