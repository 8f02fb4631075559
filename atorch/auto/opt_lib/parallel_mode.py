"""`parallel_mode`: create the named parallel groups of the strategy (and nothing else).

The groups go to `ctx.parallel`, where every other optimization finds them. DDP over "data"
is the `ddp` optimization, which `resolve_strategy` adds when nothing else reduces gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.distributed.mesh import ParallelMesh
from atorch.distributed.parallel_layout import ParallelLayout
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register


@dataclass(frozen=True)
class ParallelModeConfig:
    """dims: ((name, size), ...), first varies fastest; None means every rank data-parallel."""

    dims: Optional[Tuple[Tuple[str, int], ...]] = None
    rank_order: Optional[Tuple[int, ...]] = None

    def sizes(self, world_size: int) -> Dict[str, int]:
        """{dim name: size}; every rank data-parallel ({"data": world_size}) when `dims` is None."""
        return dict(self.dims) if self.dims else {"data": world_size}


@register
class ParallelModeOptimization(Optimization):
    name = "parallel_mode"
    order = Order.PARALLEL_MODE
    Config = ParallelModeConfig
    search_dimension = "parallel"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """Every rank data-parallel: the first choice of the layout dimension (always taken)."""
        return [(cls.name, ([("data", context.world_size)], None))]

    @classmethod
    def memory_saving(cls, config: ParallelModeConfig) -> Dict[str, float]:
        # Model-parallel degrees (tensor, pipeline) split the model's state across devices; the
        # data degree does not (the sharding optimizations declare what they split over it).
        return {"model_split": float(sum(math.log2(size) for name, size in config.dims or () if name != "data"))}

    @classmethod
    def cost_traits(cls, config: ParallelModeConfig, context: CostContext) -> Dict[str, Any]:
        # The layout; and DDP's flat gradient buckets when data > 1 and nothing else reduces gradients.
        return {"data": context.dims.get("data", 1), "tensor": context.dims.get("tensor", 1),
                "pipeline": context.dims.get("pipeline", 1), "ddp_wrap": True}

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
            for name, size in dims_t:
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise ValueError(f"parallel_mode: the size of {name!r} is {size!r} ({type(size).__name__}); "
                                     "sizes are integers >= 1, e.g. [('tensor', 2), ('data', 2)]")
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
    def describe_config(cls, config: ParallelModeConfig) -> str:
        return ",".join(f"{n}={s}" for n, s in config.dims) if config.dims else ""

    @classmethod
    def describe_step(cls, config: ParallelModeConfig) -> str:
        dims = cls.describe_config(config)
        return f"{cls.name}({dims})" if dims else cls.name

    @classmethod
    def plain_config(cls, config: ParallelModeConfig) -> Any:
        """The form the system we follow writes: ([[name, size], ...], rank_order), as JSON lists."""
        if config.dims is None:
            return None
        return [[[n, s] for n, s in config.dims], list(config.rank_order) if config.rank_order else None]
