"""The one interface every optimization implements, and its registry.

An optimization is a class with a typed `Config` dataclass and its metadata on the class
(`order`, `requires`, `conflicts`, `distributed_only`, `tunable`). `validate` is pure and
raises ValueError with actual and expected values; `apply` transforms the model context
before the optimizer is built, `apply_wrapper` after it (DDP, AMP scaling, engines).
Nothing else holds a list of names: the planner and `auto_accelerate` sort and check with
this metadata only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Tuple, Type

if TYPE_CHECKING:  # pragma: no cover
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy


class Order:
    """Application order; it follows the physics of each transformation.

    Groups first; pipeline splitting next (everything else applies per stage); tensor parallel
    shards weights before anything wraps them; LoRA adapts the (sharded) linears; activation
    checkpointing and module replacement change blocks before sharding wraps them; casting
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
    HALF = 60
    AMP = 70
    FP8 = 75
    SHARDING = 80
    DEEPSPEED_3D = 90
    DATA_PARALLEL_WRAP = 100


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
class ConfigAlias:
    """How one config key of the system we follow (ATorch) maps onto an optimization's typed Config.

    `to`: the Config field that receives the value (a renamed key). Otherwise the key has no
    field here: values for which `accepts(value)` is true ask for what atorch does anyway and
    are dropped; any other value raises ValueError with `instead` (what to use instead).
    """

    to: Optional[str] = None
    accepts: Optional[Callable[[Any], bool]] = None
    instead: str = ""


def is_true(value: Any) -> bool:
    return value is True


def is_false(value: Any) -> bool:
    return value is False


class Optimization:
    """Base class. Subclasses set the class attributes and override what they need."""

    name: ClassVar[str] = ""
    aliases: ClassVar[Tuple[str, ...]] = ()
    order: ClassVar[int] = 0
    requires: ClassVar[FrozenSet[str]] = frozenset()
    conflicts: ClassVar[FrozenSet[str]] = frozenset()
    distributed_only: ClassVar[bool] = False
    tunable: ClassVar[bool] = False
    Config: ClassVar[type] = NoConfig
    # ATorch config keys accepted in a dict config, declared per class (see ConfigAlias).
    config_aliases: ClassVar[Mapping[str, ConfigAlias]] = {}

    @classmethod
    def normalize_config(cls, raw: Any) -> Any:
        """Rewrite ATorch's spellings of a config into this class's own, before parsing.

        The base version maps the keys of a dict through `config_aliases`; subclasses extend
        it for other shapes (e.g. a bare class for `checkpoint`). Raises ValueError for an
        option that cannot be honoured, naming it and what to use instead.
        """
        if not isinstance(raw, dict) or not cls.config_aliases:
            return raw
        out = {k: v for k, v in raw.items() if k not in cls.config_aliases}
        for key, value in raw.items():
            alias = cls.config_aliases.get(key)
            if alias is None:
                continue
            if alias.to is not None:
                if alias.to in out and out[alias.to] != value:
                    raise ValueError(f"{cls.name}: {key!r} (ATorch's name for {alias.to!r}) and {alias.to!r} are both "
                                     f"given, with different values {value!r} and {out[alias.to]!r}; give one")
                out[alias.to] = value
            elif alias.accepts is None or not alias.accepts(value):
                raise ValueError(f"{cls.name}: {key}={value!r} is not supported: {alias.instead}")
        return out

    @classmethod
    def parse_config(cls, raw: Any) -> Any:
        """Turn a user config (None, dict, or a Config instance) into a Config, naming bad keys."""
        raw = cls.normalize_config(raw)
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
    import pkgutil

    import atorch.auto.opt_lib as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "resolve"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
