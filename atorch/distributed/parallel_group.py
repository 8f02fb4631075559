"""Named parallel groups ("tensor", "data", "pipeline", ...) over the default process group.

The groups are the dimensions of one torch `DeviceMesh`, so DTensor, FSDP2 and tensor
parallel use exactly the process groups that `parallel_group(name)` returns. The rank
tables come from the pure `ParallelLayout`, which validates the input on every rank
before any collective.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from atorch.distributed.distributed import on_destroy
from atorch.distributed.mesh import ParallelConfig, ParallelMesh
from atorch.distributed.parallel_layout import ParallelLayout

# The process-wide default groups, for users who call `create_parallel_group` themselves (and
# what `auto_accelerate` publishes for the strategy it applied). Optimizations never read it:
# they get their `ParallelMesh` from the ModelContext.
_STATE: Optional[ParallelMesh] = None


def _split_config(config) -> Tuple[Sequence[Tuple[str, int]], Optional[Sequence[int]]]:
    if isinstance(config, (tuple, list)) and len(config) == 2 and (
            config[1] is None or (isinstance(config[1], (list, tuple)) and all(isinstance(r, int) for r in config[1]))
    ) and isinstance(config[0], (list, tuple)) and all(isinstance(d, (list, tuple)) for d in config[0]):
        return config[0], config[1]
    raise ValueError(
        f"parallel config {config!r} must be (dims, rank_order), e.g. ([('tensor', 2), ('data', 2)], None)")


def create_parallel_group(config: ParallelConfig) -> DeviceMesh:
    """Create the groups of `config = (dims, rank_order)` and make them the default; the first dim varies fastest.

    Every rank must call it with the same config. Replaces any previous default layout.
    """
    dims, rank_order = _split_config(config)
    if not dist.is_initialized():
        raise RuntimeError("create_parallel_group needs a process group: call atorch.init_distributed() first")
    mesh = ParallelMesh.create(dims, rank_order)
    set_default_parallel_mesh(mesh)
    return mesh.mesh


def set_default_parallel_mesh(mesh: Optional[ParallelMesh]) -> None:
    """Make `mesh` what `parallel_group(name)` and friends answer (None forgets it)."""
    global _STATE
    _STATE = mesh


def default_parallel_mesh() -> Optional[ParallelMesh]:
    return _STATE


def _state() -> ParallelMesh:
    if _STATE is None:
        raise RuntimeError("no parallel groups exist: call atorch.distributed.create_parallel_group first")
    return _STATE


def is_parallel_group_created() -> bool:
    return _STATE is not None


def parallel_layout() -> ParallelLayout:
    return _state().layout


def device_mesh(*names: str) -> DeviceMesh:
    """The whole default mesh, or its sub-mesh over `names` (given in the atorch order, fastest first)."""
    return _state().device_mesh(*names)


def parallel_group(name: str) -> dist.ProcessGroup:
    return _state().group(name)


def parallel_rank(name: str) -> int:
    return _state().rank(name)


def parallel_group_size(name: str) -> int:
    return _state().size(name)


def parallel_group_ranks(name: str) -> List[int]:
    """Global ranks of this rank's group along `name`."""
    return _state().group_ranks(name)


def parallel_config() -> ParallelConfig:
    return _state().config()


def parallel_size_or_one(name: str) -> int:
    """Size of dimension `name`, or 1 when there is no layout or no such dimension."""
    return 1 if _STATE is None else _STATE.size_or_one(name)


def parallel_rank_or_zero(name: str) -> int:
    return 0 if _STATE is None else _STATE.rank_or_zero(name)


def destroy_parallel_group() -> None:
    """Forget the default layout; torch destroys the sub-groups with the default group."""
    set_default_parallel_mesh(None)


on_destroy(destroy_parallel_group)
