"""ATorch's `atorch.distributed.distributed` API, kept at that path for its users' scripts.

The process-group functions are `atorch.distributed.process_group`'s; the parallel-group
queries here return None where a group or dimension does not exist, as ATorch's do (atorch's
own code uses the strict functions of `parallel_group.py`, which raise instead).

`ParallelGroupContextManager(prefix)` names the groups created inside it `prefix + name` and
makes the queries inside it look them up by `name`, so one script can build several sets of
groups with the same dimension names. `_DistributedContext` is a read-only view of this state
under ATorch's attribute names (ATorch kept its state in that class; assigning to it is refused).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from atorch.distributed.process_group import (  # noqa: F401 - re-exported at ATorch's path
    default_backend,
    destroy_distributed,
    device,
    device_type,
    find_free_port,
    init_distributed,
    is_initialized,
    local_rank,
    on_destroy,
    rank,
    reset_distributed,
    world_size,
)
from atorch.distributed.parallel_group import _all_states, _state_of, _visible_names
from atorch.distributed.parallel_group import add_parallel_group, is_parallel_group_created, mesh_of
from atorch.distributed.parallel_group import destroy_parallel_group as _destroy_parallel_groups
from atorch.distributed.parallel_group import parallel_config as _parallel_config
from atorch.distributed.parallel_group import parallel_instance_index as _parallel_instance_index
from atorch.distributed.parallel_group import parallel_instance_num as _parallel_instance_num
from atorch.distributed.parallel_layout import ParallelLayout


__all__ = [
    "ParallelGroupContextManager",
    "backend",
    "create_parallel_group",
    "default_backend",
    "destroy_distributed",
    "destroy_parallel_group",
    "device",
    "device_type",
    "find_free_port",
    "get_device_mesh",
    "get_pg_ranks",
    "get_ranks_in_same_group",
    "init_distributed",
    "is_coworker",
    "is_distributed",
    "is_initialized",
    "local_rank",
    "on_destroy",
    "parallel_config",
    "parallel_group",
    "parallel_group_and_ranks",
    "parallel_group_size",
    "parallel_instance_index",
    "parallel_instance_num",
    "parallel_rank",
    "rank",
    "reset_distributed",
    "world_size",
]


# The name prefix of ParallelGroupContextManager ("" outside one).
_PG_NAME_PREFIX = ""
# (dims, rank_order, multi_instance) as given to create_parallel_group, by prefix.
_CONFIGS: Dict[str, Tuple[List[Tuple[str, int]], Optional[List[int]], bool]] = {}
on_destroy(_CONFIGS.clear)


class ParallelGroupContextManager:
    """Inside `with ParallelGroupContextManager(prefix):` groups are created and looked up as `prefix + name`."""

    def __init__(self, name: str = ""):
        if not isinstance(name, str):
            raise ValueError(f"ParallelGroupContextManager(name={name!r}): the prefix must be a string")
        self.name = name
        self.old_name = ""

    def __enter__(self) -> "ParallelGroupContextManager":
        global _PG_NAME_PREFIX
        self.old_name, _PG_NAME_PREFIX = _PG_NAME_PREFIX, self.name
        return self

    def __exit__(self, *exc: Any) -> None:
        global _PG_NAME_PREFIX
        _PG_NAME_PREFIX = self.old_name


def _prefixed(name: str = "") -> str:
    return _PG_NAME_PREFIX + name


def _compat_state(name: str) -> Any:
    return _state_of(_prefixed(name)) if is_initialized() else None


def create_parallel_group(parallel_config: Any, use_atorch_pipe: bool = True, use_device_mesh: bool = False) -> None:
    """ATorch's `create_parallel_group((dims, rank_order[, multi_instance]))`.

    Calls add up (a second call with other dimension names builds a second mesh, as ATorch's
    do); a third item True lets the sizes multiply to a divisor of the world size (the
    layout is repeated: `parallel_instance_num()`, `parallel_instance_index()`). Inside a
    `ParallelGroupContextManager(prefix)` the dimensions are named `prefix + name`. The groups
    are always DeviceMesh dimensions here, so `use_device_mesh` changes nothing, and
    `use_atorch_pipe` (ATorch's own pipeline runtime) is ignored.
    """
    if not isinstance(parallel_config, (tuple, list)) or len(parallel_config) not in (2, 3):
        raise ValueError(f"parallel_config={parallel_config!r} must be (dims, rank_order) or "
                         "(dims, rank_order, multi_instance), e.g. ([('tensor', 2), ('data', 2)], None)")
    dims, rank_order = parallel_config[0], parallel_config[1]
    instances = bool(parallel_config[2]) if len(parallel_config) == 3 else False
    if _PG_NAME_PREFIX and isinstance(dims, (tuple, list)):
        dims = [(_prefixed(d[0]), d[1]) if isinstance(d, (tuple, list)) and len(d) == 2 and isinstance(d[0], str)
                else d for d in dims]
    add_parallel_group((dims, rank_order), instances=instances)
    _CONFIGS[_PG_NAME_PREFIX] = ([tuple(d) for d in parallel_config[0]],  # type: ignore[misc]
                                 None if rank_order is None else list(rank_order), instances)


def destroy_parallel_group(destroy_rpc: bool = True) -> None:
    """Forget every parallel group (ATorch's `destroy_rpc` has no meaning here: there is no RPC)."""
    _CONFIGS.clear()
    _destroy_parallel_groups()


def parallel_group(name: str) -> Optional[dist.ProcessGroup]:
    """This rank's group along `name`, or None when no such dimension exists (ATorch's behaviour)."""
    state = _compat_state(name)
    return None if state is None else state.mesh.get_group(_prefixed(name))


def parallel_rank(name: str) -> Optional[int]:
    state = _compat_state(name)
    return None if state is None else state.layout.coords(rank())[_prefixed(name)]


def parallel_group_size(name: str) -> Optional[int]:
    state = _compat_state(name)
    return None if state is None else state.layout.size(_prefixed(name))


def parallel_group_and_ranks(name: str) -> Tuple[Optional[dist.ProcessGroup], Optional[List[int]]]:
    """(this rank's group along `name`, its global ranks), or (None, None)."""
    state = _compat_state(name)
    if state is None:
        return None, None
    return state.mesh.get_group(_prefixed(name)), state.layout.group_of(_prefixed(name), rank())


def parallel_config() -> Optional[Tuple[List[Tuple[str, int]], Optional[List[int]]]]:
    """`(dims, rank_order)` of the groups made under the current prefix (none: the primary layout), or None."""
    if _PG_NAME_PREFIX:
        config = _CONFIGS.get(_PG_NAME_PREFIX)
        return None if config is None else (config[0], config[1])
    return _parallel_config() if is_parallel_group_created() else None


def _prefixed_state() -> Any:
    config = _CONFIGS.get(_PG_NAME_PREFIX)
    return None if config is None or not is_initialized() else _state_of(_prefixed(config[0][0][0]))


def parallel_instance_num() -> Optional[int]:
    if _PG_NAME_PREFIX:
        state = _prefixed_state()
        return None if state is None else state.instance_num
    return _parallel_instance_num() if is_parallel_group_created() else None


def parallel_instance_index() -> Optional[int]:
    if _PG_NAME_PREFIX:
        state = _prefixed_state()
        if state is None:
            return None
        return 0 if state.instance_num == 1 else state.layout.coords(rank())[state.layout.names[-1]]
    return _parallel_instance_index() if is_parallel_group_created() else None


def get_pg_ranks(slicing_dim: Sequence[Tuple[str, int]], rank_order: Optional[Sequence[int]] = None
                 ) -> List[Dict[str, List[List[int]]]]:
    """ATorch's rank tables: for each copy of the layout, `{name: [ranks of each group]}` (pure, no groups made).

    `rank_order` lists the ranks of the world in layout order (the world size is its length;
    None: `range(world_size())`); the layout is repeated over consecutive blocks of it.
    """
    order = list(range(world_size())) if rank_order is None else [int(r) for r in rank_order]
    total = 1
    for _, size in slicing_dim:
        total *= int(size)
    if total < 1 or len(order) % total != 0:
        raise ValueError(f"parallel sizes {list(slicing_dim)} multiply to {total}, which does not divide the "
                         f"{len(order)} ranks of rank_order/the world")
    layout = ParallelLayout.create(slicing_dim, total)
    return [{name: [[order[offset + i] for i in group] for group in layout.groups(name)] for name in layout.names}
            for offset in range(0, len(order), total)]


def get_ranks_in_same_group(parallel_mode: Any, my_rank: int = 0) -> Dict[str, List[int]]:
    """`{name: ranks of my_rank's group}` for ATorch's `parallel_mode = (dims, rank_order[, multi])`."""
    found: Dict[str, List[int]] = {}
    for tables in get_pg_ranks(parallel_mode[0], parallel_mode[1]):
        for name, groups in tables.items():
            for group in groups:
                if my_rank in group:
                    found[name] = group
    return found


def get_device_mesh(group_name: str, use_prefix: bool = True) -> Any:
    """The whole DeviceMesh that has dimension `group_name` (`prefix + group_name` with `use_prefix`), or None.

    Its dimension names are in torch's row-major order (slowest first), i.e. the reverse of
    the order given to `create_parallel_group`; index it by name (`mesh["tensor"]`).
    """
    return mesh_of(_prefixed(group_name) if use_prefix else group_name) if is_initialized() else None


def is_coworker() -> bool:
    """Always False: atorch has no CPU coworker processes (ATorch's data service); every process trains."""
    return False


def is_distributed() -> bool:
    """True when more than one process takes part."""
    return world_size() > 1


def backend() -> Optional[str]:
    return dist.get_backend() if is_initialized() else None



class _ReadOnlyContext(type):
    """Class attributes of `_DistributedContext` computed from atorch's state; assigning them is refused."""

    _VIEWS = ("INITIALIZED", "BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PG_NAME_PREFIX", "PARALLEL_GROUP",
              "PARALLEL_RANK", "PARALLEL_GROUP_SIZE", "PARALLEL_GROUPS_AND_RANKS", "PARALLEL_CONFIG",
              "DEVICE_MESHES")

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"_DistributedContext.{name} is read-only here: it is a view of atorch's process "
                             "state (ATorch kept its state in this class). Change the state through "
                             "init_distributed / create_parallel_group / destroy_parallel_group, and pass a "
                             "rank_order to get_pg_ranks instead of setting WORLD_SIZE")

    def __getattr__(cls, name: str) -> Any:
        if name not in _ReadOnlyContext._VIEWS:
            raise AttributeError(f"_DistributedContext has no attribute {name!r}; the views kept for ATorch "
                                 f"scripts are {list(_ReadOnlyContext._VIEWS)}")
        up = is_initialized()
        if name == "INITIALIZED":
            return up
        if name == "PG_NAME_PREFIX":
            return _PG_NAME_PREFIX
        if name in ("BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            if not up:
                return None
            return {"BACKEND": backend, "RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank}[name]()
        states = _all_states() if up else []
        if not states:
            return None
        if name == "DEVICE_MESHES":
            return [st.mesh for st in states]
        if name == "PARALLEL_CONFIG":
            return {prefix: [dims, order, multi] for prefix, (dims, order, multi) in _CONFIGS.items()}
        me = rank()
        table: Dict[str, Any] = {}
        for st in states:
            for dim in _visible_names(st):
                if name == "PARALLEL_GROUP":
                    table[dim] = st.mesh.get_group(dim)
                elif name == "PARALLEL_RANK":
                    table[dim] = st.layout.coords(me)[dim]
                elif name == "PARALLEL_GROUP_SIZE":
                    table[dim] = st.layout.size(dim)
                else:   # PARALLEL_GROUPS_AND_RANKS: this rank's group only (other groups have no handle here)
                    table[dim] = [(st.mesh.get_group(dim), st.layout.group_of(dim, me))]
        return table


class _DistributedContext(metaclass=_ReadOnlyContext):
    """ATorch's process-state class, as a read-only view: `_DistributedContext.PARALLEL_RANK` etc."""
