"""`tensor_parallel`: shard the model's linears and embeddings over the "tensor" parallel group.

Runs after `parallel_mode` has created the groups and before anything wraps the model: the
model (real, or built on the meta device under `record_module_init`) is sharded with its
family's preset TPInfo or the one given, the dropout streams are seeded from `base_seed`,
and the rest of the flow sees an ordinary module, which `parallel_mode` then wraps in DDP
over the "data" group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.modules.distributed_modules.randomizer import init_randomizer
from atorch.utils.manual_tp_utils import TPInfo, materialize_tp_module, resolve_tp_plan, tp_manual_shard_custom_fn
from atorch.utils.meta_model_utils import is_meta_module
from atorch.utils.tp_presets import tpinfo_for_model


@dataclass(frozen=True)
class TensorParallelConfig:
    tpinfo: Optional[TPInfo] = None
    """What to shard; None: the preset for the model's `config.model_type` (llama, mistral, qwen2, gpt2, gpt_neox)."""

    base_seed: int = 0
    """Seeds the dropout streams and, for a meta model, the weights (equal to `torch.manual_seed(base_seed); Model()`)."""

    per_block_init: bool = False
    """Meta models only: build one block at a time (bounded memory) with per-block seeds instead of the whole model."""


@register
class TensorParallelOptimization(Optimization):
    name = "tensor_parallel"
    aliases = ("tp",)
    order = Order.TENSOR_PARALLEL
    requires = frozenset({"parallel_mode"})
    distributed_only = True
    Config = TensorParallelConfig

    @classmethod
    def cost_traits(cls, config: TensorParallelConfig, context: CostContext) -> Dict[str, Any]:
        # Linears, embeddings and the head sharded over "tensor" (the size comes from parallel_mode).
        return {"tensor_parallel": True}

    def validate(self, config: TensorParallelConfig, context: ValidationContext) -> None:
        if not isinstance(config.base_seed, int) or isinstance(config.base_seed, bool):
            raise ValueError(f"tensor_parallel: base_seed={config.base_seed!r} must be an int")
        if config.tpinfo is not None and not isinstance(config.tpinfo, TPInfo):
            raise ValueError(f"tensor_parallel: tpinfo must be a TPInfo or None, got {type(config.tpinfo).__name__}")
        sizes = context.parallel_sizes()
        if "tensor" not in sizes:
            raise ValueError(f"tensor_parallel needs a 'tensor' dimension in parallel_mode (dims are {sizes}); e.g. "
                             "('parallel_mode', ([('tensor', 2), ('data', world_size // 2)], None))")
        tp_size = sizes["tensor"]
        if tp_size > context.world_size:
            raise ValueError(f"tensor parallel size {tp_size} is larger than the world size {context.world_size}")
        if context.model is None:
            return
        tpinfo = config.tpinfo if config.tpinfo is not None else tpinfo_for_model(context.model)
        resolve_tp_plan(context.model, tpinfo, tp_size, world_size=context.world_size)

    def apply(self, ctx: ModelContext, config: TensorParallelConfig) -> None:
        parallel = ctx.require_parallel("tensor_parallel")
        group = parallel.group("tensor")
        randomizer = init_randomizer(config.base_seed, parallel.layout.coords(dist.get_rank()))
        tpinfo = config.tpinfo if config.tpinfo is not None else tpinfo_for_model(ctx.model)
        # A user loss reads output.logits, so it needs them whole; HF's own loss runs vocabulary-parallel.
        gather_logits = True if ctx.loss_func is not None else None
        if is_meta_module(ctx.model):
            marked = tp_manual_shard_custom_fn(ctx.model, tpinfo, group=group, randomizer=randomizer,
                                               gather_logits=gather_logits)
            ctx.model = materialize_tp_module(marked, config.base_seed, per_block=config.per_block_init,
                                              group=group, randomizer=randomizer)
        else:
            _check_replicas_agree(ctx.model, group, ctx.device)
            ctx.model = tp_manual_shard_custom_fn(ctx.model, tpinfo, group=group, randomizer=randomizer,
                                                  gather_logits=gather_logits)
        ctx.randomizer = randomizer


@torch.no_grad()
def _check_replicas_agree(model: torch.nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise on every rank when the full model differs across the tensor group (slices would not fit together).

    One float64 checksum per rank: ranks built under the same seed agree bit for bit.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        total += p.detach().double().sum().cpu()
    local = total.reshape(1).to(device)
    sums: List[torch.Tensor] = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sums, local, group=group)
    values = [float(s.item()) for s in sums]
    if any(v != values[0] for v in values):
        raise ValueError(f"tensor_parallel: the model's weights differ across the tensor group (parameter checksums "
                         f"{values}); construct it under the same seed on every rank, or build it under "
                         "record_module_init() so tensor_parallel materializes it from base_seed")
