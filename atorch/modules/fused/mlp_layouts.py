"""Which MLP modules `FusedMLP` can stand in for, and under which child names.

Gated MLPs are recognised by their forward's bytecode, as `is_llama_style_rms_norm` does for
norms: every copy of Llama's `down(act(gate(x)) * up(x))` (Mistral, Qwen2, Gemma, ...) matches,
whatever its class name. The plain `down(act(up(x)))` MLPs are few and name their children
differently, so they are listed by class (transformers' own classes only, so a user subclass
with another forward is never taken for one).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

from torch import nn

from atorch.modules.fused.mlp import MLPLayout, activation_name
from atorch.modules.fused.rms_norm import _code_signature

_PLAIN_LAYOUTS = {
    "GPT2MLP": MLPLayout(up="c_fc", act="act", down="c_proj", dropout="dropout"),
    "GPTJMLP": MLPLayout(up="fc_in", act="act", down="fc_out", dropout="dropout"),
    "GPTNeoXMLP": MLPLayout(up="dense_h_to_4h", act="act", down="dense_4h_to_h"),
    "FalconMLP": MLPLayout(up="dense_h_to_4h", act="act", down="dense_4h_to_h"),
}
_GATED_LAYOUT = MLPLayout(up="up_proj", act="act_fn", down="down_proj", gate="gate_proj")


@functools.lru_cache(maxsize=None)
def _llama_mlp_signature() -> Tuple:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return _code_signature(LlamaMLP.forward.__code__)


@functools.lru_cache(maxsize=None)
def _is_gated_llama_mlp_class(cls: type) -> bool:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and _code_signature(code) == _llama_mlp_signature()


def looks_like_mlp(module: nn.Module) -> bool:
    """A module that is an MLP by name: the candidates reported as replaced or not."""
    return type(module).__name__.endswith("MLP")


def mlp_layout(module: nn.Module) -> Union[Tuple[MLPLayout, str], str]:
    """`(layout, activation)` when `FusedMLP` can replace `module`, else the reason it cannot."""
    cls = type(module)
    layout: Optional[MLPLayout] = None
    if cls.__name__ in _PLAIN_LAYOUTS and cls.__module__.startswith("transformers."):
        layout = _PLAIN_LAYOUTS[cls.__name__]
    elif all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
            and _is_gated_llama_mlp_class(cls):  # type: ignore[arg-type]  # classes are hashable (mypy checks instances)
        layout = _GATED_LAYOUT
    if layout is None:
        return "its forward is not a known MLP layout"
    act = getattr(module, layout.act, None)
    activation = activation_name(act) if isinstance(act, nn.Module) else None
    if activation is None:
        return f"activation {type(act).__name__} has no fused equivalent"
    if layout.gate is None and getattr(getattr(module, layout.up), "bias", None) is None:
        return "the up projection has no bias: nothing to fuse with the activation"
    return layout, activation
