"""Turn a `Strategy` into the ordered list of (optimization, parsed config) to apply.

Pure: every check runs on every rank before any collective, so a bad strategy raises the
same ValueError everywhere instead of hanging some ranks. The planner uses the same
function to drop invalid candidates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from atorch.auto.opt_lib.base import Optimization, Registry, ValidationContext, default_registry
from atorch.auto.strategy import Strategy, StrategyItem

logger = logging.getLogger(__name__)


@dataclass
class ResolvedOptimization:
    optimization: Optimization
    config: Any
    item: StrategyItem

    @property
    def name(self) -> str:
        return self.optimization.name


# validate(optimization, config, context): how each optimization's `validate` is called (e.g. memoized).
Validator = Callable[[Optimization, Any, ValidationContext], None]


def resolve_strategy(strategy: Strategy, context: ValidationContext, registry: Optional[Registry] = None,
                     validate: Optional[Validator] = None) -> List[ResolvedOptimization]:
    """Validate `strategy` against the registry and return it in application order.

    A missing `parallel_mode` is added (all ranks data-parallel); an item repeated with the
    same config is dropped with a log line; anything else questionable raises ValueError.
    `registry` defaults to every registered optimization; `validate` to calling each one's `validate`.
    """
    registry = registry if registry is not None else default_registry()
    canonical_name, get_optimization = registry.canonical_name, registry.get
    seen: dict = {}
    resolved: List[ResolvedOptimization] = []
    for item in strategy:
        name = canonical_name(item.name)
        cls = get_optimization(name)
        config = cls.parse_config(item.config)
        if name in seen:
            if seen[name] == config:
                logger.info("optimization %r is listed twice with the same config; applying it once", name)
                continue
            raise ValueError(f"optimization {name!r} is listed twice with different configs: {seen[name]!r} and "
                             f"{config!r}")
        seen[name] = config
        resolved.append(ResolvedOptimization(cls(), config, StrategyItem(name, item.config, item.tunable)))
    if "parallel_mode" not in seen:
        cls = get_optimization("parallel_mode")
        config = cls.parse_config(None)
        seen["parallel_mode"] = config
        resolved.append(ResolvedOptimization(cls(), config, StrategyItem("parallel_mode")))

    names = [r.name for r in resolved]
    for r in resolved:
        cls = type(r.optimization)
        for other in names:
            if other != r.name and (other in cls.conflicts or r.name in get_optimization(other).conflicts):
                first, second = sorted((r.name, other))
                raise ValueError(f"optimizations {first!r} and {second!r} cannot be combined")
        missing = [req for req in cls.requires if req not in names]
        if missing:
            raise ValueError(f"optimization {r.name!r} requires {missing} in the same strategy")
        if cls.distributed_only and context.world_size < 2:
            raise ValueError(f"optimization {r.name!r} needs more than one process (world size is "
                             f"{context.world_size})")

    context.configs = dict(seen)
    context.strategy = Strategy(r.item for r in resolved)
    for r in resolved:
        if validate is None:
            r.optimization.validate(r.config, context)
        else:
            validate(r.optimization, r.config, context)
    return sorted(resolved, key=lambda r: type(r.optimization).order)


def is_valid_strategy(strategy: Strategy, context: ValidationContext, registry: Optional[Registry] = None) -> bool:
    """True when `resolve_strategy` accepts it (for the planner's candidate filtering)."""
    try:
        resolve_strategy(strategy, context, registry)
    except ValueError:
        return False
    return True
