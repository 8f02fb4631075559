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

from atorch.auto.opt_lib._sharding import FSDP_CONFIG_ALIASES, Fsdp2ShardingConfig, Fsdp2ShardingOptimization
from atorch.auto.opt_lib.base import ConfigAlias, register


@dataclass(frozen=True)
class Zero2Config(Fsdp2ShardingConfig):
    """How to shard gradients and optimizer state (fields in Fsdp2ShardingConfig)."""

    _owner = "zero2"


@register
class Zero2Optimization(Fsdp2ShardingOptimization):
    name = "zero2"
    conflicts = frozenset({"zero1", "fsdp", "ddp"})
    Config = Zero2Config
    search_dimension = "zero"

    config_aliases = {
        **FSDP_CONFIG_ALIASES,
        "static_loss_scale": ConfigAlias(instead="loss scaling belongs to amp_native here: use ('amp_native', "
                                         "{'dtype': torch.float16}), which scales dynamically"),
    }
    reshard_after_forward = False
    deepspeed_stage = 2
    shards = "gradients and optimizer state"
