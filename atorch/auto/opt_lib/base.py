"""The one interface every optimization implements, and its registry.

An optimization is a class with a typed `Config` dataclass and its metadata on the class:
`order` (apply phase, before the optimizer exists), `wrapper_order` (wrapper phase, after
it; None when the class has no wrapper), `requires`, `conflicts` (names) and
`config_conflicts` (names that conflict only under some config), `allowed_partners` (an
allow-list, for optimizations that were only tested with a few others), `distributed_only`,
`syncs_gradients` (whether it reduces gradients itself, so no DDP is added), and its effect
on the cost model (`cost_traits`). `validate` is pure and raises ValueError with actual and
expected values; `apply` transforms the model context, `apply_wrapper` wraps after the
optimizer is built (DDP, AMP scaling, engines).
Nothing else holds a list of names: the planner and `auto_accelerate` sort and check with
this metadata only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple, Type

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
    GRADIENT_ACCUMULATION = 5
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


@dataclass(frozen=True, eq=False)   # compared by identity: the dataset may be anything
class DataSetup:
    """What validation may know of the training data: auto_accelerate's dataset and how it is batched.

    An optimization that refuses some data when applied (pipeline_parallel: a batch key its stages
    cannot pass, a last batch that does not split into its chunks) checks it on these values in
    `apply` and, where a `ValidationContext` carries them (the automatic search fills them in), in
    validation too, so that the search never spends a dry run on a candidate `apply` would refuse.
    """

    dataset: Any = None                         # auto_accelerate's dataset (indexed at 0 and sized only)
    model_input_format: Optional[str] = None    # "unpack_dict", "unpack_sequence" or None
    reshapes_samples: bool = False              # a collate_fn or prepare_input turns samples into other batches
    global_batch_size: Optional[int] = None     # dataloader_args["batch_size"]
    drop_last: bool = True                      # dataloader_args.get("drop_last", True)
    sampler_given: bool = False                 # distributed_sampler_cls: the user's sampler decides the last batch

    @classmethod
    def of(cls, ctx: "ModelContext") -> "DataSetup":
        """The data of a model context (what `apply` sees, and what the search validates against)."""
        args = ctx.dataloader_args
        batch = args.get("batch_size")
        return cls(dataset=ctx.dataset, model_input_format=ctx.model_input_format,
                   reshapes_samples=ctx.prepare_input is not None or args.get("collate_fn") is not None,
                   global_batch_size=None if batch is None else int(batch), drop_last=bool(args.get("drop_last", True)),
                   sampler_given=ctx.distributed_sampler_cls is not None)


@dataclass
class ValidationContext:
    """What validation may look at: plain values only, identical on every rank, no collectives."""

    world_size: int
    model: Any = None                    # nn.Module (possibly on meta) or None
    model_config: Any = None             # e.g. a transformers PretrainedConfig
    device_type: str = "cpu"
    global_batch_size: Optional[int] = None   # dataloader_args["batch_size"], when known
    loss_func_given: bool = False        # the user passed auto_accelerate a loss_func of their own
    data: Optional[DataSetup] = None     # the training data, where known (the automatic search); None: apply checks it
    ranks_per_node: Optional[int] = None  # devices per node when the world spans several (the search's choices)
    strategy: Optional["Strategy"] = None
    configs: Dict[str, Any] = field(default_factory=dict)   # parsed configs by optimization name

    @property
    def any_model_config(self) -> Any:
        """`model_config`, else the model's own `config` (None without either)."""
        return self.model_config if self.model_config is not None else getattr(self.model, "config", None)

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


