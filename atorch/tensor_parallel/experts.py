"""Tensor parallelism for modules that are not plain linears: mixture-of-experts weight holders and
replicated parameters that act on this rank's heads.

Both keep the module object, its name and its class's forward (transformers' experts
forward dispatches on `config._experts_implementation`, which must keep working): the
instance is re-classed to a subclass that adds the communication around the original
forward. State-dict keys and shapes of the unsharded model are preserved by the checkpoint
code through `shard_specs()`, like the other tensor-parallel layers.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from atorch.tensor_parallel.layers import ShardSpec, TensorParallelModule, _GroupRef, _sliced_parameter
from atorch.tensor_parallel.mappings import Group, copy_to_group, group_rank, group_size, reduce_from_group
from atorch.utils.module_utils import derived_class


def _derived_class(base: type, mixin: type, prefix: str) -> type:
    return derived_class(base, mixin, prefix, __name__)


class TensorParallelExperts(TensorParallelModule):
    """Mixin for an experts module whose every expert is split like a dense MLP.

    Expert e's `gate_up_proj[e]` ([gate; up], 2I x H) keeps this rank's rows of the gate and
    of the up halves (stride 2), `down_proj[e]` (H x I) this rank's columns, so each rank
    computes a partial sum of every selected expert's output; one all-reduce per layer adds
    them. The router's outputs (which experts, with which weights) are replicated inputs:
    `copy_to_group` makes their gradients (and the hidden states') sums over the group, so the
    replicated router receives the full gradient on every rank.
    """

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    _tp_specs: Dict[str, ShardSpec]

    def shard_specs(self) -> Dict[str, ShardSpec]:
        return dict(self._tp_specs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden_states = copy_to_group(hidden_states, self.group)
        top_k_weights = copy_to_group(top_k_weights, self.group)
        out = super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return reduce_from_group(out, self.group)


def shard_experts(module: Any, group: Group) -> nn.Module:
    """Re-class `module` (3-D `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) to hold this rank's slices."""
    if getattr(module, "has_bias", False):
        raise ValueError(f"{type(module).__name__} has expert biases; tensor-parallel experts support bias-free "
                         "experts only (a replicated down bias would be added once per rank)")
    tp_size, rank = group_size(group), group_rank(group)
    experts, two_i, _ = module.gate_up_proj.shape
    specs = {"gate_up_proj": ShardSpec(1, two_i, tp_size, stride=2),
             "down_proj": ShardSpec(2, module.down_proj.shape[2], tp_size)}
    module.gate_up_proj = _sliced_parameter(module.gate_up_proj, specs["gate_up_proj"], rank)
    module.down_proj = _sliced_parameter(module.down_proj, specs["down_proj"], rank)
    module.__class__ = _derived_class(type(module), TensorParallelExperts, "TensorParallel")
    module._group_ref = _GroupRef(group)
    module.tp_size, module.tp_rank = tp_size, rank
    module._tp_specs = specs
    return module


class GradReduced(nn.Module):
    """Mixin: the module's own parameters enter its forward through `copy_to_group`.

    For replicated parameters applied to split activations (Qwen3's q/k RMSNorm runs per
    head, and each rank holds some heads): the forward is unchanged, the gradient each rank
    computes covers its heads only, and the all-reduce in `copy_to_group`'s backward sums it
    into the full gradient on every rank.
    """

    _grad_group_ref: _GroupRef

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params: Dict[str, Any] = self._parameters
        saved = dict(params)
        try:
            for key, p in saved.items():
                if p is not None:
                    params[key] = copy_to_group(p, self._grad_group_ref.group)
            return super().forward(*args, **kwargs)
        finally:
            params.update(saved)


def reduce_grads(module: Any, group: Group) -> nn.Module:
    """Re-class `module` so its parameters' gradients are summed over `group` (see `GradReduced`)."""
    if group_size(group) == 1:
        return module
    module.__class__ = _derived_class(type(module), GradReduced, "GradReduced")
    module._grad_group_ref = _GroupRef(group)
    return module

