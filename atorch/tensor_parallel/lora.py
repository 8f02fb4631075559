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

import math
from typing import Any, Dict, Iterable, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from atorch.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardSpec, shard_tensor
from atorch.tensor_parallel.mappings import copy_to_group, reduce_from_group


def _init_full(r: int, in_features: int, out_features: int, generator: torch.Generator,
               like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    a = torch.empty(r, in_features, dtype=torch.float32)
    # nn.init.kaiming_uniform_(a, a=sqrt(5)) with an explicit generator: bound = 1 / sqrt(fan_in).
    bound = 1.0 / math.sqrt(in_features)
    a.uniform_(-bound, bound, generator=generator)
    b = torch.zeros(out_features, r, dtype=torch.float32)
    return a.to(like.device, like.dtype), b.to(like.device, like.dtype)


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


def add_lora(layer: Any, r: int, alpha: float, generator: torch.Generator) -> nn.Module:
    """Re-class a Column/RowParallelLinear into its LoRA variant with fresh adapters (full A drawn from `generator`)."""
    if layer.weight_layout != "linear":
        raise ValueError(f"lora with tensor_parallel supports nn.Linear layouts; {layer} stores a Conv1D weight "
                         "(GPT-2): target another model or drop tensor_parallel")
    a_full, b_full = _init_full(r, layer.in_features, layer.out_features, generator, layer.weight)
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
    the name or its last dotted components); returns the adapted names. Every rank draws the same full A from
    `seed` and keeps its slice."""
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
    generator = torch.Generator().manual_seed(seed)
    for _, module in matched:
        add_lora(module, r, alpha, generator)
    return [name for name, _ in matched]
