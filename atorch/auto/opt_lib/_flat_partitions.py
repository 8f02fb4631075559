"""Which optimizers survive DeepSpeed's flat partitions unchanged.

DeepSpeed ZeRO (stages 1-3, and its bf16/fp16 optimizers) flattens the trainable parameters into
1-D partitions and steps the user's optimizer on those. An update that treats each element on its
own (Adam, SGD, ...) is the same as on the original parameters; one that depends on a parameter's
shape or on whole-tensor statistics (Adafactor's factored second moment, Muon's matrix
orthogonalization, LAMB/LARS trust ratios, L-BFGS's closure) silently becomes another optimizer.
DeepSpeed itself only warns (and atorch sets `zero_allow_untested_optimizer`, because the client
optimizer is the point), so the distinction is made here: known element-wise optimizers pass, known
shape-dependent ones are refused, anything else is warned about once per class.
"""

from __future__ import annotations

import logging
from typing import FrozenSet, Set, Tuple, Type

import torch

logger = logging.getLogger(__name__)

# torch's optimizers whose update of an element reads only that element's state (exact classes:
# a subclass may override step()).
ELEMENTWISE_TORCH: FrozenSet[Type[torch.optim.Optimizer]] = frozenset(
    getattr(torch.optim, name) for name in ("ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam",
                                            "RAdam", "RMSprop", "Rprop", "SGD") if hasattr(torch.optim, name))

# (module prefix, class name) of optimizers known to depend on parameter shapes or whole tensors;
# matched on the class and its bases, so neither torch nor transformers is imported for it.
SHAPE_DEPENDENT: Tuple[Tuple[str, str, str], ...] = (
    ("torch.optim", "Adafactor", "factors its second moment over a matrix's rows and columns"),
    ("torch.optim", "Muon", "orthogonalizes each 2-D parameter's update"),
    ("torch.optim", "LBFGS", "needs a closure and keeps whole-model curvature pairs"),
    ("transformers", "Adafactor", "factors its second moment over a matrix's rows and columns"),
)

_warned: Set[Type[object]] = set()


def _deepspeed_supports(optim: torch.optim.Optimizer) -> bool:
    """DeepSpeed's own list of optimizers tested with ZeRO (its FusedAdam, CPU Adam, ... and torch's Adam(W)).

    Read from the list, not `is_zero_supported_optimizer`, which needs DeepSpeed's process group."""
    try:
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    except ImportError:        # a DeepSpeed without the list: rely on atorch's own
        return False
    return type(optim) in ZERO_SUPPORTED_OPTIMIZERS


def shape_dependence(optim: torch.optim.Optimizer) -> str:
    """Why `optim` would step differently on flat partitions; "" when it is known not to."""
    for klass in type(optim).__mro__:
        for module, name, why in SHAPE_DEPENDENT:
            if klass.__name__ == name and klass.__module__.startswith(module):
                return f"{name} {why}"
    return ""


def check_flat_partition_optimizer(who: str, optim: torch.optim.Optimizer) -> None:
    """Refuse a shape-dependent optimizer under DeepSpeed's flat partitions; warn about an unknown one.

    Called with the user's optimizer before `deepspeed.initialize` (the same class on every rank,
    so every rank raises before any collective).
    """
    why = shape_dependence(optim)
    if why:
        raise ValueError(
            f"{who} with DeepSpeed (use_ds_zero=True or a DeepSpeed engine) and {type(optim).__name__}: DeepSpeed "
            f"steps the optimizer on flat 1-D partitions of the parameters, and {why}, so training would silently "
            "differ from the same optimizer on the model. Use the torch implementation (use_ds_zero=False: torch "
            "ZeRO and FSDP2 keep each parameter's shape) or an element-wise optimizer such as AdamW")
    kind = type(optim)
    if kind in ELEMENTWISE_TORCH or _deepspeed_supports(optim) or kind in _warned:
        return
    _warned.add(kind)
    logger.warning("%s: DeepSpeed steps %s.%s on flat 1-D partitions of the parameters, not on their own shapes. "
                   "An element-wise update (Adam-like) is unchanged; one that uses a parameter's shape or "
                   "whole-tensor norms (factored moments, trust ratios, matrix roots) would train differently "
                   "from plain training: use use_ds_zero=False for such an optimizer", who, kind.__module__,
                   kind.__qualname__)
