"""Per-rank bytes of parameters, gradients and optimizer state, counting only what this rank stores.

The accounting behind "fsdp on N ranks holds 1/N of the training state": sharded tensors
(FSDP2 DTensors, DeepSpeed ZeRO-3 partitions) count their local shard, sharded optimizers
(ZeroRedundancyOptimizer, DeepSpeed ZeRO) count the state of their own share, and fp32
master copies kept by an optimizer count as optimizer state. Activations and communication
buffers are out of scope (see `atorch.utils.peak_memory` for peaks).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

import torch
from torch import nn

try:  # torch >= 2.4 exposes DTensor publicly; the private path is the fallback.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by one rank."""

    param_bytes: int
    grad_bytes: int
    optim_state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_state_bytes

    def as_dict(self) -> Dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}

    def describe(self) -> str:
        mib = 1024 ** 2
        return (f"params {self.param_bytes / mib:.2f} MiB, grads {self.grad_bytes / mib:.2f} MiB, "
                f"optimizer state {self.optim_state_bytes / mib:.2f} MiB, total {self.total_bytes / mib:.2f} MiB")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank stores: a DTensor's local shard, a ZeRO-3 parameter's partition."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the shard beside an empty param
    if isinstance(partition, torch.Tensor):
        return partition
    return tensor


def _key(t: torch.Tensor) -> Tuple[int, int, int, torch.dtype]:
    # Tied or aliased tensors (same memory, same extent) are counted once.
    return (t.data_ptr(), int(t.storage_offset()), t.numel(), t.dtype)


def _sum_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    seen: Set[Tuple[int, int, int, torch.dtype]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_tensor(t)
        if t.numel() == 0:
            continue
        key = _key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def innermost_optimizer(optimizer: object) -> Any:
    """The optimizer that holds this rank's state, under wrappers that hold none of their own.

    A `ZeroRedundancyOptimizer` gives way to its rank's optimizer (`.optim`); a wrapper whose
    `.optimizer` is a torch optimizer gives way to it when the wrapper's `state` is that
    optimizer's own (atorch's GradScalingOptimizer, accelerate's AcceleratedOptimizer) or the
    wrapper is DeepSpeed's (its ZeRO optimizers step the torch optimizer over their fp32 partitions).
    Any other wrapper keeps state of its own and is returned as it is. The memory accounting and
    the checkpoint's torch layout both read optimizer state through this one rule.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    seen: Set[int] = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer = optimizer.optim
            continue
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and (
                getattr(optimizer, "state", None) is inner.state
                or type(optimizer).__module__.split(".")[0] == "deepspeed"):
            optimizer = inner
    return optimizer


def _optimizer_tensors(optimizer: object, model_param_ids: Set[int]) -> Iterator[torch.Tensor]:
    inner = innermost_optimizer(optimizer)
    for state in getattr(inner, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
    # Tensors the optimizer steps or keeps state for that are not the model's own parameters are
    # master copies (DeepSpeed's fp32 partitions): optimizer state too. ZeRO-3 puts its partitions
    # into param_groups only during step(), so the keys of `state` are looked at as well.
    stepped = [p for group in getattr(inner, "param_groups", []) for p in group["params"]]
    for p in itertools.chain(stepped, getattr(inner, "state", {}).keys()):
        if isinstance(p, torch.Tensor) and id(p) not in model_param_ids:
            yield p


def memory_breakdown(model: nn.Module, optimizer: Optional[object] = None) -> MemoryBreakdown:
    """Bytes of parameters, gradients (`.grad`) and optimizer state this rank holds now.

    Call it after `backward()` and before `zero_grad()` to see gradients. DeepSpeed keeps
    reduced gradients in its own buffers rather than `.grad`, so its gradient bytes are not
    seen here.
    """
    params = list(model.parameters())
    param_ids = {id(p) for p in params}
    return MemoryBreakdown(
        param_bytes=_sum_bytes(params),
        grad_bytes=_sum_bytes(p.grad for p in params),
        optim_state_bytes=_sum_bytes(_optimizer_tensors(optimizer, param_ids)) if optimizer is not None else 0,
    )
