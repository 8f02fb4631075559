"""`parallel_mode`: create the named parallel groups; wrap with DDP when data > 1 and nothing shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from torch.nn.parallel import DistributedDataParallel

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import Optimization, Order, ValidationContext, register
from atorch.distributed.layout import ParallelLayout


@dataclass(frozen=True)
class ParallelModeConfig:
    """dims: ((name, size), ...), first varies fastest; None means every rank data-parallel."""

    dims: Optional[Tuple[Tuple[str, int], ...]] = None
    rank_order: Optional[Tuple[int, ...]] = None


@register
class ParallelModeOptimization(Optimization):
    name = "parallel_mode"
    order = Order.PARALLEL_MODE
    Config = ParallelModeConfig

    @classmethod
    def parse_config(cls, raw: Any) -> ParallelModeConfig:
        if raw is None or isinstance(raw, ParallelModeConfig):
            return raw or ParallelModeConfig()
        if isinstance(raw, (tuple, list)) and len(raw) == 3 and isinstance(raw[0], (tuple, list)):
            # ATorch's form (dims, rank_order, multi_instance).
            if raw[2]:
                raise ValueError(f"parallel_mode: multi_instance={raw[2]!r} (a layout smaller than the world, "
                                 "repeated) is not supported in a strategy: its dims must cover the world size; "
                                 "for separate instances create groups with "
                                 "atorch.distributed.distributed.create_parallel_group")
            raw = raw[:2]
        if isinstance(raw, (tuple, list)) and len(raw) == 2 and isinstance(raw[0], (tuple, list)):
            dims, order = raw
            try:
                dims_t = tuple((str(n), s) for n, s in dims)
            except (TypeError, ValueError) as e:
                raise ValueError(f"parallel_mode: dims {dims!r} must be a list of (name, size) pairs") from e
            return ParallelModeConfig(dims_t, tuple(order) if order is not None else None)
        raise ValueError(f"parallel_mode: config {raw!r} must be ([(name, size), ...], rank_order or None), "
                         "e.g. ([('tensor', 2), ('data', 2)], None)")

    def validate(self, config: ParallelModeConfig, context: ValidationContext) -> None:
        dims = config.dims or (("data", context.world_size),)
        ParallelLayout.create(dims, context.world_size, config.rank_order)

    def apply(self, ctx: ModelContext, config: ParallelModeConfig) -> None:
        dims = list(config.dims or (("data", adist.world_size()),))
        adist.create_parallel_group((dims, list(config.rank_order) if config.rank_order else None))

    def apply_wrapper(self, ctx: ModelContext, config: ParallelModeConfig) -> None:
        if ctx.data_parallel_size() <= 1 or ctx.is_sharded or ctx.engine is not None:
            return
        if "ddp" in ctx.applied:  # the explicit `ddp` optimization wraps, last, with its own options
            return
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ctx.model = DistributedDataParallel(ctx.model, device_ids=device_ids,
                                            process_group=adist.parallel_group("data"))
