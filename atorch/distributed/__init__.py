"""Process groups, named parallel groups over one DeviceMesh, and the launcher."""

from atorch.distributed.process_group import (
    collective_device,
    destroy_distributed,
    device,
    device_type,
    find_free_port,
    init_distributed,
    is_initialized,
    local_rank,
    rank,
    reset_distributed,
    retire_groups,
    world_size,
)
from atorch.distributed.distributed import is_coworker
from atorch.distributed.mesh import ParallelMesh
from atorch.distributed.parallel_layout import ParallelLayout
from atorch.distributed.parallel_group import (
    add_parallel_group,
    create_parallel_group,
    default_parallel_mesh,
    destroy_parallel_group,
    device_mesh,
    is_parallel_group_created,
    parallel_config,
    parallel_group,
    parallel_group_ranks,
    parallel_group_size,
    parallel_instance_index,
    parallel_instance_num,
    parallel_layout,
    parallel_rank,
    parallel_rank_or_zero,
    parallel_size_or_one,
    set_default_parallel_mesh,
)

__all__ = [
    "ParallelLayout", "ParallelMesh", "add_parallel_group", "collective_device", "create_parallel_group", "default_parallel_mesh",
    "destroy_distributed", "destroy_parallel_group", "device", "device_mesh", "device_type", "find_free_port",
    "init_distributed", "is_coworker", "is_initialized", "is_parallel_group_created", "local_rank", "parallel_config",
    "parallel_group", "parallel_group_ranks", "parallel_group_size", "parallel_instance_index",
    "parallel_instance_num", "parallel_layout", "parallel_rank", "parallel_rank_or_zero", "parallel_size_or_one",
    "rank", "reset_distributed", "retire_groups", "set_default_parallel_mesh", "world_size",
]
