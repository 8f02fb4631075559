"""RMSNorm through `torch.nn.functional.rms_norm`, a drop-in for the Llama-family RMSNorm.

Hugging Face's Llama-style RMSNorm runs five separate elementwise ops (upcast, square-mean,
rsqrt, scale, weight); `F.rms_norm` is one op that dispatches to a fused kernel where the
backend has one. Parameter name (`weight`) and epsilon attribute (`variance_epsilon`) are
kept, so state dicts and code that reads them are unaffected.
"""

from __future__ import annotations

import functools
from types import CodeType
from typing import Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn


class FusedRMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x**2, -1) + eps)` over the last dimension, computed by `F.rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_module(cls, module: nn.Module) -> "FusedRMSNorm":
        """A FusedRMSNorm sharing `module.weight` (the same Parameter object, so optimizers and tying still see it)."""
        # Built on meta so no memory is allocated for a weight that is replaced right away.
        # A LlamaRMSNorm-like module (checked by is_llama_style_rms_norm): a 1-D Parameter and a number.
        weight = cast(nn.Parameter, module.weight)
        fused = cls(weight.shape[0], float(cast(float, module.variance_epsilon)), device=torch.device("meta"))
        fused.weight = weight
        return fused

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (self.weight.shape[-1],)
        if hidden_states.dtype == self.weight.dtype:
            return F.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)
        # Mixed dtypes (e.g. bf16 activations under autocast with fp32 weights): the Hugging Face
        # module multiplies the normalized input (in the input dtype) by the weight, so the result
        # takes the promoted dtype; keep that contract rather than the fused op's dtype rules.
        return self.weight * F.rms_norm(hidden_states, shape, None, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _code_signature(code: CodeType) -> Tuple:
    return (code.co_code, code.co_names, code.co_consts, code.co_varnames)


@functools.lru_cache(maxsize=None)
def _reference_forward_signature() -> Tuple:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _code_signature(LlamaRMSNorm.forward.__code__)


@functools.lru_cache(maxsize=None)
def _class_has_llama_rms_norm_forward(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and _code_signature(code) == _reference_forward_signature()


def is_llama_style_rms_norm(module: nn.Module) -> bool:
    """True when `module` computes exactly what Hugging Face's `LlamaRMSNorm` computes.

    More than a hundred Hugging Face model families copy LlamaRMSNorm under their own class
    name (MistralRMSNorm, Qwen2RMSNorm, ...), while look-alikes such as Gemma's compute
    `(1 + weight) * x`. Comparing the forward's bytecode with LlamaRMSNorm's recognises every
    copy and nothing else, without a list of class names to keep up to date; a forward
    replaced at run time (e.g. by a hub kernel) simply does not match and is left alone.
    """
    if type(module) is FusedRMSNorm:
        return False
    weight = getattr(module, "weight", None)
    # The cheap structural checks first: the bytecode check imports transformers.
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), (int, float))
            # A class is hashable; mypy checks nn.Module's instance __hash__ instead.
            and _class_has_llama_rms_norm_forward(type(module)))  # type: ignore[arg-type]
