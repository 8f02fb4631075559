"""`half`: cast the whole model (parameters and floating buffers) to bf16 or fp16.

Unlike `amp_native` there is no fp32 copy of the weights: memory halves, and so does the
precision of the updates. fp32 tensors given to the model's forward are cast to the dtype too.
Combined with `amp_native` of the same dtype, autocast would change nothing and is skipped
(logged); a different dtype is a contradiction and raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._precision import DescribedByDtype, cast_float_inputs, dtype_name, parse_half_dtype
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.utils.module_utils import cast_floating


@dataclass(frozen=True)
class HalfConfig:
    dtype: Any = torch.bfloat16
    """torch.bfloat16 (default) or torch.float16, or their names ("bf16", "fp16")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_half_dtype(self.dtype, "half"))


@register
class HalfOptimization(DescribedByDtype, Optimization):
    name = "half"
    order = Order.HALF
    Config = HalfConfig
    search_dimension = None   # no fp32 master weights: it changes the training, not only its speed

    @classmethod
    def cost_traits(cls, config: HalfConfig, context: CostContext) -> Dict[str, Any]:
        # Parameters, gradients and optimizer state all in the half dtype; no fp32 copy anywhere.
        return {"compute_dtype_bytes": 2, "param_dtype_bytes": 2}

    @classmethod
    def parse_config(cls, raw: Any) -> HalfConfig:
        # Also accept a bare dtype: ("half", torch.bfloat16).
        if isinstance(raw, (torch.dtype, str)):
            return HalfConfig(raw)
        return super().parse_config(raw)

    def validate(self, config: HalfConfig, context: ValidationContext) -> None:
        amp = context.configs.get("amp_native")
        if amp is None:
            return
        # The same dtype is harmless: amp_native then skips autocast and logs it when applied.
        if amp.dtype != config.dtype:
            raise ValueError(f"optimizations 'half' (dtype={dtype_name(config.dtype)}) and 'amp_native' "
                             f"(dtype={dtype_name(amp.dtype)}) cannot be combined: the model would be stored in one "
                             "half dtype and computed in the other; use the same dtype for both, or only one")

    def apply(self, ctx: ModelContext, config: HalfConfig) -> None:
        # Floating parameters and buffers only: token ids stay integer, a complex rope table stays complex.
        cast_floating(ctx.model, config.dtype)
        cast_float_inputs(ctx.model, config.dtype)     # float inputs (features, pixels) meet half weights
        ctx.half_dtype = config.dtype
