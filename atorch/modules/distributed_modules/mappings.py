"""Moved to `atorch.tensor_parallel.mappings`; this old import path is the same module object.

The star import lets type checkers see the names; the alias in sys.modules makes
`import atorch.modules.distributed_modules.mappings` return the moved module itself (its module-level state included).
"""

import sys

from atorch.tensor_parallel import mappings as _moved
from atorch.tensor_parallel.mappings import *  # noqa: F401,F403

sys.modules[__name__] = _moved
