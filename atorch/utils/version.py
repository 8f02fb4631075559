"""`torch_version()`: the installed torch's (major, minor, patch), at the path ATorch scripts import it from.

Scripts written for ATorch gate features with `torch_version() >= (2, 0, 0)`; local suffixes
(`+cpu`, `+cu121`) and pre-release tags (`a0`, `.dev20240101`) are dropped from the triple.
"""

from __future__ import annotations

import re
from typing import Tuple

import torch

__all__ = ["torch_version"]


def torch_version(version: str = torch.__version__) -> Tuple[int, ...]:
    """(major, minor, patch) of `version` (default: the installed torch); () when it is not numbered so."""
    found = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(g) for g in found.groups()) if found else ()
