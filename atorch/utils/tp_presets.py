"""Moved to `atorch.tensor_parallel.presets`; this old import path is the same module object."""

import sys

from atorch.tensor_parallel import presets as _moved

sys.modules[__name__] = _moved
