"""Moved to `atorch.tensor_parallel.layers`; this old import path is the same module object.

The star import lets type checkers see the names; the alias in sys.modules makes
`import atorch.modules.distributed_modules.layers` return the moved module itself (its module-level state included).
"""

import sys

from atorch.tensor_parallel import layers as _moved
from atorch.tensor_parallel.layers import *  # noqa: F401,F403

sys.modules[__name__] = _moved
