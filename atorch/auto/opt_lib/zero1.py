"""`zero1`: shard the optimizer state over the data-parallel ranks (ZeRO stage 1).

torch: DDP averages full gradients as usual (parallel_mode's implicit DDP, or `ddp`), and
the optimizer is a `ZeroRedundancyOptimizer` over the "data" group: each rank keeps and
updates the state of its share of the parameters, then broadcasts the updated share.
`use_ds_zero=True`: a DeepSpeed ZeRO stage-1 engine instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.optim import ZeroRedundancyOptimizer

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._sharding import build_deepspeed_engine, check_bool, prepare_deepspeed, validate_deepspeed
from atorch.auto.opt_lib.base import ConfigAlias, Optimization, Order, ValidationContext, is_false, register


@dataclass(frozen=True)
class Zero1Config:
    use_ds_zero: bool = False
    """Use a DeepSpeed ZeRO stage-1 engine instead of torch's ZeroRedundancyOptimizer."""

    def __post_init__(self) -> None:
        check_bool("zero1", "use_ds_zero", self.use_ds_zero)


@register
class Zero1Optimization(Optimization):
    name = "zero1"
    order = Order.SHARDING
    # Each of these already shards the optimizer state (and more).
    conflicts = frozenset({"zero2", "fsdp"})
    Config = Zero1Config
    config_aliases = {
        "cpu_offload": ConfigAlias(accepts=is_false, instead="zero1 keeps optimizer state on the device; for CPU "
                                   "offload use fsdp or zero2 with cpu_offload=True"),
        "static_loss_scale": ConfigAlias(instead="loss scaling belongs to amp_native here: use ('amp_native', "
                                         "{'dtype': torch.float16}), which scales dynamically"),
    }

    def validate(self, config: Zero1Config, context: ValidationContext) -> None:
        # Torch ZeRO-1 with `ddp` is fine: it relies on DDP for gradient averaging either way.
        if config.use_ds_zero:
            validate_deepspeed("zero1", context)

    def apply(self, ctx: ModelContext, config: Zero1Config) -> None:
        if config.use_ds_zero:
            prepare_deepspeed(ctx)
            return
        if ctx.optim_func is None:
            raise ValueError("zero1 needs optim_func: it shards the optimizer's state")
        # Replacing the factory (rather than the built optimizer) builds the user's optimizer
        # once, over this rank's share only.
        ctx.optim_func = functools.partial(ZeroRedundancyOptimizer, optimizer_class=ctx.optim_func,
                                           process_group=adist.parallel_group("data"))
        ctx.extra["zero1"] = {"backend": "torch_zero_redundancy_optimizer"}

    def apply_wrapper(self, ctx: ModelContext, config: Zero1Config) -> None:
        if config.use_ds_zero:
            ctx.extra["zero1"] = build_deepspeed_engine(ctx, "zero1", stage=1)
