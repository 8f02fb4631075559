"""ATorch's `atorch.distributed.distributed` API, kept at that path for its users' scripts.

The process-group functions are `atorch.distributed.process_group`'s; the parallel-group
queries here return None where a group or dimension does not exist, as ATorch's do (atorch's
own code uses the strict functions of `parallel_group.py`, which raise instead).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

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
from atorch.distributed.parallel_group import _state_of, add_parallel_group, is_parallel_group_created, mesh_of
from atorch.distributed.parallel_group import destroy_parallel_group as _destroy_parallel_groups
from atorch.distributed.parallel_group import parallel_config as _parallel_config
from atorch.distributed.parallel_group import parallel_instance_index as _parallel_instance_index
from atorch.distributed.parallel_group import parallel_instance_num as _parallel_instance_num


__all__ = [
    "backend",
    "create_parallel_group",
    "default_backend",
    "destroy_distributed",
    "destroy_parallel_group",
    "device",
    "device_type",
    "find_free_port",
    "get_device_mesh",
    "init_distributed",
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


def _compat_state(name: str) -> Any:
    return _state_of(name) if is_initialized() else None


def create_parallel_group(parallel_config: Any, use_atorch_pipe: bool = True, use_device_mesh: bool = False) -> None:
    """ATorch's `create_parallel_group((dims, rank_order[, multi_instance]))`.

    Calls add up (a second call with other dimension names builds a second mesh, as ATorch's
    do); a third item True lets the sizes multiply to a divisor of the world size (the
    layout is repeated: `parallel_instance_num()`, `parallel_instance_index()`). The groups
    are always DeviceMesh dimensions here, so `use_device_mesh` changes nothing, and
    `use_atorch_pipe` (ATorch's own pipeline runtime) is ignored.
    """
    if not isinstance(parallel_config, (tuple, list)) or len(parallel_config) not in (2, 3):
        raise ValueError(f"parallel_config={parallel_config!r} must be (dims, rank_order) or "
                         "(dims, rank_order, multi_instance), e.g. ([('tensor', 2), ('data', 2)], None)")
    instances = bool(parallel_config[2]) if len(parallel_config) == 3 else False
    add_parallel_group((parallel_config[0], parallel_config[1]), instances=instances)


def destroy_parallel_group(destroy_rpc: bool = True) -> None:
    """Forget every parallel group (ATorch's `destroy_rpc` has no meaning here: there is no RPC)."""
    _destroy_parallel_groups()


def parallel_group(name: str) -> Optional[dist.ProcessGroup]:
    """This rank's group along `name`, or None when no such dimension exists (ATorch's behaviour)."""
    state = _compat_state(name)
    return None if state is None else state.mesh.get_group(name)


def parallel_rank(name: str) -> Optional[int]:
    state = _compat_state(name)
    return None if state is None else state.layout.coords(rank())[name]


def parallel_group_size(name: str) -> Optional[int]:
    state = _compat_state(name)
    return None if state is None else state.layout.size(name)


def parallel_group_and_ranks(name: str) -> Tuple[Optional[dist.ProcessGroup], Optional[List[int]]]:
    """(this rank's group along `name`, its global ranks), or (None, None)."""
    state = _compat_state(name)
    if state is None:
        return None, None
    return state.mesh.get_group(name), state.layout.group_of(name, rank())


def parallel_config() -> Optional[Tuple[List[Tuple[str, int]], Optional[List[int]]]]:
    return _parallel_config() if is_parallel_group_created() else None


def parallel_instance_num() -> Optional[int]:
    return _parallel_instance_num() if is_parallel_group_created() else None


def parallel_instance_index() -> Optional[int]:
    return _parallel_instance_index() if is_parallel_group_created() else None


def get_device_mesh(group_name: str, use_prefix: bool = True) -> Any:
    """The whole DeviceMesh that has dimension `group_name`, or None.

    Its dimension names are in torch's row-major order (slowest first), i.e. the reverse of
    the order given to `create_parallel_group`; index it by name (`mesh["tensor"]`).
    """
    return mesh_of(group_name) if is_initialized() else None


def is_distributed() -> bool:
    """True when more than one process takes part."""
    return world_size() > 1


def backend() -> Optional[str]:
    return dist.get_backend() if is_initialized() else None

