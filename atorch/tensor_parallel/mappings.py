"""Autograd functions that move activations into and out of a tensor-parallel group.

The four are each other's adjoints: `copy_to_group` (identity forward, all-reduce backward)
pairs with `reduce_from_group` (all-reduce forward, identity backward), and
`gather_from_group` (all-gather forward, split backward) with `scatter_to_group`. Every one
is the identity on a group of one, so tensor-parallel layers also run without a process group.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    """Size of `group`; 1 when there is no process group at all (a plain single process)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # A fresh buffer: the input may be saved for backward by the op that produced it (or be a
    # view of a tensor the caller still reads), so an in-place reduce could corrupt it.
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[-1] % size != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _split_last_dim(grad, ctx.group), None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _all_gather_last_dim(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (output of a row-parallel layer)."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the ranks' last dimensions forward; keep this rank's slice of the gradient backward."""
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, group)


def scatter_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return x if group_size(group) == 1 else _ScatterToGroup.apply(x, group)
