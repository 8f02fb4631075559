"""Old import path of `atorch.tensor_parallel.randomizer`, with ATorch's randomizer API.

Every name of `atorch.tensor_parallel.randomizer` is the same object here (imported, or read
through the module `__getattr__`), except the three functions ATorch scripts call at this path,
which take ATorch's arguments (`atorch.utils.tp_compat`):
`init_randomizer(base_seed=1234)`, `get_randomizer(*same_groups)` (none: the process
randomizer, whose `fork()` is a stream different on every rank) and `get_MDPRInstance()`.
"""

from typing import Any

from atorch.tensor_parallel import randomizer as _moved
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, fork_module_rng  # noqa: F401
from atorch.utils.tp_compat import get_MDPRInstance, get_randomizer, init_randomizer  # noqa: F401


__all__ = ["MultiDimParallelRandomizer", "fork_module_rng", "get_MDPRInstance", "get_randomizer", "init_randomizer"]


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
