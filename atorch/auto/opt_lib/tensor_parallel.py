"""`tensor_parallel`: shard the model's linears and embeddings over the "tensor" parallel group.

Runs after `parallel_mode` has created the groups and before anything wraps the model. All
the work is `atorch.tensor_parallel.apply_tensor_parallel`; this class only validates the
config and hands it the tensor group and this rank's coordinates.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.tensor_parallel import TPInfo, apply_tensor_parallel, validate_tensor_parallel
from atorch.tensor_parallel.plan import TPPlan
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED


@dataclass(frozen=True)
class TensorParallelConfig:
    tpinfo: Optional[TPInfo] = None
    """What to shard; None: the hand preset of the model type (gpt2, opt, falcon, bloom) or the plan transformers
    ships with the model (`config.base_model_tp_plan`: llama, mistral, qwen2/3, gemma, phi3, gpt_neox, mixtral, ...)."""

    base_seed: int = DEFAULT_BASE_SEED
    """Seeds the dropout streams and, for a meta model, the weights (equal to
    `torch.manual_seed(base_seed); Model(config)`); the default is pipeline_parallel's too."""

    per_block_init: bool = False
    """Meta models only: build one block at a time (bounded memory) with per-block seeds instead of the whole model."""

    gather_logits: bool = True
    """True: the model returns the unsharded model's full logits (its own loss is still computed from the
    vocabulary slices). False: `output.logits` is this rank's vocabulary slice, for
    `atorch.tensor_parallel.vocab_parallel_cross_entropy` (no rank ever holds [tokens, vocab] logits)."""


@register
class TensorParallelOptimization(Optimization):
    name = "tensor_parallel"
    splits_over = frozenset({"tensor"})
    aliases = ("tp",)
    order = Order.TENSOR_PARALLEL
    requires = frozenset({"parallel_mode"})
    distributed_only = True
    Config = TensorParallelConfig
    search_dimension = "parallel"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """A tensor split of every size dividing the world (validation drops those the model's
        heads and widths do not divide), the rest data-parallel; kept inside one node when the world
        spans several (`context.ranks_per_node`): a tensor split all-reduces activations in every
        block, forward and backward, and over the inter-node link it is slower than any other
        layout (Megatron-LM's guidance too), while those splits were 39% of a 7B model's space at
        64 ranks. Inside one node means a size dividing the ranks per node: the tensor dimension
        varies fastest, so its groups are runs of consecutive ranks, and a run of 6 of 3 nodes of 8
        (ranks 6-11) spans two."""
        w, per_node = context.world_size, context.ranks_per_node
        return [[("parallel_mode", ([("tensor", t), ("data", w // t)], None)), cls.name]
                for t in range(2, w + 1) if w % t == 0 and (not per_node or per_node % t == 0)]

    @classmethod
    def memory_saving(cls, config: TensorParallelConfig) -> Dict[str, float]:
        return {}      # parallel_mode's tensor degree declares the split

    @classmethod
    def cost_traits(cls, config: TensorParallelConfig, context: CostContext) -> Dict[str, Any]:
        # Linears, embeddings and the head sharded over "tensor" (the size comes from parallel_mode).
        return {"tensor_parallel": True, "gather_logits": config.gather_logits}

    def validate(self, config: TensorParallelConfig, context: ValidationContext) -> None:
        if not isinstance(config.base_seed, int) or isinstance(config.base_seed, bool):
            raise ValueError(f"tensor_parallel: base_seed={config.base_seed!r} must be an int")
        for key in ("gather_logits", "per_block_init"):
            if not isinstance(getattr(config, key), bool):
                raise ValueError(f"tensor_parallel: {key}={getattr(config, key)!r} must be True or False")
        if config.tpinfo is not None and not isinstance(config.tpinfo, TPInfo):
            raise ValueError(f"tensor_parallel: tpinfo must be a TPInfo or None, got {type(config.tpinfo).__name__}")
        sizes = context.parallel_sizes()
        if "tensor" not in sizes:
            raise ValueError(f"tensor_parallel needs a 'tensor' dimension in parallel_mode (dims are {sizes}); e.g. "
                             "('parallel_mode', ([('tensor', 2), ('data', world_size // 2)], None))")
        tp_size = sizes["tensor"]
        if tp_size > context.world_size:
            raise ValueError(f"tensor parallel size {tp_size} is larger than the world size {context.world_size}")
        if context.model is not None:
            validate_tensor_parallel(context.model, config.tpinfo, tp_size, world_size=context.world_size)

    def apply(self, ctx: ModelContext, config: TensorParallelConfig) -> None:
        parallel = ctx.require_parallel("tensor_parallel")
        built = apply_tensor_parallel(
            ctx.model, parallel.group("tensor"), tpinfo=config.tpinfo, base_seed=config.base_seed,
            coords=parallel.layout.coords(dist.get_rank()), per_block_init=config.per_block_init,
            gather_logits=config.gather_logits, device=ctx.device)
        ctx.model = built.model
        ctx.randomizer = built.randomizer
        ctx.summaries[self.name] = tp_summary(built.plan)


def tp_summary(plan: TPPlan) -> Dict[str, Any]:
    """What tensor parallelism did, for `result.summaries`: its size, the modules per role, the head's output."""
    roles = Counter(action.kind for action in plan.actions.values())
    return {"size": plan.tp_size, "modules": dict(sorted(roles.items())),
            "logits": "gathered" if plan.gather_logits else ("vocabulary slice" if plan.vocab_parallel_loss else "full")}
