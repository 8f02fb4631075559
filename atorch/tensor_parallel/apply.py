"""The one entry point of the `tensor_parallel` optimization: validate a TPInfo, shard or build the model.

Everything it needs is passed in (the tensor process group, this rank's parallel
coordinates), so callers decide where the groups come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import nn

from atorch.distributed.replicas import check_replicas_agree
from atorch.tensor_parallel.logits import gather_logits_for_generate
from atorch.tensor_parallel.mappings import Group, group_size
from atorch.tensor_parallel.plan import TPInfo, TPPlan, resolve_tp_plan
from atorch.tensor_parallel.presets import tpinfo_for_model
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, init_randomizer
from atorch.tensor_parallel.shard import materialize_tp_module, shard_model, tp_plan_of
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED, is_meta_module


def validate_tensor_parallel(model: nn.Module, tpinfo: Optional[TPInfo], tp_size: int,
                             world_size: Optional[int] = None) -> TPPlan:
    """Resolve `tpinfo` (None: the model's preset or transformers plan) against `model`; pure, raises ValueError."""
    if tpinfo is not None and not isinstance(tpinfo, TPInfo):
        raise ValueError(f"tensor_parallel: tpinfo must be a TPInfo or None, got {type(tpinfo).__name__}")
    return resolve_tp_plan(model, tpinfo if tpinfo is not None else tpinfo_for_model(model), tp_size,
                           world_size=world_size)


@dataclass
class TensorParallelModel:
    """What `apply_tensor_parallel` built."""

    model: nn.Module
    plan: TPPlan
    randomizer: MultiDimParallelRandomizer
    tp_size: int


def apply_tensor_parallel(model: nn.Module, group: Group, *, tpinfo: Optional[TPInfo] = None, base_seed: int = DEFAULT_BASE_SEED,
                          coords: Optional[Mapping[str, int]] = None, per_block_init: bool = False,
                          gather_logits: bool = True, device: Optional[torch.device] = None) -> TensorParallelModel:
    """Shard `model` over `group` (the tensor-parallel group); a meta model is built as this rank's slices.

    `coords` (this rank's coordinate along each parallel dimension) seeds the dropout streams
    with `base_seed`; the randomizer becomes the process default (activation checkpointing
    replays its streams). A real model must be identical on every rank of the group
    (checked with one checksum per rank); a meta model built under `record_module_init` gets
    the weights of `torch.manual_seed(base_seed); Model(config)`. `gather_logits`: see
    `resolve_tp_plan` (True: the model returns full logits; False: this rank's vocabulary slice, except
    inside the model's own `generate`, which gathers: `logits.gather_logits_for_generate`).
    """
    randomizer = init_randomizer(base_seed, coords)
    if tpinfo is None:
        tpinfo = tpinfo_for_model(model)
    if is_meta_module(model):
        marked = shard_model(model, tpinfo, group, randomizer=randomizer, gather_logits=gather_logits)
        model = materialize_tp_module(marked, base_seed, per_block=per_block_init, group=group, randomizer=randomizer)
    else:
        check_replicas_agree(model, group, device, "tensor_parallel",
                             "construct it under the same seed on every rank, or build it under record_module_init() "
                             "so tensor_parallel materializes it from base_seed")
        model = shard_model(model, tpinfo, group, randomizer=randomizer, gather_logits=gather_logits)
    plan = tp_plan_of(model)
    assert plan is not None
    if plan.vocab_parallel_loss and not plan.gather_logits:
        gather_logits_for_generate(model)
    return TensorParallelModel(model, plan, randomizer, group_size(group))
