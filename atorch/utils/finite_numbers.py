"""Reading numbers that came from outside without trusting them: JSON files atorch wrote (caches,
reports) and what a user's evaluator returns.

A JSON number comes back as an int or a float; `true` comes back as a bool, which Python also
counts as an int, and a hand-edited or truncated file can hold NaN, Infinity or a string. An
evaluator may return a NumPy scalar. A value is accepted only when it is a finite real number
(NumPy's included, a bool not), so a corrupt entry is refused rather than used.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional


def finite_float(value: Any) -> Optional[float]:
    """`value` as a float when it is a finite real number (NumPy's included; a bool is not one), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def is_finite_number(value: Any) -> bool:
    """A finite real number (int, float or a NumPy scalar); a bool is not one."""
    return finite_float(value) is not None
