"""Moved to `atorch.tensor_parallel.cross_entropy`; this old import path is the same module object."""

import sys

from atorch.tensor_parallel import cross_entropy as _moved

sys.modules[__name__] = _moved
