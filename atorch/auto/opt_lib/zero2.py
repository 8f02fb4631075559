"""`zero2`: shard gradients and optimizer state over the data-parallel ranks (ZeRO stage 2).

torch: FSDP2 `fully_shard` with `reshard_after_forward=False`. Gradients are
reduce-scattered into shards and the optimizer updates only this rank's shard, as in ZeRO-2;
parameters stay gathered from the forward through the backward, so the backward pass needs
no second all-gather. They are re-sharded after backward, which keeps the per-step
communication of ZeRO-2 (one reduce-scatter plus one all-gather of the updated weights) with
less memory between steps. FSDP2 rather than FSDP1's SHARD_GRAD_OP: one code path with
`fsdp` (same DTensor state, mixed precision and offload policies), and no CPU special case
(FSDP1 needs `device_id=cpu`). Measured price (benchmarks/RESULTS.md): SHARD_GRAD_OP ran 8-10%
faster per step on a 2-core CPU. `use_ds_zero=True`: a DeepSpeed ZeRO stage-2 engine instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._sharding import (
    ClassSpec,
    build_deepspeed_engine,
    check_bool,
    normalize_wrap_cls,
    prepare_deepspeed,
    shard_with_fsdp2,
    validate_deepspeed,
)
from atorch.auto.opt_lib.base import Optimization, Order, ValidationContext, register


@dataclass(frozen=True)
class Zero2Config:
    wrap_cls: Optional[Tuple[ClassSpec, ...]] = None
    """Sharding unit classes (or class names); None: the transformer block, auto-detected (torch only)."""
    cpu_offload: bool = False
    """Keep sharded state in host memory (torch only)."""
    sync_module_states: bool = False
    """Broadcast data-rank 0's weights before sharding (DeepSpeed always does)."""
    use_ds_zero: bool = False
    """Use a DeepSpeed ZeRO stage-2 engine instead of torch FSDP2."""

    def __post_init__(self) -> None:
        for key in ("cpu_offload", "sync_module_states", "use_ds_zero"):
            check_bool("zero2", key, getattr(self, key))
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls("zero2", self.wrap_cls))


@register
class Zero2Optimization(Optimization):
    name = "zero2"
    order = Order.SHARDING
    conflicts = frozenset({"zero1", "fsdp", "ddp"})
    Config = Zero2Config

    def validate(self, config: Zero2Config, context: ValidationContext) -> None:
        if config.use_ds_zero:
            validate_deepspeed("zero2", context, cpu_offload=config.cpu_offload, wrap_cls=config.wrap_cls)

    def apply(self, ctx: ModelContext, config: Zero2Config) -> None:
        if config.use_ds_zero:
            prepare_deepspeed(ctx)
            return
        ctx.extra["zero2"] = shard_with_fsdp2(ctx, "zero2", wrap_cls=config.wrap_cls, reshard_after_forward=False,
                                              cpu_offload=config.cpu_offload,
                                              sync_module_states=config.sync_module_states)

    def apply_wrapper(self, ctx: ModelContext, config: Zero2Config) -> None:
        if config.use_ds_zero:
            ctx.extra["zero2"] = build_deepspeed_engine(ctx, "zero2", stage=2)
