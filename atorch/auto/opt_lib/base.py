"""The one interface every optimization implements, and its registry.

An optimization is a class with a typed `Config` dataclass and its metadata on the class:
`order` (apply phase, before the optimizer exists), `wrapper_order` (wrapper phase, after
it; None when the class has no wrapper), `requires`, `conflicts` (names) and
`config_conflicts` (names that conflict only under some config), `allowed_partners` (an
allow-list, for optimizations that were only tested with a few others), `distributed_only`,
`syncs_gradients` (whether it reduces gradients itself, so no DDP is added), and its
effect on the cost model (`cost_traits`). `validate`
is pure and raises ValueError with actual and expected values; `apply` transforms the model
context, `apply_wrapper` wraps after the optimizer is built (DDP, AMP scaling, engines).
Nothing else holds a list of names: the planner and `auto_accelerate` sort and check with
this metadata only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, FrozenSet, List, Optional, Tuple, Type

if TYPE_CHECKING:  # pragma: no cover
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy


class Order:
    """Application order; it follows the physics of each transformation.

    Groups first; pipeline splitting next (everything else applies per stage); tensor parallel
    shards weights before anything wraps them; LoRA adapts the (sharded) linears; activation
    checkpointing and module replacement change blocks, and compile compiles the result,
    before sharding wraps them; casting
    and autocast settings must be known to the sharding wrappers (FSDP mixed precision);
    sharding comes last before the optimizer; wrappers (ZeRO optimizers, DeepSpeed engines,
    DDP, gradient scaling) come after the optimizer exists.
    """

    PARALLEL_MODE = 0
    PIPELINE = 10
    TENSOR_PARALLEL = 20
    MODULE_REPLACE = 30
    LORA = 40
    CHECKPOINT = 50
    COMPILE = 55
    HALF = 60
    AMP = 70
    FP8 = 75
    SHARDING = 80
    DEEPSPEED_3D = 90
    DATA_PARALLEL_WRAP = 100


class WrapperOrder:
    """Order of the wrapper phase, which runs after the optimizer is built.

    Engines first (DeepSpeed takes the model and the optimizer and returns its own); then
    precision wrappers (autocast on the forward, fp16 gradient scaling around the optimizer);
    data-parallel DDP last, so it wraps the module everything else has prepared.
    """

    ENGINE = 10
    PRECISION = 20
    DATA_PARALLEL = 30


@dataclass(frozen=True)
class NoConfig:
    """For optimizations that take no options."""


@dataclass
class ValidationContext:
    """What validation may look at: plain values only, identical on every rank, no collectives."""

    world_size: int
    model: Any = None                    # nn.Module (possibly on meta) or None
    model_config: Any = None             # e.g. a transformers PretrainedConfig
    device_type: str = "cpu"
    strategy: Optional["Strategy"] = None
    configs: Dict[str, Any] = field(default_factory=dict)   # parsed configs by optimization name

    def parallel_sizes(self) -> Dict[str, int]:
        """{dim name: size} from the strategy's parallel_mode (all data-parallel when absent)."""
        cfg = self.configs.get("parallel_mode")
        if cfg is None or cfg.dims is None:
            return {"data": self.world_size}
        return dict(cfg.dims)


@dataclass(frozen=True)
class CostContext:
    """What a `cost_traits` declaration may look at: plain values of the whole strategy, no model."""

    world_size: int
    dims: Dict[str, int]                  # parallel sizes by name ({"data": world_size} without parallel_mode)
    device_type: str = "cpu"
    configs: Dict[str, Any] = field(default_factory=dict)   # parsed configs by optimization name


