"""Fused MLPs: the elementwise tail of each projection compiled into one kernel.

An MLP runs `down(act(up(x)))` (or, gated, `down(act(gate(x)) * up(x))`); between the two
matrix multiplies eager PyTorch makes one pass over the `(tokens, intermediate)` activation
per elementwise op (bias add, activation, gate multiply, dropout). The fused forms below keep
the matrix multiplies as they are and hand the elementwise tail to `torch.compile`, which
emits one loop for it:

- `bias + activation` after the up projection (the bias is taken out of the matmul);
- `activation(gate) * up` in gated (Llama-style) MLPs;
- `bias + dropout` after the down projection when the MLP ends in a dropout (GPT-2).

Why `torch.compile` and not a TorchScript function: measured on this project's CPU
(benchmarks/RESULTS.md, "Kernel fusion"), the scripted versions were never faster than the
compiled ones except for bias + dropout, and TorchScript is deprecated. Compilation happens on
the first call (seconds), with dynamic shapes so new sequence lengths do not recompile.

Child modules keep their names (`c_fc`, `c_proj`, `gate_proj`, ...) and are the same objects,
so state dicts, optimizers and weight tying are unaffected.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}

# transformers activation classes computing exactly one of ACTIVATIONS (by class name, so that
# transformers need not be imported to recognise plain torch modules).
_HF_ACTIVATIONS = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                   "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "SiLUActivation": "silu"}


def activation_name(module: nn.Module) -> Optional[str]:
    """The ACTIVATIONS key `module` computes, or None when it is not one we can fuse."""
    if type(module) is nn.GELU:
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.SiLU:
        return "silu"
    name = _HF_ACTIVATIONS.get(type(module).__name__)
    if name == "gelu" and getattr(module, "act", F.gelu) is not F.gelu:  # use_gelu_python=True
        return None
    if name is not None and type(module).__module__.startswith("transformers."):
        return name
    return None


def _compile(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


@functools.lru_cache(maxsize=None)
def fused_bias_activation(activation: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`activation(x + bias)` as one compiled kernel."""
    act = ACTIVATIONS[activation]
    return _compile(lambda x, bias: act(x + bias))


@functools.lru_cache(maxsize=None)
def fused_activation_mul(activation: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`activation(gate) * up` as one compiled kernel."""
    act = ACTIVATIONS[activation]
    return _compile(lambda gate, up: act(gate) * up)


@functools.lru_cache(maxsize=None)
def fused_bias_dropout() -> Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]:
    """`dropout(x + bias, p, training)` as one compiled kernel."""
    return _compile(lambda x, bias, p, training: F.dropout(x + bias, p, training))


def _matmul_without_bias(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`proj(x) - proj.bias` for nn.Linear (weight (out, in)) and transformers' Conv1D (weight (in, out))."""
    if isinstance(proj, nn.Linear):
        return F.linear(x, proj.weight)
    return torch.matmul(x, cast(torch.Tensor, proj.weight))  # Conv1D


@dataclass(frozen=True)
class MLPLayout:
    """Names of an MLP's children; `gate` set means the gated form `down(act(gate(x)) * up(x))`."""

    up: str
    act: str
    down: str
    gate: Optional[str] = None
    dropout: Optional[str] = None


class FusedMLP(nn.Module):
    """The MLP `source` with its elementwise tails compiled; same children under the same names."""

    def __init__(self, source: nn.Module, layout: MLPLayout, activation: str) -> None:
        super().__init__()
        self.layout = layout
        self.activation = activation
        self.source_class = type(source).__name__
        wanted = {layout.up, layout.act, layout.down, layout.gate, layout.dropout} - {None}
        for name, child in source.named_children():  # in the source's order: state-dict keys keep theirs
            if name in wanted:
                setattr(self, name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        up, down = getattr(self, layout.up), getattr(self, layout.down)
        if layout.gate is not None:
            hidden = fused_activation_mul(self.activation)(getattr(self, layout.gate)(x), up(x))
        elif up.bias is not None:
            hidden = fused_bias_activation(self.activation)(_matmul_without_bias(up, x), up.bias)
        else:
            hidden = ACTIVATIONS[self.activation](up(x))
        dropout = getattr(self, layout.dropout) if layout.dropout is not None else None
        if dropout is not None and down.bias is not None and dropout.p > 0 and self.training:
            return fused_bias_dropout()(_matmul_without_bias(down, hidden), down.bias, dropout.p, True)
        out = down(hidden)
        return dropout(out) if dropout is not None else out

    def extra_repr(self) -> str:
        return f"fused from {self.source_class}, activation={self.activation}"
