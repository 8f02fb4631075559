"""Model-structure helpers shared by the optimizations (sharding, checkpointing, replacement).

`find_transformer_block_classes` answers "what is one transformer block of this model?",
the unit that FSDP wraps and activation checkpointing recomputes.
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Optional, Sequence, Type, Union

import torch
from torch import nn


def find_transformer_block_classes(model: nn.Module) -> List[Type[nn.Module]]:
    """The classes of the repeated transformer blocks of `model` (e.g. `LlamaDecoderLayer`).

    Hugging Face models name them in `_no_split_modules` (the units they never split over
    devices); only names that match a submodule class are kept, and of those only classes that
    stand in a layer stack (an element of an `nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict`). Encoders also
    name their embeddings there (BERT: `BertEmbeddings`, `BertLayer`): taken as a block, the
    embedding became an FSDP unit of its own, which a tied MLM head (in the root unit) cannot
    share ("shared with a parameter already managed by another FSDP group"), and the activation
    probe measured the embedding as "the first block". Named classes none of which stands in a
    stack are kept as they are. Models naming none: the class of the children of the largest
    `nn.ModuleList` whose children all share one class (the layer stack). Returns [] when
    neither applies.
    """
    classes = _classes_from_no_split_modules(model)
    if classes:
        return _in_a_layer_stack(model, classes) or classes
    block = _class_of_largest_uniform_module_list(model)
    return [block] if block is not None else []


def _in_a_layer_stack(model: nn.Module, classes: Sequence[Type[nn.Module]]) -> List[Type[nn.Module]]:
    """Those of `classes` (in their order) with an instance that is an element of an `nn.ModuleList`,
    `nn.Sequential` or `nn.ModuleDict`."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    stacked = {type(child) for module in model.modules() if isinstance(module, containers)
               for child in module.children()}
    return [cls for cls in classes if cls in stacked]


def _classes_from_no_split_modules(model: nn.Module) -> List[Type[nn.Module]]:
    names = getattr(model, "_no_split_modules", None) or ()
    if isinstance(names, str):
        names = (names,)
    wanted = set(names)
    found: Dict[str, Type[nn.Module]] = {}
    for module in model.modules():
        cls_name = type(module).__name__
        if cls_name in wanted and cls_name not in found:
            found[cls_name] = type(module)
    # `_no_split_modules` is often a set: sort by name so every rank gets the same order.
    return [found[n] for n in sorted(wanted) if n in found]


def _class_of_largest_uniform_module_list(model: nn.Module) -> Optional[Type[nn.Module]]:
    """The child class of the longest uniform `nn.ModuleList` that is not inside another one's
    children: the layer stack, not a layer's own list (a mixture of experts can have more experts
    per layer than layers)."""
    uniform = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(c) for c in module}) == 1]
    names = [name for name, _ in uniform]
    best: Optional[Type[nn.Module]] = None
    best_len = 0
    for name, module in uniform:
        if any(other != name and (other == "" or name.startswith(other + ".")) for other in names):
            continue
        # len > best_len keeps the first of equally long lists (module order is deterministic).
        if len(module) > best_len:
            best, best_len = type(module[0]), len(module)
    return best


def resolve_module_classes(model: nn.Module, spec: Optional[Sequence[Union[str, type]]],
                           what: str = "wrap_cls") -> List[Type[nn.Module]]:
    """Turn a user list of classes or class names into classes present in `model`.

    None means auto-detection with `find_transformer_block_classes`. Raises ValueError naming
    an unknown class name and listing the module classes the model does have.
    """
    if spec is None:
        return find_transformer_block_classes(model)
    by_name: Dict[str, Type[nn.Module]] = {}
    for module in model.modules():
        by_name.setdefault(type(module).__name__, type(module))
    classes: List[Type[nn.Module]] = []
    for entry in spec:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            classes.append(entry)
        elif isinstance(entry, str):
            if entry not in by_name:
                raise ValueError(f"{what}: class {entry!r} is not in the model; its module classes are "
                                 f"{sorted(by_name)}")
            classes.append(by_name[entry])
        else:
            raise ValueError(f"{what}: entry {entry!r} must be an nn.Module subclass or a class name string")
    return classes


def modules_of_classes(model: nn.Module, classes: Iterable[type]) -> List[nn.Module]:
    """Submodules of `model` that are instances of `classes`, parents before children."""
    classes = tuple(classes)
    if not classes:
        return []
    return [m for m in model.modules() if isinstance(m, classes)]


def derived_class(base: type, mixin: type, prefix: str, home: str) -> type:
    """`prefix + base.__name__`, subclassing (mixin, base), for swapping an instance's `__class__` (as FSDP2's
    `fully_shard` does). Cached as an attribute of the module named `home` (the caller's `__name__`), whose
    name the class carries, so that the same class is reused and pickle finds it."""
    name = f"{prefix}{base.__name__}"
    key = f"_{name}_{id(base):x}"
    module = sys.modules[home]
    cls = getattr(module, key, None)
    if cls is None:
        cls = type(name, (mixin, base), {"__module__": home, "__qualname__": key})
        setattr(module, key, cls)
    return cls


def cast_floating(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `module`'s floating-point parameters and buffers to `dtype`, in place; returns it.

    Unlike `module.to(dtype)`, which casts complex tensors too (a rotary `freqs_cis` would lose its
    imaginary part), complex and integer tensors keep their dtype, as `module.bfloat16()` does.
    """
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
