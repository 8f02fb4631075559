"""Turn a `Strategy` into the ordered list of (optimization, parsed config) to apply.

Pure: every check runs on every rank before any collective, so a bad strategy raises the
same ValueError everywhere instead of hanging some ranks. The planner uses the same
function to drop invalid candidates.

Two optimizations are added when missing (`implied_optimizations`, which the cost model
completes a strategy with too): `parallel_mode` (every rank data-parallel) and, when the
data-parallel size is above 1 and no optimization of the strategy reduces gradients itself
(`syncs_gradients`), `ddp`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Type

from atorch.auto.opt_lib.base import Optimization, Registry, ValidationContext, default_registry
from atorch.auto.opt_lib.parallel_mode import ParallelModeConfig
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.tensor_parallel.layers import TensorParallelModule

logger = logging.getLogger(__name__)


@dataclass
class ResolvedOptimization:
    """One optimization of a resolved strategy: the instance that applies it (both phases) and its config."""

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

    A missing `parallel_mode` is added (all ranks data-parallel), and `ddp` when gradients
    would otherwise not be averaged; an item repeated with the same config is dropped with a
    log line; anything else questionable raises ValueError. `registry` defaults to every
    registered optimization; `validate` to calling each one's `validate`.
    """
    registry = registry if registry is not None else default_registry()
    canonical_name, get_optimization = registry.canonical_name, registry.get
    seen: Dict[str, Any] = {}
    resolved: List[ResolvedOptimization] = []

    def add(name: str, raw_config: Any = None, tunable: bool = False) -> None:
        cls = get_optimization(name)
        config = cls.parse_config(raw_config)
        if name in seen:
            if seen[name] == config:
                logger.info("optimization %r is listed twice with the same config; applying it once", name)
                return
            raise ValueError(f"optimization {name!r} is listed twice with different configs: {seen[name]!r} and "
                             f"{config!r}")
        seen[name] = config
        resolved.append(ResolvedOptimization(cls(), config, StrategyItem(name, raw_config, tunable)))

    for item in strategy:
        add(canonical_name(item.name), item.config, item.tunable)
    for name in implied_optimizations(seen, context.world_size, registry):
        add(name)

    _check_combination(resolved, context)
    context.configs = dict(seen)
    context.strategy = Strategy(r.item for r in resolved)
    for r in resolved:
        if validate is None:
            r.optimization.validate(r.config, context)
        else:
            validate(r.optimization, r.config, context)
    # Last, so a strategy that cannot work at all is reported by the optimization that knows why.
    _check_dims_are_split(resolved, context, registry)
    return sorted(resolved, key=lambda r: type(r.optimization).order)


def _check_dims_are_split(resolved: List[ResolvedOptimization], context: ValidationContext,
                          registry: Registry) -> None:
    """Every parallel dim of size > 1 but "data" is split by an optimization of the strategy (`splits_over`).

    Otherwise the ranks along it get the same batches and nothing reduces their gradients: the
    same step computed size times (a forgotten tensor_parallel, or a typo such as 'dta').
    """
    for dim, size in context.parallel_sizes().items():
        if dim == "data" or size == 1 or any(dim in type(r.optimization).splits_over for r in resolved):
            continue
        if dim == "tensor" and context.model is not None and \
                any(isinstance(m, TensorParallelModule) for m in context.model.modules()):
            continue   # a model sharded by hand (ATorch's tp_manual_shard_custom_fn) uses the group itself
        offered = sorted(n for n in registry.names() if dim in registry.get(n).splits_over)
        if offered:
            fix = f"add {' or '.join(offered)} to the strategy"
            if dim == "tensor":
                fix += " (a model sharded by hand is recognised by its atorch.tensor_parallel layers)"
        else:
            known = sorted({d for n in registry.names() for d in registry.get(n).splits_over} | {"data"})
            fix = f"no optimization splits over {dim!r}; atorch splits over {known} (a typo?)"
        raise ValueError(f"parallel_mode: dim {dim!r} has size {size} but no optimization of the strategy splits "
                         f"over it, so its {size} ranks would repeat the same work: {fix}")


