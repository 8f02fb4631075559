"""Checks of a TPInfo against a model that the tensor-parallel plan needs before anything is sharded.

Pure (no process group, no weights touched). `check_tp_suffixes` belongs where the plan is resolved
(`atorch.utils.manual_tp_utils.resolve_tp_plan`), so an ambiguous suffix fails on every rank, naming
the modules, instead of a shape error at the first forward.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn


def check_tp_suffixes(model: nn.Module, tpinfo: Any) -> None:
    """Refuse TPInfo entries that are ambiguous on `model`, naming the modules.

    A suffix is ambiguous when the modules it matches have different shapes (GPT-2's bare
    'c_proj' matches attn.c_proj, 64 -> 64, and mlp.c_proj, 128 -> 64): one sharding cannot
    suit both. A module matched by entries of two roles is ambiguous too. Pure; call it where
    the tensor-parallel plan is resolved, before anything is sharded.
    """
    modules = dict(model.named_modules())
    roles: Dict[str, Tuple[str, str]] = {}
    for kind, suffix, _ in tpinfo.entries():
        matched = [n for n in modules if n and (n == suffix or n.endswith("." + suffix))]
        shapes: Dict[Tuple[Any, ...], List[str]] = {}
        for name in matched:
            shapes.setdefault(_module_shape(modules[name]), []).append(name)
        if len(shapes) > 1:
            shown = "; ".join(f"{cls} {shape}: {names[:3]}{' ...' if len(names) > 3 else ''}"
                              for (cls, shape), names in shapes.items())
            raise ValueError(f"TPInfo {kind} suffix {suffix!r} is ambiguous: it matches modules of different shapes "
                             f"({shown}); use a longer suffix that names one kind of module, e.g. "
                             f"{_longer_suffixes(suffix, shapes)}")
        for name in matched:
            if name in roles and roles[name] != (kind, suffix):
                other_kind, other_suffix = roles[name]
                raise ValueError(f"module {name!r} is matched by TPInfo {other_kind} {other_suffix!r} and by {kind} "
                                 f"{suffix!r}; give each module one role")
            roles[name] = (kind, suffix)


def _module_shape(module: nn.Module) -> Tuple[Any, ...]:
    weight = getattr(module, "weight", None)
    shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()
    return (type(module).__name__, shape)


def _longer_suffixes(suffix: str, shapes: Mapping[Any, Sequence[str]]) -> List[str]:
    out = []
    for names in shapes.values():
        parts = names[0].split(".")
        depth = len(suffix.split("."))
        out.append(".".join(parts[-depth - 1:]))
    return out
