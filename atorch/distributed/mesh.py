"""`ParallelMesh`: one set of named parallel groups ("tensor", "data", "pipeline", ...) as a value.

A `ParallelLayout` (pure rank tables) plus the torch `DeviceMesh` built from it, so DTensor,
FSDP2 and tensor parallel use exactly the process groups that `group(name)` returns. It is
passed around explicitly: the `parallel_mode` optimization stores the one it creates on the
`ModelContext`, and every other optimization reads it from there. The process-wide default of
`atorch.distributed.parallel_group` (for users who call `create_parallel_group` themselves) is
just one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from atorch.distributed.process_group import (
    device_type, groups_take_default_timeout, rank as global_rank, world_size as global_world_size,
)
from atorch.distributed.parallel_layout import Dims, ParallelLayout

ParallelConfig = Tuple[Dims, Optional[List[int]]]


@dataclass(frozen=True)
class ParallelMesh:
    """Named parallel groups over the default process group; the first dimension varies fastest."""

    layout: ParallelLayout
    mesh: DeviceMesh

    @classmethod
    def create(cls, dims: Sequence[Tuple[str, int]], rank_order: Optional[Sequence[int]] = None) -> "ParallelMesh":
        """Create the process groups of `dims` over the whole world (a collective: every rank calls it alike)."""
        if not dist.is_initialized():
            raise RuntimeError("parallel groups need a process group: call atorch.init_distributed() first")
        layout = ParallelLayout.create(dims, global_world_size(), rank_order)
        # DeviceMesh is row-major (its last dimension varies fastest), so the names are reversed.
        order = list(layout.rank_order) if layout.rank_order is not None else list(range(layout.world_size))
        shape = tuple(size for _, size in reversed(layout.dims))
        mesh_tensor = torch.tensor(order, dtype=torch.int).reshape(shape)
        # DeviceMesh takes no timeout (torch 2.13): its groups take torch's default, set here to the default
        # group's (ATORCH_COLLECTIVE_TIMEOUT), not torch's 30 minutes (process_group._set_torch_group_timeout).
        with groups_take_default_timeout():
            mesh = DeviceMesh(device_type(), mesh_tensor, mesh_dim_names=tuple(reversed(layout.names)))
        return cls(layout, mesh)

    # -- the named view ----------------------------------------------------------------------
    @property
    def names(self) -> List[str]:
        return self.layout.names

    def has(self, name: str) -> bool:
        return name in self.layout.names

    def size(self, name: str) -> int:
        """Size of dimension `name` (ValueError naming the layout's dims when it has none)."""
        return self.layout.size(name)

    def size_or_one(self, name: str) -> int:
        return self.layout.size(name) if self.has(name) else 1

    def rank(self, name: str) -> int:
        """This process's coordinate along `name`."""
        return self.layout.coords(global_rank())[self.layout._check_name(name)]

    def rank_or_zero(self, name: str) -> int:
        return self.rank(name) if self.has(name) else 0

    def group(self, name: str) -> dist.ProcessGroup:
        self.layout._check_name(name)
        return self.mesh.get_group(name)

    def group_ranks(self, name: str) -> List[int]:
        """Global ranks of this process's group along `name`."""
        return self.layout.group_of(name, global_rank())

    def device_mesh(self, *names: str) -> DeviceMesh:
        """The whole mesh, or its sub-mesh over `names` (given in the atorch order, fastest first)."""
        if not names:
            return self.mesh
        for n in names:
            self.layout._check_name(n)
        if len(names) == 1:
            return self.mesh[names[0]]
        return self.mesh[tuple(reversed(names))]

    def config(self) -> ParallelConfig:
        """(dims, rank_order) as `create_parallel_group` takes it."""
        layout = self.layout
        dims = [cast(Tuple[str, int], tuple(d)) for d in layout.dims]
        return dims, (list(layout.rank_order) if layout.rank_order is not None else None)
