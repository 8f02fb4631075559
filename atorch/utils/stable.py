"""Texts and hashes of values that are the same in every process.

Ranks compare what they were given (`auto_accelerate`'s sampler settings, a model's layout) and the
search cache matches an optimizer factory across runs: Python's `repr` of many objects holds a memory
address and its `hash()` of strings is salted per process, so neither can be compared between
processes. Written here once for every such comparison.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def stable_repr(value: Any, depth: int = 0) -> str:
    """repr(value) that is the same in every process: sets sorted, dicts by sorted key, functions and
    classes by qualified name, and object addresses (a default repr's "at 0x7f...") left out."""
    if depth > 6:
        return type(value).__qualname__
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(stable_repr(v, depth + 1) for v in value)})"
    if isinstance(value, dict):
        items = sorted((stable_repr(k, depth + 1), stable_repr(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v, depth + 1) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def stable_int63(text: str) -> int:
    """A non-negative 63-bit integer hash of `text` (sha256), the same in every process and on every machine."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
