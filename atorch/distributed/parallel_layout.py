"""Pure description of a multi-dimensional rank layout (no process groups).

`ParallelLayout` validates the dimensions and computes the rank tables; the
process-group side (`parallel_group.py`) only materializes what this computes,
so every check here runs identically on every rank before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

Dims = List[Tuple[str, int]]


@dataclass(frozen=True)
class ParallelLayout:
    """Named dimensions over `world_size` ranks; the first dimension varies fastest.

    With dims [("tensor", 2), ("data", 2), ("pipeline", 2)] on 8 ranks, tensor groups
    are [[0,1],[2,3],[4,5],[6,7]], data [[0,2],[1,3],[4,6],[5,7]] and pipeline
    [[0,4],[1,5],[2,6],[3,7]]. `rank_order`, when given, is a permutation of the
    ranks laid out in that order instead of 0..world_size-1.
    """

    dims: Tuple[Tuple[str, int], ...]
    world_size: int
    rank_order: Optional[Tuple[int, ...]] = None

    @classmethod
    def create(cls, dims: Sequence[Tuple[str, int]], world_size: int, rank_order: Optional[Sequence[int]] = None
               ) -> "ParallelLayout":
        dims_t = _validate_dims(dims, world_size)
        order = None
        if rank_order is not None:
            order = tuple(int(r) for r in rank_order)
            if sorted(order) != list(range(world_size)):
                raise ValueError(
                    f"rank_order={list(rank_order)} must be a permutation of range({world_size}) (world size)")
        return cls(dims_t, world_size, order)

    @property
    def names(self) -> List[str]:
        return [n for n, _ in self.dims]

    def size(self, name: str) -> int:
        return dict(self.dims)[self._check_name(name)]

    def _check_name(self, name: str) -> str:
        if name not in self.names:
            raise ValueError(f"unknown parallel group {name!r}; this layout has {self.names}")
        return name

    def _rank_at(self, coords: Sequence[int]) -> int:
        index, stride = 0, 1
        for (_, size), c in zip(self.dims, coords):
            index += c * stride
            stride *= size
        return self.rank_order[index] if self.rank_order is not None else index

    def coords(self, rank: int) -> Dict[str, int]:
        """The coordinate of `rank` along each dimension."""
        index = self.rank_order.index(rank) if self.rank_order is not None else rank
        out = {}
        for name, size in self.dims:
            out[name] = index % size
            index //= size
        return out

    def groups(self, name: str) -> List[List[int]]:
        """All groups of dimension `name`, each a list of ranks in coordinate order, sorted by first rank."""
        self._check_name(name)
        axis = self.names.index(name)
        others = [(i, size) for i, (_, size) in enumerate(self.dims) if i != axis]
        result = []
        total_other = 1
        for _, s in others:
            total_other *= s
        for flat in range(total_other):
            coords = [0] * len(self.dims)
            rem = flat
            for i, s in others:
                coords[i] = rem % s
                rem //= s
            group = []
            for c in range(self.dims[axis][1]):
                coords[axis] = c
                group.append(self._rank_at(coords))
            result.append(group)
        return sorted(result, key=lambda g: g[0])

    def group_of(self, name: str, rank: int) -> List[int]:
        for g in self.groups(name):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")


def _validate_dims(dims: Sequence[Tuple[str, int]], world_size: int) -> Tuple[Tuple[str, int], ...]:
    if not dims:
        raise ValueError("parallel dims are empty; give at least one (name, size), e.g. [('data', world_size)]")
    seen = set()
    out = []
    for item in dims:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"parallel dim {item!r} must be a (name, size) pair")
        name, size = item
        if not isinstance(name, str) or not name:
            raise ValueError(f"parallel dim name {name!r} must be a non-empty string")
        if name in seen:
            raise ValueError(f"parallel dim name {name!r} is duplicated in {list(dims)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"parallel dim {name!r} has size {size!r}; sizes must be integers >= 1")
        seen.add(name)
        out.append((name, size))
    product = 1
    for _, s in out:
        product *= s
    if product != world_size:
        raise ValueError(
            f"product of parallel sizes {' x '.join(f'{n}={s}' for n, s in out)} = {product} "
            f"does not equal world size {world_size}")
    return tuple(out)