def implied_optimizations(configs: Mapping[str, Any], world_size: int,
                          registry: Optional[Registry] = None) -> Dict[str, Any]:
    """The optimizations `resolve_strategy` adds to a strategy of `configs` ({canonical name: parsed
    config}), with their parsed default configs: `parallel_mode` when missing (every rank
    data-parallel), then `ddp` when the data-parallel size is above 1 and nothing reduces gradients.
    The cost model completes a strategy with it too, so it estimates what `auto_accelerate` builds."""
    registry = registry if registry is not None else default_registry()
    added: Dict[str, Any] = {}
    if "parallel_mode" not in configs:
        added["parallel_mode"] = registry.get("parallel_mode").parse_config(None)
    present = {**configs, **added}
    parallel: ParallelModeConfig = present["parallel_mode"]
    data = parallel.sizes(world_size).get("data", 1)
    if "ddp" not in configs and "ddp" in registry.names() and data > 1 and \
            not any(registry.get(name).syncs_gradients(config) for name, config in present.items()):
        added["ddp"] = registry.get("ddp").parse_config(None)
    return added


def _check_combination(resolved: List[ResolvedOptimization], context: ValidationContext) -> None:
    """Conflicts (static and config-dependent), allow-lists, requirements and the world size."""
    names = [r.name for r in resolved]
    for r in resolved:
        cls = type(r.optimization)
        for other in resolved:
            if other is r:
                continue
            reason = _conflict(cls, r.config, other)
            if reason is not None:
                raise ValueError(reason)
        missing = [req for req in cls.requires if req not in names]
        if missing:
            raise ValueError(f"optimization {r.name!r} requires {missing} in the same strategy")
        if cls.distributed_only and context.world_size < 2:
            raise ValueError(f"optimization {r.name!r} needs more than one process (world size is "
                             f"{context.world_size})")


def _conflict(cls: Type[Optimization], config: Any, other: ResolvedOptimization) -> Optional[str]:
    """Why `cls` (under `config`) cannot be combined with `other`, or None."""
    other_cls = type(other.optimization)
    if other.name in cls.conflicts or cls.name in other_cls.conflicts:
        first, second = sorted((cls.name, other.name))
        return f"optimizations {first!r} and {second!r} cannot be combined"
    reason = cls.config_conflicts(config).get(other.name)
    if reason is not None:
        first, second = sorted((cls.name, other.name))
        return f"optimizations {first!r} and {second!r} cannot be combined: {reason}"
    if cls.allowed_partners is not None and other.name not in cls.allowed_partners:
        first, second = sorted((cls.name, other.name))
        return (f"optimizations {first!r} and {second!r} cannot be combined: {cls.name!r} combines only with "
                f"{sorted(cls.allowed_partners)}")
    return None


def wrapper_phase(resolved: List[ResolvedOptimization]) -> List[ResolvedOptimization]:
    """The optimizations that wrap after the optimizer is built, in wrapper order."""
    wrappers = [r for r in resolved if type(r.optimization).wrapper_order is not None
                and type(r.optimization).wraps(r.config)]
    return sorted(wrappers, key=lambda r: int(type(r.optimization).wrapper_order or 0))


def plan_steps(resolved: List[ResolvedOptimization]) -> List[str]:
    """The transformations a resolved strategy performs, in the order they run.

    The apply phase (optimizations that override `apply`), then "optimizer", then the wrapper
    phase; e.g. ['checkpoint', 'amp_native'] on 2 ranks gives ['parallel_mode', 'checkpoint',
    'amp_native(bfloat16)', 'optimizer', 'amp_native(bfloat16)', 'ddp'] (a parallel_mode given
    dims shows them: 'parallel_mode(tensor=2,data=1)').
    """
    applying = [r for r in resolved if type(r.optimization).apply is not Optimization.apply]
    return ([type(r.optimization).describe_step(r.config) for r in applying] + ["optimizer"]
            + [type(r.optimization).describe_step(r.config) for r in wrapper_phase(resolved)])


def is_valid_strategy(strategy: Strategy, context: ValidationContext, registry: Optional[Registry] = None) -> bool:
    """True when `resolve_strategy` accepts it (for the planner's candidate filtering)."""
    try:
        resolve_strategy(strategy, context, registry)
    except ValueError:
        return False
    return True


def plan(strategy: Strategy, world_size: int = 1, model: Any = None, device_type: str = "cpu") -> str:
    """The stack `strategy` builds, as one readable line (validates it first, like `auto_accelerate`).

    e.g. `plan(Strategy(["checkpoint", "fsdp", "amp_native"]), world_size=2)` ->
    'parallel_mode -> checkpoint -> amp_native(bfloat16) -> fsdp(torch FSDP2, reshard) -> optimizer ->
    amp_native(bfloat16)'.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"plan: world_size={world_size!r} must be an int >= 1 (the number of ranks)")
    context = ValidationContext(world_size=world_size, model=model, model_config=getattr(model, "config", None),
                                device_type=device_type)
    return " -> ".join(plan_steps(resolve_strategy(Strategy.from_any(strategy), context)))
