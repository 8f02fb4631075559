"""ATorch's distributed API on 4 gloo ranks: init keywords, lenient queries, several meshes, instances.

Written from ATorch's documented behaviour (`atorch/distributed/distributed.py` at dlrover
bfd04ef1): `parallel_group(name)` of a missing dimension is None, calls of
`create_parallel_group` add up, a third config item True repeats a smaller layout over the
world. atorch's own strict functions (`atorch.distributed.parallel_group`) still raise.
"""

import pytest
import torch
import torch.distributed as dist

import atorch
from atorch.testing import run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_ranks(group) -> list:
    """The global ranks of `group`, found by communicating over it (proves the group is real)."""
    size = dist.get_world_size(group)
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in gathered]


def _atorch_script() -> dict:
    from atorch import distributed as adist
    from atorch.distributed.distributed import (
        create_parallel_group,
        destroy_parallel_group,
        get_device_mesh,
        parallel_group,
        parallel_group_and_ranks,
        parallel_group_size,
        parallel_rank,
        reset_distributed,
    )

    out: dict = {}
    # Already initialized by the spawn helper: a second call with ATorch's keywords is a no-op.
    assert atorch.init_distributed("gloo", set_cuda_device_using_local_rank=True, coworker_num_per_node=0,
                                   elastic_or_fault_tolerant=True) is True
    try:
        atorch.init_distributed("gloo", coworker_num_per_node=1)
    except ValueError as e:
        out["coworker_error"] = str(e)
    out["ids"] = (atorch.rank(), atorch.world_size(), atorch.local_rank())

    # Nothing created yet: ATorch's queries answer None.
    out["before"] = (parallel_group("tensor"), parallel_rank("tensor"), parallel_group_size("tensor"),
                     parallel_group_and_ranks("tensor"), get_device_mesh("tensor"))

    create_parallel_group(([("tensor", 2), ("data", 2)], None), use_device_mesh=True)
    group, ranks = parallel_group_and_ranks("data")
    out["data"] = (ranks, _all_reduce_ranks(group), parallel_rank("data"), parallel_group_size("data"))
    out["tensor"] = _all_reduce_ranks(parallel_group("tensor"))
    out["missing"] = (parallel_group("pipeline"), parallel_rank("pipeline"), parallel_group_and_ranks("pipeline"))
    try:
        adist.parallel_group("pipeline")  # atorch's strict variant
    except ValueError as e:
        out["strict_error"] = str(e)

    # A second call adds a second mesh; the first stays.
    create_parallel_group(([("expert", 2), ("expert_fsdp", 2)], None), use_device_mesh=True)
    out["meshes"] = (get_device_mesh("expert") is get_device_mesh("expert_fsdp"),
                     get_device_mesh("expert") is not get_device_mesh("data"),
                     get_device_mesh("expert")["expert"].mesh.tolist())
    out["expert"] = _all_reduce_ranks(parallel_group("expert"))
    out["data_still"] = _all_reduce_ranks(parallel_group("data"))
    try:
        create_parallel_group(([("data", 4)], None))
    except ValueError as e:
        out["duplicate_error"] = str(e)

    # A layout smaller than the world, repeated: two instances of data=2.
    destroy_parallel_group()
    assert parallel_group("data") is None
    create_parallel_group(([("data", 2)], None, True))
    out["instances"] = (adist.parallel_instance_num(), adist.parallel_instance_index(),
                        _all_reduce_ranks(parallel_group("data")), parallel_rank("data"))

    reset_distributed()
    out["after_reset"] = (dist.is_initialized(), parallel_group("data"))
    return out


def test_atorch_distributed_api_on_four_ranks():
    results = run_distributed(_atorch_script, 4)
    for rank, out in enumerate(results):
        assert "coworker_num_per_node=1 is not supported" in out["coworker_error"]
        assert out["ids"] == (rank, 4, rank)
        assert out["before"] == (None, None, None, (None, None), None)
        data_ranks = [rank % 2, rank % 2 + 2]          # tensor varies fastest: data groups {0,2} {1,3}
        assert out["data"] == (data_ranks, data_ranks, rank // 2, 2)
        assert out["tensor"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["missing"] == (None, None, (None, None))
        assert "unknown parallel group 'pipeline'" in out["strict_error"]
        assert out["meshes"][:2] == (True, True)
        assert out["expert"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["data_still"] == data_ranks
        assert "already exist" in out["duplicate_error"]
        block = [rank - rank % 2, rank - rank % 2 + 1]  # instance i holds ranks 2i, 2i+1
        assert out["instances"] == (2, rank // 2, block, rank % 2)
        assert out["after_reset"] == (False, None)
