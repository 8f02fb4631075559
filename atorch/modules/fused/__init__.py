"""Drop-in fused replacements for common transformer modules.

Each replacement keeps the parameter names and the numerics (within rounding) of the
module it replaces, so state dicts load unchanged; `module_replace` (or
`atorch.auto.opt_lib.module_replace.fuse(model, ...)`) swaps them in.
"""

from atorch.modules.fused.mlp import FusedMLP
from atorch.modules.fused.rms_norm import FusedRMSNorm, is_llama_style_rms_norm

__all__ = ["FusedMLP", "FusedRMSNorm", "is_llama_style_rms_norm"]
