"""LoRA adapters on tensor-parallel linears, sharded consistently with the layer they adapt.

Written here rather than through peft: peft's LoRA wraps `nn.Linear`/`Conv1D` (and Megatron's
own parallel layers through `megatron_config`), not atorch's `ColumnParallelLinear` /
`RowParallelLinear`, and its layer would run the adapter on the full input and output,
which a sharded layer does not have. The math is peft's (y = W x + (alpha / r) B A x, A
kaiming-uniform, B zero, so training starts from the base model); the placement follows the
base layer:

- column-parallel (W split by output rows): A [r, in] replicated, B [out, r] split by rows
  like W (same stride and vocabulary padding). Each rank's A gradient covers its output
  rows only, so A enters through `copy_to_group` (its gradient is summed over the group);
- row-parallel (W split by input columns, input split): A [r, in] split by columns like W,
  the small [.., r] product summed over the group, B [out, r] replicated (its gradient,
  computed from replicated values, is already the same on every rank).

The adapters are parameters of the layer itself (`lora_A`, `lora_B`, in `shard_specs()`), so
full state dicts (`gather_tp_state_dict`) and checkpoints see them with their full shapes.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

import torch
import torch.nn.functional as F
from torch import nn

from atorch.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardSpec, shard_tensor
from atorch.tensor_parallel.mappings import copy_to_group, reduce_from_group
from atorch.utils.lora_init import lora_a_init


class LoraColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear with a LoRA adapter (see the module docstring)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float

    def shard_specs(self) -> Dict[str, ShardSpec]:
        specs = super().shard_specs()
        specs["lora_B"] = ShardSpec(0, self.out_features, self.tp_size, self.stride, self.out_spec.padded_size)
        return specs

    def local_output(self, x: torch.Tensor) -> torch.Tensor:
        a = copy_to_group(self.lora_A, self.group)
        return super().local_output(x) + self.lora_scaling * F.linear(F.linear(x, a), self.lora_B)


class LoraRowParallelLinear(RowParallelLinear):
    """A row-parallel linear with a LoRA adapter (see the module docstring)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float

    def shard_specs(self) -> Dict[str, ShardSpec]:
        specs = super().shard_specs()
        specs["lora_A"] = ShardSpec(1, self.in_features, self.tp_size)
        return specs

    def reduced_output(self, x: torch.Tensor) -> torch.Tensor:
        h = reduce_from_group(F.linear(x, self.lora_A), self.group)
        return super().reduced_output(x) + self.lora_scaling * F.linear(h, self.lora_B)


def add_lora(layer: Any, r: int, alpha: float, a_full: torch.Tensor) -> nn.Module:
    """Re-class a Column/RowParallelLinear into its LoRA variant; `a_full` is the full fp32 A [r, in_features]
    (each rank keeps its slice), B starts at zero."""
    if layer.weight_layout != "linear":
        raise ValueError(f"lora with tensor_parallel supports nn.Linear layouts; {layer} stores a Conv1D weight "
                         "(GPT-2): target another model or drop tensor_parallel")
    if tuple(a_full.shape) != (r, layer.in_features):
        raise ValueError(f"lora: A has shape {tuple(a_full.shape)}; {layer} needs ({r}, {layer.in_features})")
    like = layer.weight
    a_full = a_full.to(like.device, like.dtype)
    b_full = torch.zeros(layer.out_features, r, dtype=like.dtype, device=like.device)
    if isinstance(layer, ColumnParallelLinear):
        layer.__class__ = LoraColumnParallelLinear
        spec = ShardSpec(0, layer.out_features, layer.tp_size, layer.stride, layer.out_spec.padded_size)
        a, b = a_full, shard_tensor(b_full, spec, layer.tp_rank)
    elif isinstance(layer, RowParallelLinear):
        layer.__class__ = LoraRowParallelLinear
        a, b = shard_tensor(a_full, ShardSpec(1, layer.in_features, layer.tp_size), layer.tp_rank), b_full
    else:
        raise ValueError(f"{type(layer).__name__} is not a tensor-parallel linear")
    layer.lora_A = nn.Parameter(a.contiguous())
    layer.lora_B = nn.Parameter(b.contiguous())
    layer.lora_scaling = alpha / r
    return layer


def add_tp_lora_adapters(model: nn.Module, targets: Iterable[str], r: int, alpha: float, dropout: float,
                         seed: int) -> List[str]:
    """Freeze `model` and add adapters to every tensor-parallel linear whose name matches a target (peft's rule:
    the name or its last dotted components); returns the adapted names. Every rank draws the same full A,
    seeded by `seed` and the layer's path (`lora_a_init`: the adapters single-process LoRA on the same model
    starts from), and keeps its slice."""
    if dropout != 0.0:
        raise ValueError(f"lora: dropout={dropout} with tensor_parallel is not supported (the adapter input is "
                         "replicated or split depending on the layer); use dropout=0.0")
    targets = tuple(targets)
    matched = [(name, m) for name, m in model.named_modules()
               if name and any(name == t or name.endswith("." + t) for t in targets)]
    bad = [(name, type(m).__name__) for name, m in matched
           if not isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    if bad:
        raise ValueError(f"lora with tensor_parallel adapts tensor-parallel linears only; targets {list(targets)} "
                         f"match {bad[:4]}, which tensor_parallel did not shard")
    if not matched:
        raise ValueError(f"lora: target modules {list(targets)} match no tensor-parallel linear of "
                         f"{type(model).__name__}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in matched:
        add_lora(module, r, alpha, lora_a_init(seed, name, r, module.in_features))
    return [name for name, _ in matched]
