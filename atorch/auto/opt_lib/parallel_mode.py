"""`parallel_mode`: create the named parallel groups of the strategy (and nothing else).

The groups go to `ctx.parallel`, where every other optimization finds them. DDP over "data"
is the `ddp` optimization, which `resolve_strategy` adds when nothing else reduces gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.distributed.mesh import ParallelMesh
from atorch.distributed.parallel_layout import ParallelLayout


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
    def cost_traits(cls, config: ParallelModeConfig, context: CostContext) -> Dict[str, Any]:
        # The layout; and DDP's flat gradient buckets when data > 1 and nothing else reduces gradients.
        return {"data": context.dims.get("data", 1), "tensor": context.dims.get("tensor", 1),
                "pipeline": context.dims.get("pipeline", 1), "ddp_wrap": True}

    @classmethod
    def parse_config(cls, raw: Any) -> ParallelModeConfig:
        if raw is None or isinstance(raw, ParallelModeConfig):
            return raw or ParallelModeConfig()
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
        ctx.parallel = ParallelMesh.create(dims, list(config.rank_order) if config.rank_order else None)

    @classmethod
    def describe_step(cls, config: ParallelModeConfig) -> str:
        if not config.dims:
            return cls.name
        return f"{cls.name}({','.join(f'{n}={s}' for n, s in config.dims)})"
