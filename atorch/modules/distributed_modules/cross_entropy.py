"""Moved to `atorch.tensor_parallel.cross_entropy`; this old import path is the same module object.

The star import lets type checkers see the names; the alias in sys.modules makes
`import atorch.modules.distributed_modules.cross_entropy` return the moved module itself (its
module-level state included).
"""

import sys

from atorch.tensor_parallel import cross_entropy as _moved
from atorch.tensor_parallel.cross_entropy import *  # noqa: F401,F403

sys.modules[__name__] = _moved