class Optimization:
    """Base class. Subclasses set the class attributes and override what they need."""

    name: ClassVar[str] = ""
    aliases: ClassVar[Tuple[str, ...]] = ()
    order: ClassVar[int] = 0
    wrapper_order: ClassVar[Optional[int]] = None
    """Position in the wrapper phase (WrapperOrder); None when `apply_wrapper` does nothing."""
    requires: ClassVar[FrozenSet[str]] = frozenset()
    conflicts: ClassVar[FrozenSet[str]] = frozenset()
    allowed_partners: ClassVar[Optional[FrozenSet[str]]] = None
    """When set, the only optimizations this one may be combined with (new ones are refused by default)."""
    distributed_only: ClassVar[bool] = False
    Config: ClassVar[type] = NoConfig

    @classmethod
    def config_conflicts(cls, config: Any) -> Dict[str, str]:
        """{optimization name: why} of partners that conflict with this one under `config` only."""
        return {}

    @classmethod
    def wraps(cls, config: Any) -> bool:
        """Whether `apply_wrapper` does anything under `config` (it then runs at `wrapper_order`)."""
        return cls.wrapper_order is not None

    @classmethod
    def syncs_gradients(cls, config: Any) -> bool:
        """True when this optimization reduces gradients over the data ranks itself (no DDP is then added)."""
        return False

    @classmethod
    def describe_step(cls, config: Any) -> str:
        """How this optimization shows in `Strategy.plan()`, e.g. 'fsdp(torch FSDP2, reshard)'."""
        return cls.name

    @classmethod
    def parse_config(cls, raw: Any) -> Any:
        """Turn a user config (None, dict, or a Config instance) into a Config, naming bad keys."""
        if isinstance(raw, cls.Config):
            return raw
        if raw is None:
            return cls.Config()
        if isinstance(raw, dict) and dataclasses.is_dataclass(cls.Config):
            valid = [f.name for f in dataclasses.fields(cls.Config)]
            unknown = [k for k in raw if k not in valid]
            if unknown:
                raise ValueError(f"{cls.name}: unknown config key(s) {unknown}; valid keys are {valid}")
            try:
                return cls.Config(**raw)
            except TypeError as e:  # a missing required field
                raise ValueError(f"{cls.name}: bad config {raw!r}: {e}") from e
        raise ValueError(f"{cls.name}: config {raw!r} must be None, a dict with keys "
                         f"{[f.name for f in dataclasses.fields(cls.Config)]}, or {cls.Config.__name__}")

    @classmethod
    def cost_traits(cls, config: Any, context: CostContext) -> Dict[str, Any]:
        """This optimization's effect on the cost model: updates of `atorch.auto.cost_model.StrategyTraits` fields.

        The default, {}, declares "no effect on memory or step time". Every registered
        optimization states its effect explicitly, even when it is none (a test checks).
        """
        return {}

    def validate(self, config: Any, context: ValidationContext) -> None:
        """Raise ValueError if this optimization cannot apply; never touches the network."""

    def apply(self, ctx: "ModelContext", config: Any) -> None:
        """Transform the model context before the optimizer is created."""

    def apply_wrapper(self, ctx: "ModelContext", config: Any) -> None:
        """Transform the model context after the optimizer is created."""


_REGISTRY: Dict[str, Type[Optimization]] = {}
_ALIASES: Dict[str, str] = {}


def register(cls: Type[Optimization]) -> Type[Optimization]:
    """Class decorator adding an optimization (and its aliases) to the registry."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    for key in (cls.name, *cls.aliases):
        if key in _REGISTRY or key in _ALIASES:
            raise ValueError(f"optimization name {key!r} is registered twice")
    _REGISTRY[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name
    return cls


def canonical_name(name: str) -> str:
    _load_all()
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown optimization {name!r}; valid names are {sorted(_REGISTRY)}")
    return name


def get_optimization(name: str) -> Type[Optimization]:
    return _REGISTRY[canonical_name(name)]


def registered_names() -> List[str]:
    _load_all()
    return sorted(_REGISTRY)


_LOADED = False


def _load_all() -> None:
    """Import every module of this package once, so each registers itself."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import os
    import pkgutil

    # By file name, not by importing the package object: the package's __init__ imports this module.
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.name not in ("base", "resolve"):
            importlib.import_module(f"{package}.{info.name}")
