"""Moved to `atorch.tensor_parallel.randomizer`; this old import path is the same module object."""

import sys

from atorch.tensor_parallel import randomizer as _moved

sys.modules[__name__] = _moved
