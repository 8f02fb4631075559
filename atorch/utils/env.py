"""The one reader of environment variables: typed values, or a ValueError naming the variable.

Entry points (`auto_accelerate`'s search and dry-run settings, the launcher, the example
scripts) read the environment through these; optimizations never do.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional, TypeVar, Union, overload

Number = TypeVar("Number", int, float)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value.strip() == "" else value.strip()


@overload
def env_int(name: str, default: int, environ: Optional[Mapping[str, str]] = None,
            minimum: Optional[int] = None) -> int: ...


@overload
def env_int(name: str, default: None, environ: Optional[Mapping[str, str]] = None,
            minimum: Optional[int] = None) -> Optional[int]: ...


def env_int(name: str, default: Optional[int], environ: Optional[Mapping[str, str]] = None,
            minimum: Optional[int] = None) -> Optional[int]:
    """An integer (also written as 1e9 or 2.0); `default` when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        number = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
    if not number.is_integer():
        raise ValueError(f"environment variable {name}={raw!r} must be an integer")
    value = int(number)
    if minimum is not None and value < minimum:
        raise ValueError(f"environment variable {name}={value!r} must be >= {minimum}")
    return value


@overload
def env_float(name: str, default: float, environ: Optional[Mapping[str, str]] = None,
              minimum: Optional[float] = None) -> float: ...


@overload
def env_float(name: str, default: None, environ: Optional[Mapping[str, str]] = None,
              minimum: Optional[float] = None) -> Optional[float]: ...


def env_float(name: str, default: Optional[float], environ: Optional[Mapping[str, str]] = None,
              minimum: Optional[float] = None) -> Optional[float]:
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number") from None
    if not math.isfinite(value):   # nan passes every `<` check below, and inf overflows timedelta
        raise ValueError(f"environment variable {name}={raw!r} must be a finite number")
    return _at_least(name, value, minimum)


@overload
def env_str(name: str, default: str, environ: Optional[Mapping[str, str]] = None) -> str: ...


@overload
def env_str(name: str, default: None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]: ...


def env_str(name: str, default: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    raw = _raw(name, environ)
    return default if raw is None else raw


def env_bool(name: str, default: bool, environ: Optional[Mapping[str, str]] = None) -> bool:
    raw = _raw(name, environ)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r} must be one of {list(_TRUE + _FALSE)}")


def _at_least(name: str, value: Number, minimum: Optional[Union[int, float]]) -> Number:
    if minimum is not None and value < minimum:
        raise ValueError(f"environment variable {name}={value!r} must be >= {minimum}")
    return value


def check_output_location(name: str, path: str, *, directory: bool) -> None:
    """`path` (from environment variable `name`) can be created or written: it is not an existing entry of
    the other kind, and the deepest part of it that exists is a writable directory. ValueError otherwise,
    raised where the variable is read rather than when the first file is written."""
    kind = "a directory" if directory else "a file"
    if os.path.exists(path) and os.path.isdir(path) != directory:
        raise ValueError(f"environment variable {name}={path!r} is {'a file' if directory else 'a directory'}; "
                         f"it must name {kind}" + ("" if directory else ", e.g. "
                                                   f"{os.path.join(path, 'search_cache.json')!r}"))
    existing = os.path.abspath(path if directory and os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"environment variable {name}={path!r}: {existing!r} is a file, so {kind} cannot be "
                         "created under it")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"environment variable {name}={path!r}: the directory {existing!r} is not writable")
