"""Precision helpers shared by `amp_native` and `half`: dtype parsing and autocast on a model's forward.

Not an optimization (it registers nothing); the registry imports it like every module here.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Dict, Tuple

import torch
from torch import nn

# JSON strategy files and hand-written strategies may name a dtype instead of passing it.
_DTYPE_NAMES: Dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
HALF_DTYPES = (torch.bfloat16, torch.float16)

# Marks (and keeps) the forward that ran before autocast was added.
_FORWARD_BEFORE_AUTOCAST = "_atorch_forward_before_autocast"


def parse_half_dtype(value: Any, where: str) -> torch.dtype:
    """torch.bfloat16 / torch.float16, or one of their names; anything else raises ValueError."""
    if isinstance(value, str):
        key = value.lower().replace("torch.", "")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    elif value in HALF_DTYPES:
        return value
    raise ValueError(f"{where}: dtype={value!r} is not supported; use torch.bfloat16 or torch.float16 "
                     f"(or one of the names {sorted(_DTYPE_NAMES)})")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def add_autocast_to_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run `module`'s forward under `torch.autocast(device_type, dtype)`.

    The forward is replaced on the instance, not by wrapping the module in another one, so
    parameter names, state-dict keys and hooks stay exactly as the user's model had them.
    Whatever forward the instance had (possibly another instance-level wrapper) is kept and
    called inside the autocast region.
    """
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)

    setattr(module, _FORWARD_BEFORE_AUTOCAST, inner)
    module.forward = forward


class DescribedByDtype:
    """Mixin for optimizations whose config is a dtype: shown in strategy names and plans, and saved."""

    name: ClassVar[str]
    always_shown: ClassVar[Tuple[str, ...]] = ("dtype",)

    @classmethod
    def describe_step(cls, config: Any) -> str:
        return f"{cls.name}({dtype_name(config.dtype)})"

    @classmethod
    def describe_config(cls, config: Any) -> str:
        return dtype_name(config.dtype)


def has_autocast_forward(module: nn.Module) -> bool:
    return _FORWARD_BEFORE_AUTOCAST in vars(module)


def cast_float_inputs(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make `module`'s forward receive its fp32 tensor inputs (positional and keyword, nested in
    lists, tuples and dicts) as `dtype`, the dtype its weights are held in.

    A model held in half precision (`half`, DeepSpeed's bf16/fp16 engines) fed float inputs
    (pixels, features, inputs_embeds) raised "mat1 and mat2 must have the same dtype"; token ids,
    the usual LLM input, are integers and were never affected. FSDP2's mixed precision casts
    forward inputs the same way (`cast_forward_inputs`); DeepSpeed's own `fp16.auto_cast` covers
    fp16 only. Other dtypes (float64, integers, bool) pass unchanged.
    """
    module.register_forward_pre_hook(_CastFloatInputs(dtype), with_kwargs=True)


class _CastFloatInputs:
    """The pre-hook of `cast_float_inputs`: a class, not a closure, so the model still pickles and deep-copies."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        return _cast_fp32(args, self.dtype), _cast_fp32(kwargs, self.dtype)


def _cast_fp32(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float32 else value
    if isinstance(value, dict):
        return {k: _cast_fp32(v, dtype) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):      # a namedtuple keeps its type
        return type(value)(*(_cast_fp32(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_fp32(v, dtype) for v in value)
    return value
