"""`SearchSpace`: named dimensions of choices, and the valid strategies they combine into.

Validity is decided by the optimization registry alone (`resolve_strategy`, the same rules
`auto_accelerate` enforces): a combination is a candidate exactly when `auto_accelerate`
would accept it. No compatibility table lives here, and no list of names either: the
automatic space (`SearchSpace.default_for`) is what each registered optimization declares
(`search_dimension`, `search_choices`).
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atorch.auto.arguments import BatchLayoutError, validate_resolved_layout
from atorch.auto.opt_lib.base import (
    UNDECLARED,
    DataSetup,
    Registry,
    ValidationContext,
    default_registry,
    get_optimization,
)
from atorch.auto.opt_lib.resolve import ResolvedOptimization, resolve_strategy
from atorch.auto.strategy import Strategy, StrategyItem

logger = logging.getLogger(__name__)

# A choice: None (nothing), a name, (name, config), or a list of those applied together
# (e.g. a tensor split: its parallel_mode *and* tensor_parallel).
Choice = Any


@dataclass(frozen=True)
class Candidate:
    """One valid strategy of the space and the choice it takes in every dimension."""

    strategy: Strategy               # in application order, as `resolve_strategy` returns it
    choices: Tuple[int, ...]         # index of the chosen option per dimension

    def label(self) -> str:
        """`Strategy.describe()` plus each item's config where one is set, so that candidates
        differing only in a config (zero2 on torch or DeepSpeed, the accumulation steps) have
        different labels in the trial table."""
        return "+".join(choice_label(item) for item in self.strategy)


def choice_items(choice: Choice) -> List[StrategyItem]:
    """The strategy items a choice contributes (none for None)."""
    if choice is None:
        return []
    if isinstance(choice, str):
        return [StrategyItem(choice)]
    if isinstance(choice, StrategyItem):
        return [choice]
    if isinstance(choice, tuple) and len(choice) in (2, 3) and isinstance(choice[0], str):
        return list(Strategy([choice]))
    if isinstance(choice, (list, Strategy)):
        return [item for c in choice for item in choice_items(c)]
    raise ValueError(f"search space choice {choice!r} must be None, an optimization name, (name, config), or a list "
                     "of those")


def choice_label(choice: Choice) -> str:
    """A short readable label, unique within a dimension (used as HEBO's category name)."""
    items = choice_items(choice)
    if not items:
        return "none"
    return "+".join(_item_label(i) for i in items)


def _item_label(item: StrategyItem) -> str:
    """The item as `Strategy.describe` shows it (its settings: dtype, DeepSpeed stage, steps, ...),
    or its name and config for an optimization the default registry does not know."""
    try:
        get_optimization(item.name)
    except ValueError:
        return item.name + ("" if item.config is None else f"{item.config!r}")
    return Strategy([item]).describe()


class SearchSpace:
    """Dimensions of choices; `candidates()` lists the valid strategies they combine into.

    `dimensions` maps a dimension name to its choices (see `Choice`). Validity is checked
    against a `ValidationContext` built from `world_size`, `model`, `model_config`,
    `device_type`, `global_batch_size` and `data` (the training data, where known: candidates
    `apply` would refuse for it are left out); `world_size` defaults to the size of the
    parallel_mode choices, else 1. Names are looked up in `registry` (default: every
    registered optimization).
    """

    def __init__(self, dimensions: Mapping[str, Sequence[Choice]], *, world_size: Optional[int] = None,
                 model: Any = None, model_config: Any = None, device_type: str = "cpu",
                 global_batch_size: Optional[int] = None, registry: Optional[Registry] = None,
                 merge_idle: bool = True, loss_func_given: bool = False,
                 excluded: Optional[Sequence[str]] = None, data: Optional[DataSetup] = None,
                 ranks_per_node: Optional[int] = None) -> None:
        """`merge_idle=False` keeps candidates in which an optimization changes nothing
        (`Optimization.changes_nothing`); benchmarks whose synthetic landscapes give them a
        throughput of their own use it. Otherwise only the candidate without it is kept.
        `loss_func_given`: the user trains with a loss_func of their own (what validation sees).
        `excluded`: names no candidate may hold, also when resolution would add them (`ddp`)."""
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
                raise TypeError(f"SearchSpace: world_size={world_size!r} must be an int (or None: inferred from the "
                                f"parallel_mode choices), got {type(world_size).__name__}")
            if world_size < 1:
                raise ValueError(f"SearchSpace: world_size={world_size} must be >= 1")
        if not dimensions:
            raise ValueError("a search space needs at least one dimension, e.g. {'amp': [None, 'amp_native']}")
        self.dimensions: Dict[str, List[Choice]] = {}
        for name, choices in dimensions.items():
            choices = list(choices)
            if not choices:
                raise ValueError(f"search space dimension {name!r} has no choices; give at least [None]")
            labels = [choice_label(c) for c in choices]
            if len(set(labels)) != len(labels):
                raise ValueError(f"search space dimension {name!r} repeats a choice: {labels}")
            self.dimensions[name] = choices
        self.world_size = world_size if world_size is not None else _infer_world_size(self.dimensions)
        self.model = model
        self.model_config = model_config if model_config is not None else getattr(model, "config", None)
        self.device_type = device_type
        self.global_batch_size = global_batch_size
        self.registry = registry if registry is not None else default_registry()
        self.merge_idle = merge_idle
        self.loss_func_given = loss_func_given
        self.data = data
        self.ranks_per_node = ranks_per_node
        self.excluded = frozenset(excluded or ())
        self._candidates: Optional[List[Candidate]] = None
        self.rejected: Dict[str, str] = {}     # strategy description -> why resolve_strategy refused it
        # ... of which those the global batch does not split over (`global_batch_size`)
        self.batch_refused: Dict[str, str] = {}

    def __repr__(self) -> str:
        sizes = {name: len(c) for name, c in self.dimensions.items()}
        return f"SearchSpace({sizes}, world_size={self.world_size}, device_type={self.device_type!r})"

    @property
    def size(self) -> int:
        """Number of combinations before validity filtering."""
        return math.prod(len(c) for c in self.dimensions.values())

    def labels(self) -> Dict[str, List[str]]:
        return {name: [choice_label(c) for c in choices] for name, choices in self.dimensions.items()}

    def validation_context(self) -> ValidationContext:
        return ValidationContext(world_size=self.world_size, model=self.model, model_config=self.model_config,
                                 device_type=self.device_type, global_batch_size=self.global_batch_size,
                                 loss_func_given=self.loss_func_given, data=self.data,
                                 ranks_per_node=self.ranks_per_node)

    def candidates(self) -> List[Candidate]:
        """Every valid combination once (combinations that resolve to the same strategy are merged)."""
        if self._candidates is None:
            self._candidates = self._enumerate()
        return list(self._candidates)

    def strategies(self) -> List[Strategy]:
        return [c.strategy for c in self.candidates()]

    def _enumerate(self) -> List[Candidate]:
        out: List[Candidate] = []
        seen = set()
        validate = ValidationCache()
        items_of = [[choice_items(c) for c in choices] for choices in self.dimensions.values()]
        offers_none = [any(not c for c in dim) for dim in items_of]
        for combo in itertools.product(*(range(len(choices)) for choices in items_of)):
            chosen = [dim[i] for dim, i in zip(items_of, combo)]
            raw = Strategy(item for c in chosen for item in c)
            context = self.validation_context()
            try:
                resolved = resolve_strategy(raw, context, self.registry, validate)
                added = sorted(self.excluded.intersection(r.name for r in resolved))
                if added:   # resolution adds ddp when nothing else reduces the gradients
                    raise ValueError(f"{added[0]} is excluded, and resolution adds it to this combination (nothing "
                                     "else of it reduces the gradients)")
                if self.global_batch_size is not None:
                    # What auto_accelerate checks last (`_validate_layout`): the global batch splits
                    # over the data ranks and into the pipeline's chunks.
                    validate_resolved_layout({"batch_size": self.global_batch_size}, context)
            except ValueError as e:
                self.rejected[raw.describe()] = str(e)
                if isinstance(e, BatchLayoutError):
                    self.batch_refused[raw.describe()] = str(e)
                continue
            idle = self._changes_nothing(resolved, context, chosen, offers_none, validate) if self.merge_idle else None
            if idle is not None:
                self.rejected[raw.describe()] = f"the same as without it: {idle}"
                continue
            strategy = Strategy(r.item for r in resolved)
            key = _strategy_key(strategy)
            if key in seen:
                continue
            seen.add(key)
            out.append(Candidate(strategy, tuple(combo)))
        logger.info("search space: %d combinations, %d valid candidates", self.size, len(out))
        return out

    def _changes_nothing(self, resolved: List[ResolvedOptimization], context: ValidationContext,
                         chosen: List[List[StrategyItem]], offers_none: List[bool], validate: "ValidationCache"
                         ) -> Optional[str]:
        """Why one optimization of a candidate changes nothing (`Optimization.changes_nothing`), when
        the candidate without it is in the space too: its dimension's choice is that optimization
        alone, the dimension also offers "not chosen" (an `included` one does not), and the
        strategy without it is valid."""
        for r in resolved:
            why = type(r.optimization).changes_nothing(r.config, context)
            if why is None:
                continue
            for d, (items, none_too) in enumerate(zip(chosen, offers_none)):
                if none_too and items and {self.registry.canonical_name(i.name) for i in items} == {r.name}:
                    without = Strategy(i for e, dim in enumerate(chosen) if e != d for i in dim)
                    try:
                        resolve_strategy(without, self.validation_context(), self.registry, validate)
                    except ValueError:
                        return None     # something else needs it: it is the only way to that candidate
                    return f"{r.name}: {why}"
        return None

    # -- derived spaces -------------------------------------------------------------------------
    def restricted(self, excluded: Optional[Sequence[str]] = None,
                   included: Optional[Sequence[str]] = None) -> "SearchSpace":
        """A copy without the `excluded` optimizations and with every `included` one in all candidates.

        An included name no dimension offers becomes a dimension of its own with that single choice.
        """
        excluded_set = set(self._known_names("excluded", excluded))
        if "parallel_mode" in excluded_set:
            raise ValueError("excluded=[..., 'parallel_mode']: every strategy has a parallel layout (by default all "
                             "ranks data-parallel), so parallel_mode cannot be excluded; to keep every rank "
                             "data-parallel, exclude tensor_parallel and pipeline_parallel")
        included_list = self._known_names("included", included)
        clash = excluded_set.intersection(included_list)
        if clash:
            raise ValueError(f"optimizations {sorted(clash)} are both excluded and included")
        dims: Dict[str, List[Choice]] = {}
        for name, choices in self.dimensions.items():
            kept = [c for c in choices if not {i.name for i in choice_items(c)} & excluded_set]
            forced = [n for n in included_list if any(n in {i.name for i in choice_items(c)} for c in kept)]
            if forced:
                kept = [c for c in kept if set(forced) <= {i.name for i in choice_items(c)}]
            dims[name] = kept or [None]
        offered = {i.name for choices in dims.values() for c in choices for i in choice_items(c)}
        for name in included_list:
            if name not in offered:
                dims[f"included:{name}"] = [name]
        return SearchSpace(dims, world_size=self.world_size, model=self.model, model_config=self.model_config,
                           device_type=self.device_type, global_batch_size=self.global_batch_size,
                           registry=self.registry, merge_idle=self.merge_idle, loss_func_given=self.loss_func_given,
                           excluded=sorted(self.excluded | excluded_set), data=self.data,
                           ranks_per_node=self.ranks_per_node)

    def _known_names(self, argument: str, names: Optional[Sequence[str]]) -> List[str]:
        """`names` as registered names (aliases resolved); a name no optimization has raises, since a typo
        in `excluded` would otherwise be ignored and one in `included` would leave no candidate."""
        return self.registry.canonical_names(argument, names)

    @classmethod
    def default_for(cls, model: Any, world_size: int, device_type: str = "cpu", model_config: Any = None, *,
                    global_batch_size: Optional[int] = None, registry: Optional[Registry] = None,
                    loss_func_given: bool = False, data: Optional[DataSetup] = None,
                    ranks_per_node: Optional[int] = None) -> "SearchSpace":
        """The automatic space: every dimension the registered optimizations declare.

        Today: the layout (data, tensor and pipeline splits of `world_size`), micro-batches per
        step (gradient accumulation at the fixed `global_batch_size`, when given), module
        replacement, activation checkpointing, amp, and the ZeRO stage with its backend (torch
        or DeepSpeed) and CPU offload where valid. Choices are optimistic; each optimization's
        own validation drops the combinations it cannot run (`data`, where given, included: the
        search passes its dataset, so that no candidate `apply` would refuse for it is dry-run).
        `ranks_per_node`: devices per node where the world spans several nodes (tensor splits stay
        inside one; None: unknown, every split offered).
        """
        registry = registry if registry is not None else default_registry()
        context = ValidationContext(world_size=world_size, model=model,
                                    model_config=model_config if model_config is not None
                                    else getattr(model, "config", None),
                                    device_type=device_type, global_batch_size=global_batch_size,
                                    loss_func_given=loss_func_given, data=data, ranks_per_node=ranks_per_node)
        return cls(declared_dimensions(registry, context), world_size=world_size, model=model,
                   model_config=model_config, device_type=device_type, global_batch_size=global_batch_size,
                   registry=registry, loss_func_given=loss_func_given, data=data, ranks_per_node=ranks_per_node)


def declared_dimensions(registry: Registry, context: ValidationContext) -> Dict[str, List[Choice]]:
    """{dimension: choices} from the optimizations' declarations, in application order.

    Dimensions are ordered by the earliest `order` of the optimizations declaring them; within
    one, "not chosen" (None) comes first when any of them offers it, then the choices in
    `order`. A dimension with nothing but None is left out. An optimization that declares
    nothing (not even None) is not searched, with a warning (tests/unit/test_space.py requires
    every registered optimization to declare).
    """
    found: Dict[str, List[Tuple[int, str, List[Choice]]]] = {}
    for opt in registry.classes():
        dim = opt.search_dimension
        if dim == UNDECLARED:
            logger.warning("optimization %r (%s) declares no search_dimension, so the search never tries it; set it to "
                           "the dimension it offers choices in, or to None", opt.name, opt.__name__)
            continue
        if dim is None:
            continue
        found.setdefault(dim, []).append((opt.order, opt.name, list(opt.search_choices(context))))
    dims: Dict[str, List[Choice]] = {}
    for dim, entries in sorted(found.items(), key=lambda kv: (min(e[0] for e in kv[1]), kv[0])):
        entries.sort(key=lambda e: (e[0], e[1]))
        offered = [c for _, _, choices in entries for c in choices]
        choices: List[Choice] = [None] if any(c is None for c in offered) else []
        labels = {"none"}
        for c in offered:
            if c is not None and choice_label(c) not in labels:
                labels.add(choice_label(c))
                choices.append(c)
        if any(c is not None for c in choices):
            dims[dim] = choices
    return dims


_MISSING = object()


class _RecordingConfigs(dict):
    """The configs of a strategy, remembering which names a validation looked at."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.read: set = set()
        self.everything = False

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def _all(self) -> None:
        self.everything = True

    def __iter__(self):  # type: ignore[override]
        self._all()
        return super().__iter__()

    def keys(self):  # type: ignore[override]
        self._all()
        return super().keys()

    def items(self):  # type: ignore[override]
        self._all()
        return super().items()

    def values(self):  # type: ignore[override]
        self._all()
        return super().values()

    def __len__(self) -> int:
        self._all()
        return super().__len__()


def _value_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


class ValidationCache:
    """Memoized `Optimization.validate` for the combinations of one space.

    Validation is pure (see `ValidationContext`), and within one space only the strategy's
    other configs vary, so an outcome (accepted, or the ValueError) is reused whenever the
    configs the validation actually read -- recorded while it ran -- are the same. Each
    model-walking validation (tensor-parallel plans, module replacement, checkpoint blocks)
    then runs once per distinct setting instead of once per combination.
    """

    def __init__(self) -> None:
        self._entries: Dict[Tuple[str, Any], List[Tuple[Optional[Tuple[Tuple[str, Any], ...]], Optional[ValueError]]]]
        self._entries = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, optimization: Any, config: Any, context: ValidationContext) -> None:
        key = (optimization.name, _value_key(config))
        configs = context.configs
        for reads, cached_error in self._entries.get(key, ()):
            if reads is not None and all(_value_key(configs.get(k, _MISSING)) == v for k, v in reads):
                self.hits += 1
                if cached_error is not None:
                    raise cached_error
                return
        self.misses += 1
        recorder = _RecordingConfigs(configs)
        context.configs = recorder
        error: Optional[ValueError] = None
        try:
            optimization.validate(config, context)
        except ValueError as e:
            error = e
        finally:
            context.configs = configs
        reads = None if recorder.everything else tuple(
            (k, _value_key(configs.get(k, _MISSING))) for k in sorted(recorder.read, key=str))
        self._entries.setdefault(key, []).append((reads, error))
        if error is not None:
            raise error


def _infer_world_size(dimensions: Mapping[str, Sequence[Choice]]) -> int:
    sizes = set()
    for choices in dimensions.values():
        for c in choices:
            for item in choice_items(c):
                if item.name == "parallel_mode" and isinstance(item.config, (tuple, list)) and item.config:
                    sizes.add(math.prod(int(s) for _, s in item.config[0]))
    if len(sizes) > 1:
        raise ValueError(f"parallel_mode choices cover different world sizes {sorted(sizes)}; pass world_size=")
    return sizes.pop() if sizes else 1


def _strategy_key(strategy: Strategy) -> str:
    """A key equal for equal strategies: the JSON form, or the repr of configs JSON cannot hold."""
    try:
        return strategy.to_json()
    except ValueError:
        return repr(strategy)



def _memory_saving(choice: Choice) -> Optional[Dict[str, float]]:
    """A choice's memory saving per kind, summed over its optimizations (`Optimization.memory_saving`),
    or None when one of them does not declare its effect."""
    total: Dict[str, float] = {}
    for item in choice_items(choice):
        opt = get_optimization(item.name)
        saving = opt.memory_saving(opt.parse_config(item.config))
        if saving is None:
            return None
        for kind, score in saving.items():
            total[kind] = total.get(kind, 0.0) + float(score)
    return total


def memory_saving_ranks(space: "SearchSpace") -> List[Optional[List[Tuple[float, ...]]]]:
    """Per dimension (in order), each choice's memory-saving scores (one per kind of saving the
    dimension's choices declare, in a fixed order), or None for a dimension with a choice of unknown
    effect. A candidate whose every ordered choice scores no higher than another's in every kind,
    and whose unordered choices are equal, needs at least as much memory."""
    out: List[Optional[List[Tuple[float, ...]]]] = []
    for choices in space.dimensions.values():
        savings = [_memory_saving(c) for c in choices]
        if any(s is None for s in savings):
            out.append(None)
            continue
        kinds = sorted({kind for s in savings if s is not None for kind in s})
        out.append([tuple(s.get(kind, 0.0) for kind in kinds) for s in savings if s is not None])
    return out