# `Optimization.search_dimension` of a class that has not declared one (a declaration of None is valid).
UNDECLARED = "<undeclared>"


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
    wrapper_order: ClassVar[Optional[int]] = None
    """Position in the wrapper phase (WrapperOrder); None when `apply_wrapper` does nothing."""
    requires: ClassVar[FrozenSet[str]] = frozenset()
    conflicts: ClassVar[FrozenSet[str]] = frozenset()
    allowed_partners: ClassVar[Optional[FrozenSet[str]]] = None
    """When set, the only optimizations this one may be combined with (new ones are refused by default)."""
    distributed_only: ClassVar[bool] = False
    global_batch_from_config: ClassVar[bool] = False
    """True when, without dataloader_args["batch_size"], the optimization takes the global batch from
    its own config (deepspeed_3d_parallel's ds_config) instead of torch's default of 1."""
    splits_over: ClassVar[FrozenSet[str]] = frozenset()
    """The parallel_mode dims this optimization divides the model over ("data" needs none: the
    dataloader always splits it). A dim of size > 1 that no optimization of a strategy splits over
    is refused: its ranks would repeat the same work."""
    Config: ClassVar[type] = NoConfig
    # The search dimension this optimization offers choices in (several optimizations may share
    # one, e.g. "parallel"), or None when the automatic search never chooses it. Every
    # optimization declares it on its own class; `search_choices` lists the choices.
    search_dimension: ClassVar[Optional[str]] = UNDECLARED

    @classmethod
    def search_choices(cls, context: "ValidationContext") -> List[Any]:
        """The choices of `search_dimension` this optimization offers for `context` (see
        `atorch.auto.search.space.Choice`: None for "not chosen", a name, (name, config), or a
        list applied together). The default offers "not chosen" and the default config;
        invalid combinations are dropped later by `validate`, so these may be optimistic."""
        return [None, cls.name]

    @classmethod
    def changes_nothing(cls, config: Any, context: "ValidationContext") -> Optional[str]:
        """Why applying this optimization under `config` to the strategy of `context` (validated,
        `context.configs` filled) would train exactly as the same strategy without it, and be no
        faster or leaner, else None. The search then keeps only the candidate without it."""
        return None

    @classmethod
    def memory_saving(cls, config: Any) -> Optional[Dict[str, float]]:
        """How much per-device memory this optimization under `config` saves, as a score per kind
        of saving ({}: none; None, the default: unknown). The search's out-of-memory learning
        compares the choices of one search dimension kind by kind (`space.memory_saving_ranks`):
        a choice scoring no higher than another in every kind needs at least its memory, so one
        that ran out of memory rules it out. Only the order of scores within a kind matters;
        savings that may trade off (two backends, CPU offload against deeper sharding) are kinds
        of their own, so they are never compared. An unknown effect leaves the dimension unordered:
        a new optimization is never wrongly assumed to save memory."""
        return None

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
        """How this optimization shows in `plan()`, e.g. 'fsdp(torch FSDP2, reshard)'."""
        return cls.name

    # Config fields shown (and saved) even at their default value: the ones a reader needs.
    always_shown: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def describe_config(cls, config: Any) -> str:
        """The config's settings in a strategy's name, e.g. 'bfloat16' or 'steps=4' ('' when nothing to say)."""
        return ",".join(f"{k}={short_value(v)}" for k, v in shown_fields(cls, config).items())

    @classmethod
    def plain_config(cls, config: Any) -> Any:
        """The config as plain JSON values (non-default fields, dtypes by name), or None when it cannot be."""
        fields = shown_fields(cls, config)
        plain = {k: _plain(v) for k, v in fields.items()}
        return None if any(v is _NOT_PLAIN for v in plain.values()) else plain

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


_NOT_PLAIN = object()


def shown_fields(cls: Type["Optimization"], config: Any) -> Dict[str, Any]:
    """Fields of a dataclass config that differ from their default, or that the class always shows."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return {}
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name.startswith("_"):
            continue
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else _NOT_PLAIN)
        if f.name in cls.always_shown or value != default:
            out[f.name] = value
    return out


def _plain(value: Any) -> Any:
    """JSON-ready: dtypes by name, tuples as lists; _NOT_PLAIN for classes, callables and objects."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items_d = {k: _plain(v) for k, v in value.items()}
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items_d.values()) else items_d
    return _NOT_PLAIN


def short_value(value: Any) -> str:
    plain = _plain(value)
    if plain is _NOT_PLAIN:
        return getattr(value, "__name__", type(value).__name__)
    if isinstance(plain, list):
        return "[" + ",".join(short_value(v) for v in value) + "]"
    return str(plain)


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


@dataclass(frozen=True)
class Registry:
    """Optimizations by name (and alias): where `resolve_strategy` and `SearchSpace` look names up.

    `default_registry()` is the live view of every registered optimization. Tests and tools
    that need extra or fewer optimizations build their own (`default_registry().with_optimizations(
    MyOpt)`, `Registry.of(A, B)`) instead of editing the global one.
    """

    optimizations: Mapping[str, Type[Optimization]]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, *classes: Type[Optimization]) -> "Registry":
        return cls({}, {}).with_optimizations(*classes)

    def with_optimizations(self, *classes: Type[Optimization]) -> "Registry":
        """A new registry with `classes` added (a name or alias already taken raises ValueError)."""
        optimizations, aliases = dict(self.optimizations), dict(self.aliases)
        for cls in classes:
            if not cls.name:
                raise ValueError(f"{cls.__name__} has no name")
            for key in (cls.name, *cls.aliases):
                if key in optimizations or key in aliases:
                    raise ValueError(f"optimization name {key!r} is registered twice")
            optimizations[cls.name] = cls
            aliases.update({alias: cls.name for alias in cls.aliases})
        return Registry(optimizations, aliases)

    def canonical_name(self, name: str) -> str:
        name = self.aliases.get(name, name)
        if name not in self.optimizations:
            raise ValueError(f"unknown optimization {name!r}; valid names are {sorted(self.optimizations)}")
        return name

    def canonical_names(self, argument: str, names: Optional[Iterable[str]],
                        ignore: Iterable[str] = ()) -> List[str]:
        """`names` (the value of `argument`, e.g. `excluded`) as registered names, aliases resolved, those in
        `ignore` left out; a name no optimization has is a ValueError naming the argument and its value."""
        given, skipped = list(names or ()), set(ignore)
        try:
            return [self.canonical_name(name) for name in given if name not in skipped]
        except ValueError as e:
            raise ValueError(f"{argument}={given!r}: {e}") from None

    def get(self, name: str) -> Type[Optimization]:
        return self.optimizations[self.canonical_name(name)]

    def names(self) -> List[str]:
        return sorted(self.optimizations)

    def classes(self) -> List[Type[Optimization]]:
        return [self.optimizations[n] for n in self.names()]


def default_registry() -> Registry:
    """Every optimization registered with `@register` (a live view: later registrations show)."""
    _load_all()
    return Registry(_REGISTRY, _ALIASES)


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
