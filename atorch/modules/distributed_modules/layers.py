"""Moved to `atorch.tensor_parallel.layers`; this old import path is the same module object."""

import sys

from atorch.tensor_parallel import layers as _moved

sys.modules[__name__] = _moved
