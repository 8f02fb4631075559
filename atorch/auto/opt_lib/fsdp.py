"""`fsdp`: full sharding (ZeRO-3) of parameters, gradients and optimizer state.

torch FSDP2 (`fully_shard`) over the "data" mesh, one unit per transformer block plus the
root; or, with `use_ds_zero=True`, a DeepSpeed ZeRO stage-3 engine (atorch's spelling of
DeepSpeed ZeRO-3, next to `zero1`/`zero2` with `use_ds_zero=True` for stages 1 and 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from atorch.auto.opt_lib._sharding import Fsdp2ShardingConfig, Fsdp2ShardingOptimization
from atorch.auto.opt_lib.base import ValidationContext, register


def require_data_dim(name: str, what: str, context: ValidationContext) -> None:
    """Refuse, at validation, a torch ZeRO (`name` shards `what`) under a layout without a "data" dimension:
    the shards live on the "data" group, which the apply phase would only find missing after the
    optimizations before it (tensor_parallel, pipeline_parallel) had been applied."""
    sizes = context.parallel_sizes()
    if "data" in sizes:
        return
    layout = list(sizes.items())
    raise ValueError(
        f"{name}: shards {what} over the 'data' parallel dimension, but parallel_mode's layout {layout} has no "
        f"'data' dimension; add one, e.g. {layout + [('data', 1)]} (over one data rank it shards nothing; launch "
        f"more processes for ('data', N) with N > 1), or drop {name} from the strategy")


@dataclass(frozen=True)
class FsdpConfig(Fsdp2ShardingConfig):
    """How to shard fully (fields in Fsdp2ShardingConfig)."""

    _owner = "fsdp"


@register
class FsdpOptimization(Fsdp2ShardingOptimization):
    name = "fsdp"
    # zero1/zero2 are lesser shardings of the same state; DDP would all-reduce gradients FSDP
    # already reduce-scatters.
    conflicts = frozenset({"zero1", "zero2", "ddp"})
    Config = FsdpConfig
    search_dimension = "zero"
    reshard_after_forward = True
    deepspeed_stage = 3

    def validate(self, config: Fsdp2ShardingConfig, context: ValidationContext) -> None:
        if not config.use_ds_zero:   # DeepSpeed's own check refuses any dim but "data"
            require_data_dim(self.name, "parameters, gradients and optimizer state", context)
        super().validate(config, context)
