"""`fsdp`: full sharding (ZeRO-3) of parameters, gradients and optimizer state.

torch FSDP2 (`fully_shard`) over the "data" mesh, one unit per transformer block plus the
root; or, with `use_ds_zero=True`, a DeepSpeed ZeRO stage-3 engine (atorch's spelling of
DeepSpeed ZeRO-3, next to `zero1`/`zero2` with `use_ds_zero=True` for stages 1 and 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from atorch.auto.opt_lib._sharding import Fsdp2ShardingConfig, Fsdp2ShardingOptimization
from atorch.auto.opt_lib.base import register


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
    shards = "parameters, gradients and optimizer state"
