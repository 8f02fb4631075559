"""Moved to `atorch.tensor_parallel.mappings`; this old import path is the same module object."""

import sys

from atorch.tensor_parallel import mappings as _moved

sys.modules[__name__] = _moved
