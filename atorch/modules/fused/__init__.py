"""Drop-in fused replacements for common transformer modules.

Each replacement keeps the parameter names and the numerics (within rounding) of the
module it replaces, so state dicts load unchanged; `module_replace` (or `fuse(model, ...)`)
swaps them in.
"""

from typing import Any

from atorch.modules.fused.mlp import FusedMLP
from atorch.modules.fused.rms_norm import FusedRMSNorm, is_llama_style_rms_norm

__all__ = ["FusedMLP", "FusedRMSNorm", "fuse", "is_llama_style_rms_norm"]


def __getattr__(name: str) -> Any:
    # `fuse` lives with module_replace, which imports this package: resolved on first use.
    if name == "fuse":
        from atorch.auto.opt_lib.module_replace import fuse

        return fuse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
