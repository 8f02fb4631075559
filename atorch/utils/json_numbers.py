"""Reading numbers back from JSON files atorch wrote (caches, reports) without trusting them.

A JSON number comes back as an int or a float; `true` comes back as a bool, which Python also
counts as an int, and a hand-edited or truncated file can hold NaN, Infinity or a string. Both
the search's results cache and the calibration cache accept a value only when it is a finite
number, so a corrupt entry is refused with a warning rather than used.
"""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    """A finite int or float; a bool is not one."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
