"""`zero1`: shard the optimizer state over the data-parallel ranks (ZeRO stage 1).

torch: DDP averages full gradients as usual (parallel_mode's implicit DDP, or `ddp`), and
the optimizer is a `ZeroRedundancyOptimizer` over the "data" group: each rank keeps and
updates the state of its share of the parameters, then broadcasts the updated share.
`use_ds_zero=True`: a DeepSpeed ZeRO stage-1 engine instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from torch.distributed.optim import ZeroRedundancyOptimizer

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._ds_config import DsConfigSpec
from atorch.auto.opt_lib._sharding import (
    DEEPSPEED_CONFLICTS,
    build_deepspeed_engine,
    check_bool,
    check_ds_config_field,
    deepspeed_changes_nothing,
    deepspeed_cost_traits,
    deepspeed_installed,
    zero_memory_saving,
    describe_sharding,
    over_one_data_rank,
    prepare_deepspeed,
    require_data_dim,
    validate_deepspeed,
)
from atorch.auto.opt_lib.base import (
    ConfigAlias,
    CostContext,
    Optimization,
    Order,
    ValidationContext,
    WrapperOrder,
    is_false,
    register,
)


@dataclass(frozen=True)
class Zero1Config:
    use_ds_zero: bool = False
    """Use a DeepSpeed ZeRO stage-1 engine instead of torch's ZeroRedundancyOptimizer."""
    ds_config: DsConfigSpec = None
    """DeepSpeed's config (dict or JSON path), merged over what atorch derives (use_ds_zero only): optimizer
    offload, bucket sizes... Batch keys, ZeRO stage and bf16/fp16 may repeat the strategy's but not contradict it."""

    def __post_init__(self) -> None:
        check_bool("zero1", "use_ds_zero", self.use_ds_zero)
        object.__setattr__(self, "ds_config", check_ds_config_field("zero1", self.ds_config, self.use_ds_zero))


@register
class Zero1Optimization(Optimization):
    name = "zero1"
    order = Order.SHARDING
    wrapper_order = WrapperOrder.ENGINE   # builds the DeepSpeed engine when use_ds_zero=True
    # Each of these already shards the optimizer state (and more).
    conflicts = frozenset({"zero2", "fsdp"})
    Config = Zero1Config
    search_dimension = "zero"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """torch's ZeroRedundancyOptimizer, and DeepSpeed's stage 1 where DeepSpeed is installed."""
        return [None, cls.name, *([(cls.name, {"use_ds_zero": True})] if deepspeed_installed() else [])]

    @classmethod
    def changes_nothing(cls, config: Zero1Config, context: ValidationContext) -> Optional[str]:
        if config.use_ds_zero:
            return deepspeed_changes_nothing(1, config.ds_config, context)
        if over_one_data_rank(context):
            return "torch ZeRO-1 over a data-parallel group of 1 rank is the plain optimizer"
        return None

    @classmethod
    def config_conflicts(cls, config: Zero1Config) -> Dict[str, str]:
        return dict(DEEPSPEED_CONFLICTS) if config.use_ds_zero else {}

    @classmethod
    def wraps(cls, config: Zero1Config) -> bool:
        return config.use_ds_zero

    @classmethod
    def memory_saving(cls, config: Zero1Config) -> Dict[str, float]:
        return zero_memory_saving(1, config.use_ds_zero)

    @classmethod
    def syncs_gradients(cls, config: Zero1Config) -> bool:
        # torch: gradients are averaged by DDP as usual (resolve_strategy adds it); DeepSpeed: the engine.
        return config.use_ds_zero

    @classmethod
    def describe_config(cls, config: Zero1Config) -> str:
        return describe_sharding(cls, config, 1)

    @classmethod
    def describe_step(cls, config: Zero1Config) -> str:
        return f"{cls.name}(deepspeed stage 1)" if config.use_ds_zero else f"{cls.name}(torch ZeroRedundancyOptimizer)"

    @classmethod
    def cost_traits(cls, config: Zero1Config, context: CostContext) -> Dict[str, Any]:
        if config.use_ds_zero:
            return deepspeed_cost_traits(1, config.ds_config)
        # ZeroRedundancyOptimizer: Adam state / data; DDP keeps full gradients and its buckets.
        return {"sharding": "torch_zero1", "zero_stage": 1}

    config_aliases = {
        "cpu_offload": ConfigAlias(accepts=is_false, instead="zero1 keeps optimizer state on the device; for CPU "
                                   "offload use use_ds_zero=True with ds_config {'zero_optimization': "
                                   "{'offload_optimizer': {'device': 'cpu'}}}, or fsdp/zero2 with cpu_offload=True"),
        "static_loss_scale": ConfigAlias(instead="loss scaling belongs to amp_native here: use ('amp_native', "
                                         "{'dtype': torch.float16}), which scales dynamically"),
    }

    def validate(self, config: Zero1Config, context: ValidationContext) -> None:
        # Torch ZeRO-1 with `ddp` is fine: it relies on DDP for gradient averaging either way.
        if config.use_ds_zero:
            validate_deepspeed("zero1", context, 1, config.ds_config)
        else:
            require_data_dim("zero1", "the optimizer state", context)

    def apply(self, ctx: ModelContext, config: Zero1Config) -> None:
        if config.use_ds_zero:
            prepare_deepspeed(ctx, "zero1", config.ds_config)
            return
        if ctx.optim_func is None:
            raise ValueError("zero1 needs optim_func: it shards the optimizer's state")
        # Replacing the factory (rather than the built optimizer) builds the user's optimizer
        # once, over this rank's share only.
        # ZeroRedundancyOptimizer only calls optimizer_class(params, **defaults), so a factory works.
        ctx.optim_func = functools.partial(ZeroRedundancyOptimizer, optimizer_class=ctx.optim_func,  # type: ignore[arg-type]
                                           process_group=ctx.require_parallel("zero1").group("data"))
        ctx.summaries["zero1"] = {"backend": "torch_zero_redundancy_optimizer"}

    def apply_wrapper(self, ctx: ModelContext, config: Zero1Config) -> None:
        if config.use_ds_zero:
            ctx.summaries["zero1"] = build_deepspeed_engine(ctx, "zero1", 1, config.ds_config)
