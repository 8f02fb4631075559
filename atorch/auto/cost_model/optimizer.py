"""What the user's optimizer keeps per trainable parameter (`OptimizerStates`), read off its class and arguments.

The memory formulas were first written for Adam (two moments per parameter). SGD without
momentum keeps nothing, with momentum one buffer; AdamW with `amsgrad` three. An optimizer is
never instantiated to find out (that would allocate its state): the class (through a
`functools.partial` too) and its arguments decide, matched by class name along the MRO so that a
subclass of `torch.optim.AdamW` counts as AdamW. An unknown optimizer is counted as Adam, said once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

logger = logging.getLogger("atorch.auto.cost_model")


@dataclass(frozen=True)
class OptimizerStates:
    """Per trainable parameter: how many state tensors of its size the optimizer keeps (in the
    parameter's dtype, or fp32 master partitions' under DeepSpeed), and whether its step allocates
    temporaries the size of the parameters (Adam's update; plain SGD without weight decay updates in place)."""

    name: str = "Adam"
    state_copies: float = 2.0
    step_temporaries: bool = True

    @property
    def state_bytes_per_fp32_param(self) -> float:
        return 4.0 * self.state_copies


ADAM = OptimizerStates()

# Class name -> (state copies, step temporaries) as a function of the optimizer's arguments.
_Rule = Callable[[Mapping[str, Any]], Tuple[float, bool]]


def _nonzero(args: Mapping[str, Any], name: str) -> bool:
    value = args.get(name, 0)
    try:
        return float(value) != 0.0
    except (TypeError, ValueError):
        return bool(value)


def _sgd(args: Mapping[str, Any]) -> Tuple[float, bool]:
    return (1.0 if _nonzero(args, "momentum") else 0.0), _nonzero(args, "weight_decay")


def _adam(args: Mapping[str, Any]) -> Tuple[float, bool]:
    return (3.0 if args.get("amsgrad") else 2.0), True


def _rmsprop(args: Mapping[str, Any]) -> Tuple[float, bool]:
    return 1.0 + _nonzero(args, "momentum") + bool(args.get("centered")), True


_RULES: Dict[str, _Rule] = {
    "SGD": _sgd,
    "Adam": _adam, "AdamW": _adam, "FusedAdam": _adam, "DeepSpeedCPUAdam": _adam,
    "Adamax": lambda args: (2.0, True), "NAdam": lambda args: (2.0, True), "RAdam": lambda args: (2.0, True),
    "SparseAdam": lambda args: (2.0, True), "Adadelta": lambda args: (2.0, True), "Rprop": lambda args: (2.0, True),
    "FusedLamb": lambda args: (2.0, True), "Lamb": lambda args: (2.0, True),
    "Adagrad": lambda args: (1.0, True), "ASGD": lambda args: (1.0, True), "Lion": lambda args: (1.0, True),
    "RMSprop": _rmsprop,
    # Adafactor keeps a row and a column statistic per matrix: negligible next to the parameters.
    "Adafactor": lambda args: (0.0, True),
}

_SAID: Set[str] = set()


def optimizer_states(optim_func: Optional[Callable[..., Any]],
                     optim_args: Optional[Mapping[str, Any]] = None) -> OptimizerStates:
    """`OptimizerStates` of `optim_func(params, **optim_args)`; Adam's when `optim_func` is None.

    `optim_func` may be an optimizer class, a `functools.partial` of one (its keywords count as
    arguments), or any factory: a factory that is not a class is counted as Adam, said once.
    """
    if optim_func is None:
        return ADAM
    args: Dict[str, Any] = {}
    target: Any = optim_func
    while isinstance(target, functools.partial):
        args = {**target.keywords, **args}
        target = target.func
    args.update(optim_args or {})
    for klass in getattr(target, "__mro__", ()) if isinstance(target, type) else ():
        rule = _RULES.get(klass.__name__)
        if rule is not None:
            copies, temporaries = rule(args)
            return OptimizerStates(target.__name__, copies, temporaries)
    name = getattr(target, "__name__", type(target).__name__)
    if name not in _SAID:
        _SAID.add(name)
        logger.info("cost model: optimizer %s is not one the memory model knows; its state is counted as Adam's "
                    "(two fp32 moments per trainable parameter)", name)
    return OptimizerStates(name)
