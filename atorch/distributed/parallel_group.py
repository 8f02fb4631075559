"""The process-wide default parallel groups ("tensor", "data", "pipeline", ...), by name.

For users who call `create_parallel_group` themselves (the API of the system we follow), and
for scripts that read `parallel_group("data")` after `auto_accelerate`, which publishes the
strategy's groups here. Optimizations never read this module: they get their `ParallelMesh`
from the ModelContext. The groups are the dimensions of a torch `DeviceMesh` (`mesh.py`), so
DTensor, FSDP2 and tensor parallel use exactly the process groups `parallel_group(name)`
returns; the rank tables come from the pure `ParallelLayout`, validated on every rank before
any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from atorch.distributed.process_group import on_destroy, rank as global_rank, world_size as global_world_size
from atorch.distributed.mesh import ParallelConfig, ParallelMesh
from atorch.distributed.parallel_layout import ParallelLayout


@dataclass
class _ParallelState:
    layout: ParallelLayout
    mesh: DeviceMesh
    instance_num: int = 1
    """How many copies of the layout tile the world (the hidden outermost dim `INSTANCE_DIM`)."""


# One primary layout per process: process groups are process-wide objects in torch.distributed too.
_STATE: Optional[_ParallelState] = None
# Further layouts added next to it (`add_parallel_group`, ATorch's several `create_parallel_group`
# calls); their dimension names are distinct from the primary's and from each other.
_EXTRA: List[_ParallelState] = []

# Name of the outermost dimension that numbers the copies of a layout smaller than the world.
INSTANCE_DIM = "parallel_instance"


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
    state = _build_state(dims, rank_order, instances=False)
    destroy_parallel_group()
    global _STATE
    _STATE = state
    return state.mesh


def add_parallel_group(config: ParallelConfig, instances: bool = False) -> DeviceMesh:
    """Create the groups of `config` next to the existing ones (a second mesh); the first call is the primary.

    Dimension names must differ from every existing group's. With `instances=True` the
    product of the sizes may divide the world size: the layout is then repeated
    `world_size // product` times over consecutive rank blocks (see `parallel_instance_num`).
    Every rank must call it with the same config.
    """
    dims, rank_order = _split_config(config)
    if not dist.is_initialized():
        raise RuntimeError("add_parallel_group needs a process group: call atorch.init_distributed() first")
    taken = [n for st in _all_states() for n in _visible_names(st)]
    clash = [d[0] for d in dims if d[0] in taken]
    if clash:
        raise ValueError(f"parallel group name(s) {clash} already exist ({taken}); destroy_parallel_group() first "
                         "or choose other names")
    state = _build_state(dims, rank_order, instances=instances)
    global _STATE
    if _STATE is None:
        _STATE = state
    else:
        _EXTRA.append(state)
    return state.mesh


def _build_state(dims: Sequence[Tuple[str, int]], rank_order: Optional[Sequence[int]], instances: bool
                 ) -> _ParallelState:
    world = global_world_size()
    instance_num = 1
    if instances:
        sizes = [d[1] for d in dims if isinstance(d, (tuple, list)) and len(d) == 2]
        product = 1
        for size in sizes:
            product *= size if isinstance(size, int) and size > 0 else 1
        if world % product != 0:
            raise ValueError(f"parallel sizes {list(dims)} multiply to {product}, which does not divide the world "
                             f"size {world}; with several parallel instances the world must hold whole copies")
        instance_num = world // product
        if instance_num > 1:
            if rank_order is not None:
                raise ValueError("rank_order must be None when the layout is repeated over parallel instances")
            dims = [*dims, (INSTANCE_DIM, instance_num)]
    built = ParallelMesh.create(dims, rank_order)
    return _ParallelState(built.layout, built.mesh, instance_num)


def set_default_parallel_mesh(mesh: Optional[ParallelMesh]) -> None:
    """Make `mesh` the primary default layout (None forgets every layout)."""
    global _STATE
    _EXTRA.clear()
    _STATE = None if mesh is None else _ParallelState(mesh.layout, mesh.mesh)


def default_parallel_mesh() -> Optional[ParallelMesh]:
    """The primary default layout as a `ParallelMesh`, or None."""
    return None if _STATE is None else ParallelMesh(_STATE.layout, _STATE.mesh)


def _all_states() -> List[_ParallelState]:
    return ([_STATE] if _STATE is not None else []) + list(_EXTRA)


def _visible_names(state: _ParallelState) -> List[str]:
    return [n for n in state.layout.names if n != INSTANCE_DIM]


def _state_of(name: str) -> Optional[_ParallelState]:
    """The layout that holds dimension `name`, or None."""
    if name == INSTANCE_DIM:
        return None
    return next((st for st in _all_states() if name in st.layout.names), None)


def _state_with(name: str) -> _ParallelState:
    state = _state_of(name)
    if state is None:
        _state()  # no layout at all: the "call create_parallel_group" error
        names = [n for st in _all_states() for n in _visible_names(st)]
        raise ValueError(f"unknown parallel group {name!r}; the parallel groups are {names}")
    return state


def _state() -> _ParallelState:
    if _STATE is None:
        raise RuntimeError("no parallel groups exist: call atorch.distributed.create_parallel_group first")
    return _STATE


def is_parallel_group_created() -> bool:
    return _STATE is not None


def parallel_layout() -> ParallelLayout:
    return _state().layout


def device_mesh(*names: str) -> DeviceMesh:
    """The whole (primary) mesh, or the sub-mesh over `names` (given in the atorch order, fastest first)."""
    if not names:
        return _state().mesh
    state = _state_with(names[0])
    for n in names:
        if n not in _visible_names(state):
            raise ValueError(f"parallel groups {list(names)} are not dimensions of one mesh; that of {names[0]!r} "
                             f"has {_visible_names(state)}")
    if len(names) == 1:
        return state.mesh[names[0]]
    return state.mesh[tuple(reversed(names))]


def mesh_of(name: str) -> Optional[DeviceMesh]:
    """The whole mesh that has dimension `name`, or None (ATorch's `get_device_mesh`)."""
    state = _state_of(name)
    return None if state is None else state.mesh


def parallel_group(name: str) -> dist.ProcessGroup:
    """This rank's process group along dimension `name`; ValueError when there is no such dimension."""
    return _state_with(name).mesh.get_group(name)


def parallel_rank(name: str) -> int:
    state = _state_with(name)
    return state.layout.coords(global_rank())[name]


def parallel_group_size(name: str) -> int:
    return _state_with(name).layout.size(name)


def parallel_group_ranks(name: str) -> List[int]:
    """Global ranks of this rank's group along `name`."""
    return _state_with(name).layout.group_of(name, global_rank())


def parallel_config() -> ParallelConfig:
    """The primary layout's `(dims, rank_order)`, as given to `create_parallel_group`."""
    state = _state()
    dims = [cast(Tuple[str, int], tuple(d)) for d in state.layout.dims if d[0] != INSTANCE_DIM]
    return dims, (list(state.layout.rank_order) if state.layout.rank_order is not None else None)


def parallel_instance_num() -> int:
    """How many copies of the primary layout tile the world (1 unless created with instances=True)."""
    return _state().instance_num


def parallel_instance_index() -> int:
    """Which copy of the primary layout this rank belongs to (0 .. parallel_instance_num() - 1)."""
    state = _state()
    if state.instance_num == 1:
        return 0
    return state.layout.coords(global_rank())[INSTANCE_DIM]


def parallel_size_or_one(name: str) -> int:
    """Size of dimension `name`, or 1 when there is no layout or no such dimension."""
    state = _state_of(name)
    return 1 if state is None else state.layout.size(name)


def parallel_rank_or_zero(name: str) -> int:
    return 0 if _state_of(name) is None else parallel_rank(name)


def destroy_parallel_group() -> None:
    """Forget every layout; torch destroys the sub-groups with the default group."""
    global _STATE
    _STATE = None
    _EXTRA.clear()


on_destroy(destroy_parallel_group)
