"""Old import path of `atorch.tensor_parallel.layers`, plus ATorch's names that lived here.

Every name of `atorch.tensor_parallel.layers` is the same object here (the star import for
type checkers, the module `__getattr__` for the rest, private names included). Added from
ATorch's module of this path: `ParallelEmbedding` (embedding dimension split, output
all-gathered) and `_initialize_affine_weight` (this rank's slice of a master weight), both
from `atorch.utils.tp_compat`.
"""

from typing import Any

from atorch.tensor_parallel import layers as _moved
from atorch.tensor_parallel.layers import *  # noqa: F401,F403
from atorch.utils.tp_compat import ParallelEmbedding, _initialize_affine_weight  # noqa: F401


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
