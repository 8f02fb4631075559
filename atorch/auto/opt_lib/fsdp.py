"""`fsdp`: full sharding (ZeRO-3) of parameters, gradients and optimizer state.

torch FSDP2 (`fully_shard`) over the "data" mesh, one unit per transformer block plus the
root; or, with `use_ds_zero=True`, a DeepSpeed ZeRO stage-3 engine (atorch's spelling of
DeepSpeed ZeRO-3, next to `zero1`/`zero2` with `use_ds_zero=True` for stages 1 and 2).
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
class FsdpConfig:
    """How to shard."""

    wrap_cls: Optional[Tuple[ClassSpec, ...]] = None
    """FSDP unit classes (or class names); None: the model's transformer block, auto-detected."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (torch only)."""
    sync_module_states: bool = False
    """Broadcast data-rank 0's weights before sharding, for models initialized differently per rank."""
    use_ds_zero: bool = False
    """Use a DeepSpeed ZeRO-3 engine instead of torch FSDP2 (then wrap_cls and cpu_offload must stay unset)."""

    def __post_init__(self) -> None:
        for key in ("cpu_offload", "sync_module_states", "use_ds_zero"):
            check_bool("fsdp", key, getattr(self, key))
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls("fsdp", self.wrap_cls))


@register
class FsdpOptimization(Optimization):
    name = "fsdp"
    order = Order.SHARDING
    # zero1/zero2 are lesser shardings of the same state; DDP would all-reduce gradients FSDP
    # already reduce-scatters.
    conflicts = frozenset({"zero1", "zero2", "ddp"})
    Config = FsdpConfig

    def validate(self, config: FsdpConfig, context: ValidationContext) -> None:
        if config.use_ds_zero:
            validate_deepspeed("fsdp", context, cpu_offload=config.cpu_offload, wrap_cls=config.wrap_cls)

    def apply(self, ctx: ModelContext, config: FsdpConfig) -> None:
        if config.use_ds_zero:
            # DeepSpeed partitions parameters when the engine is built, after the optimizer exists,
            # and broadcasts rank 0's weights first (every stage): sync_module_states is implied.
            prepare_deepspeed(ctx)
            return
        ctx.extra["fsdp"] = shard_with_fsdp2(ctx, "fsdp", wrap_cls=config.wrap_cls, reshard_after_forward=True,
                                             cpu_offload=config.cpu_offload,
                                             sync_module_states=config.sync_module_states)

    def apply_wrapper(self, ctx: ModelContext, config: FsdpConfig) -> None:
        if config.use_ds_zero:
            ctx.extra["fsdp"] = build_deepspeed_engine(ctx, "fsdp", stage=3)
