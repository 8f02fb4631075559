"""`SearchSpace`: named dimensions of choices, and the valid strategies they combine into.

Validity is decided by the optimization registry alone (`resolve_strategy`, the same rules
`auto_accelerate` enforces): a combination is a candidate exactly when `auto_accelerate`
would accept it. No compatibility table lives here.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atorch.auto.opt_lib.base import ValidationContext, registered_names
from atorch.auto.opt_lib.resolve import resolve_strategy
from atorch.auto.strategy import Strategy, StrategyItem

logger = logging.getLogger(__name__)

# A choice: None (nothing), a name, (name, config), or a list of those applied together
# (e.g. a tensor split: its parallel_mode *and* tensor_parallel).
Choice = Any

# Dimensions of the automatic space, in the order they are shown; each holds the optimization
# names tried there (the first entry of every dimension is "not chosen").
_DEFAULT_DIMENSIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("amp", ("amp_native",)),
    ("zero", ("zero1", "zero2", "fsdp")),
    ("module_replace", ("module_replace",)),
    ("checkpoint", ("checkpoint",)),
)


@dataclass(frozen=True)
class Candidate:
    """One valid strategy of the space and the choice it takes in every dimension."""

    strategy: Strategy               # in application order, as `resolve_strategy` returns it
    choices: Tuple[int, ...]         # index of the chosen option per dimension

    def label(self) -> str:
        return self.strategy.describe()


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
    return "+".join(Strategy([i]).describe() + ("" if i.config is None or i.name == "parallel_mode"
                                                else f"{i.config!r}") for i in items)


class SearchSpace:
    """Dimensions of choices; `candidates()` lists the valid strategies they combine into.

    `dimensions` maps a dimension name to its choices (see `Choice`). Validity is checked
    against a `ValidationContext` built from `world_size`, `model`, `model_config` and
    `device_type`; `world_size` defaults to the size of the parallel_mode choices, else 1.
    """

    def __init__(self, dimensions: Mapping[str, Sequence[Choice]], *, world_size: Optional[int] = None,
                 model: Any = None, model_config: Any = None, device_type: str = "cpu") -> None:
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
        self._candidates: Optional[List[Candidate]] = None
        self.rejected: Dict[str, str] = {}     # strategy description -> why resolve_strategy refused it

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
                                 device_type=self.device_type)

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
        options = [range(len(choices)) for choices in self.dimensions.values()]
        for combo in itertools.product(*options):
            items = [item for dim, i in zip(self.dimensions.values(), combo) for item in choice_items(dim[i])]
            raw = Strategy(items)
            try:
                resolved = resolve_strategy(raw, self.validation_context())
            except ValueError as e:
                self.rejected[raw.describe()] = str(e)
                continue
            strategy = Strategy(r.item for r in resolved)
            key = strategy.to_json() if _json_safe(strategy) else repr(strategy)
            if key in seen:
                continue
            seen.add(key)
            out.append(Candidate(strategy, tuple(combo)))
        logger.info("search space: %d combinations, %d valid candidates", self.size, len(out))
        return out

    # -- derived spaces -------------------------------------------------------------------------
    def restricted(self, excluded: Optional[Sequence[str]] = None,
                   included: Optional[Sequence[str]] = None) -> "SearchSpace":
        """A copy without the `excluded` optimizations and with every `included` one in all candidates.

        An included name no dimension offers becomes a dimension of its own with that single choice.
        """
        excluded_set = set(excluded or ())
        included_list = list(included or ())
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
                           device_type=self.device_type)

    @classmethod
    def default_for(cls, model: Any, world_size: int, device_type: str = "cpu",
                    model_config: Any = None) -> "SearchSpace":
        """The automatic space: amp, ZeRO/FSDP, module replacement, checkpointing, data/tensor splits.

        Only registered optimizations are offered; tensor splits are those dividing `world_size`
        (the tensor_parallel optimization's own validation drops splits that do not divide the
        model's heads or widths).
        """
        names = set(registered_names())
        dims: Dict[str, List[Choice]] = {}
        for dim, options in _DEFAULT_DIMENSIONS:
            offered = [o for o in options if o in names]
            if offered:
                dims[dim] = [None, *offered]
        splits: List[Choice] = [("parallel_mode", ([("data", world_size)], None))]
        if "tensor_parallel" in names:
            for t in range(2, world_size + 1):
                if world_size % t == 0:
                    splits.append([("parallel_mode", ([("tensor", t), ("data", world_size // t)], None)),
                                   "tensor_parallel"])
        dims["parallel"] = splits
        return cls(dims, world_size=world_size, model=model, model_config=model_config, device_type=device_type)


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


def _json_safe(strategy: Strategy) -> bool:
    try:
        strategy.to_json()
    except ValueError:
        return False
    return True



# How much per-device memory an optimization saves, as an order (higher saves more), for the
# search's out-of-memory learning (`SearchSpace.memory_saving_ranks`). Only the order within a
# dimension matters. An optimization missing here makes its dimension unordered (the search
# then assumes nothing about it), so a new optimization is never wrongly assumed to save memory.
# TODO(lead): move onto the optimization classes as metadata (e.g. `memory_saving_rank`).
_MEMORY_SAVING = {"zero1": 1.0, "zero2": 2.0, "fsdp": 3.0, "checkpoint": 1.0, "cpu_offload": 4.0,
                  "tensor_parallel": 0.0}


def _memory_saving_score(choice: Choice) -> Optional[float]:
    """Memory-saving score of one choice, or None when it contains an optimization of unknown effect."""
    score = 0.0
    for item in choice_items(choice):
        if item.name == "parallel_mode":
            sizes = item.config[0] if isinstance(item.config, (tuple, list)) and item.config else []
            # Model-parallel degrees (tensor, pipeline) split the model's state across devices.
            score += sum(math.log2(int(s)) for name, s in sizes if name != "data" and int(s) > 0)
        elif item.name in _MEMORY_SAVING:
            score += _MEMORY_SAVING[item.name]
        else:
            return None
    return score


def memory_saving_ranks(space: "SearchSpace") -> List[Optional[List[float]]]:
    """Per dimension (in order), each choice's memory-saving score, or None for a dimension whose
    choices' effect on memory is unknown. A candidate whose every ordered choice saves no more
    than another's, and whose unordered choices are equal, needs at least as much memory."""
    out: List[Optional[List[float]]] = []
    for choices in space.dimensions.values():
        scores = [_memory_saving_score(c) for c in choices]
        out.append(None if any(s is None for s in scores) else [float(s) for s in scores])
    return out
