"""`StrategyTraits`: what a strategy does to memory and time, as the optimizations declare it.

The memory and time formulas read only these fields, never optimization names.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, FrozenSet, Optional, Set, Tuple, cast

from atorch.auto.cost_model.optimizer import ADAM, OptimizerStates
from atorch.auto.cost_model.shape import ModelShape
from atorch.auto.strategy import Strategy, StrategyLike


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy does to memory and time: the combined `cost_traits` declarations of its items.

    Each optimization class declares its own effect (`Optimization.cost_traits`, e.g. amp_native:
    half compute and autocast; zero1: a sharder and its ZeRO stage); `from_strategy` applies
    them in the strategy's order, later items overriding earlier ones field by field. The
    memory formulas then read only these fields, never optimization names.
    """

    # layout (parallel_mode); tensor/pipeline count only when an optimization shards that way
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    tensor_parallel: bool = False
    gather_logits: bool = True          # tensor_parallel: the model returns the full logits (gathered)
    # precision
    compute_dtype_bytes: int = 4        # activations and matmuls (amp/half/DeepSpeed bf16: 2)
    param_dtype_bytes: int = 4          # parameters as the user's optimizer sees them (half: 2)
    autocast: bool = False              # amp_native: torch.autocast unless a sharding wrapper computes in half
    bf16: bool = False                  # the half dtype is bfloat16 (DeepSpeed's stage-0 optimizer depends on it)
    fp8: bool = False
    # sharding: None (replicated), "torch_zero1" (ZeroRedundancyOptimizer), "fsdp2", "deepspeed"
    sharding: Optional[str] = None
    zero_stage: int = 0
    reshard_after_forward: bool = True  # fsdp2 only
    cpu_offload: bool = False           # torch FSDP2 CPUOffloadPolicy: sharded params, grads, optimizer on the host
    ds_offload_optimizer: bool = False  # DeepSpeed offload_optimizer: fp32 master, Adam state, fp32 grads on the host
    ds_offload_params: bool = False     # DeepSpeed offload_param (ZeRO-3): the half parameter partitions too
    ds_bucket_elements: int = 0         # DeepSpeed's reduce bucket (user's ds_config); 0: atorch derives it
    # ZeRO-3's stage3_param_persistence_threshold and stage3_prefetch_bucket_size from the user's
    # ds_config (elements; 0 is a setting); None: DeepSpeed's defaults.
    ds_persistence_elements: Optional[int] = None
    ds_prefetch_elements: Optional[int] = None
    ddp_wrap: bool = False              # a DDP wrapper when data > 1 and nothing else reduces gradients
    # pipelines and accumulation
    pipeline_engine: Optional[str] = None   # "native" (torch pipelining) or "deepspeed"
    pipeline_chunks: int = 1            # micro-batches per step per data rank
    pipeline_schedule: str = "gpipe"    # "gpipe" keeps every micro-batch's activations, "1f1b" at most `pipeline`
    accumulation_steps: int = 1         # the micro-batch is global batch / data / accumulation_steps
    accumulation_sync: Optional[bool] = None   # gradient_accumulation's sync_each_micro_step (None: per wrapper)
    # what the model computes
    checkpoint: bool = False
    fused_attention: bool = False       # module_replace: sdpa, no b*heads*s^2 matrix
    fused_activation: bool = False      # module_replace: GPT-2's Python tanh GELU as one op (saves its input only)
    fused_norm: bool = False            # module_replace: RMSNorm as F.rms_norm (saves fp32 upcast and result in half)
    kv_cache_off: bool = False          # compile: sets the model's use_cache to False
    lora_rank: int = 0                  # lora: adapters of this rank, base weights frozen
    lora_targets: Optional[Tuple[str, ...]] = None
    lora_modules_to_save: Optional[Tuple[str, ...]] = None   # lora: modules trained whole (peft adds a trainable copy)
    trainable_fraction: float = 1.0     # derived: trainable / total parameters (lora, parameters the user froze)
    optimizer: OptimizerStates = ADAM   # derived: what the user's optimizer keeps per trainable parameter
    # how fast it computes
    compute_time_factor: float = 1.0    # multiplies compute + per-layer overhead seconds (compile: < 1)

    @classmethod
    def from_strategy(cls, strategy: StrategyLike, world_size: int, shape: ModelShape,
                      device_type: str = "cpu", optimizer: Optional[OptimizerStates] = None) -> "StrategyTraits":
        """Combine the `cost_traits` of every item of `strategy` (items of unknown names are ignored),
        completed as `resolve_strategy` completes it (`implied_optimizations`: a missing parallel_mode,
        and ddp when nothing else reduces gradients); `optimizer`: what the user's optimizer keeps
        (`optimizer_states`), Adam's by default."""
        from atorch.auto.opt_lib.base import CostContext, get_optimization
        from atorch.auto.opt_lib.resolve import implied_optimizations

        items = []
        for item in Strategy.from_any(strategy):
            try:
                opt = get_optimization(item.name)
            except ValueError:      # not registered here: it declares nothing to the cost model
                continue
            items.append((opt.order, opt, opt.parse_config(item.config)))
        present = {opt.name: config for _, opt, config in items}
        items += [(get_optimization(name).order, get_optimization(name), config)
                  for name, config in implied_optimizations(present, world_size).items()]
        items.sort(key=lambda entry: entry[0])
        configs = {opt.name: config for _, opt, config in items}
        dims = configs["parallel_mode"].sizes(world_size)
        context = CostContext(world_size=world_size, dims=dims, device_type=device_type, configs=configs)
        valid = {f.name for f in dataclasses.fields(cls)} - {"trainable_fraction", "optimizer"}
        updates: Dict[str, Any] = {}
        for _, opt, config in items:
            declared = opt.cost_traits(config, context)
            unknown = sorted(set(declared) - valid)
            if unknown:
                raise ValueError(f"{opt.name}.cost_traits declares unknown trait(s) {unknown}; valid traits are "
                                 f"{sorted(valid)}")
            updates.update(declared)
        traits = cls(**updates)
        if not traits.tensor_parallel:
            traits = dataclasses.replace(traits, tensor=1)
        if traits.pipeline_engine is None:
            traits = dataclasses.replace(traits, pipeline=1)
        if traits.lora_rank:
            trainable = lora_params(shape, traits) / max(1, shape.num_params + lora_params(shape, traits))
        else:
            trainable = 1.0 - shape.frozen_params / max(1, shape.num_params)
        return dataclasses.replace(traits, trainable_fraction=trainable, optimizer=optimizer or ADAM)

    # -- derived views, in ZeRO's terms ---------------------------------------------------------
    @property
    def fsdp2_syncs_each_micro_step(self) -> bool:
        """Torch FSDP2 reduce-scatters in every accumulation micro-step (the default: its gradients stay
        sharded) rather than keeping unsharded gradients until the last (`sync_each_micro_step=False`)."""
        return self.sharding == "fsdp2" and self.accumulation_sync is not False

    @property
    def optimizer_shard(self) -> int:
        """Ranks the optimizer state is split over."""
        sharded = self.sharding in ("torch_zero1", "fsdp2") or (self.sharding == "deepspeed" and self.zero_stage >= 1)
        return self.data if sharded else 1

    @property
    def grad_shard(self) -> int:
        """Ranks the gradients are split over. DeepSpeed's stage-1 optimizer keeps only its partition's
        gradients too (it copies each reduced bucket's slice into one partition buffer; measured)."""
        sharded = self.sharding == "fsdp2" or (self.sharding == "deepspeed" and self.zero_stage >= 1)
        return self.data if sharded else 1

    @property
    def param_shard(self) -> int:
        """Ranks the stored parameters are split over."""
        sharded = self.sharding == "fsdp2" or (self.sharding == "deepspeed" and self.zero_stage >= 3)
        return self.data if sharded else 1

    @property
    def fsdp2(self) -> Optional[str]:
        """"zero2" (parameters kept gathered after forward) or "fsdp" (resharded) on torch FSDP2, else None."""
        if self.sharding != "fsdp2":
            return None
        return "fsdp" if self.reshard_after_forward else "zero2"

    @property
    def ddp_buckets(self) -> bool:
        """DDP keeps a flat copy of the gradients in its all-reduce buckets."""
        return self.ddp_wrap and self.data > 1 and self.sharding in (None, "torch_zero1") \
            and self.pipeline_engine is None

    @property
    def storage_bytes(self) -> int:
        """Bytes per element of the module's parameters: DeepSpeed holds them in its half dtype."""
        if self.sharding == "deepspeed" and self.compute_dtype_bytes == 2:
            return 2
        return self.param_dtype_bytes


# Leaf names of the linears tensor parallelism splits by their input (row-parallel): LoRA's B
# matrix stays whole on every rank there, its A matrix on the column-parallel ones.
_ROW_PARALLEL_LEAVES = frozenset({"o_proj", "down_proj", "c_proj", "dense", "dense_4h_to_h", "out_proj", "fc2", "w2",
                                  "wo", "fc_out"})


def _lora_targets(shape: ModelShape, traits: StrategyTraits) -> Optional[Tuple[str, ...]]:
    """The leaf names LoRA adapts: the strategy's, else peft's defaults for the model's type (None: unknown)."""
    if traits.lora_targets is not None:
        return tuple(t.rpartition(".")[2] for t in traits.lora_targets)
    if not shape.model_type:
        return None
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    except ImportError:
        return None
    targets = defaults.get(shape.model_type)
    return tuple(targets) if targets else None


# Leaf names of a token embedding: peft's copy of one in `modules_to_save` is vocab x hidden.
_EMBEDDING_LEAVES = frozenset({"embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings"})


def lora_saved_leaves(traits: StrategyTraits) -> Set[str]:
    return {t.rpartition(".")[2] for t in traits.lora_modules_to_save or ()} if traits.lora_rank else set()


def lora_saved_params(shape: ModelShape, traits: StrategyTraits) -> float:
    """Parameters of the trainable copies peft makes of LoRA's `modules_to_save`: the model's linear layers of
    those leaf names (`ModelShape.linear_layers`, weights only) and a token embedding under its usual names; a
    module the shape does not list (a norm, a custom head) is not counted. Never tensor-sharded (refused there)."""
    leaves = lora_saved_leaves(traits)
    if not leaves:
        return 0.0
    total = sum(count * n_in * n_out for leaf, n_in, n_out, count in shape.linear_layers if leaf in leaves)
    if leaves & _EMBEDDING_LEAVES:
        total += shape.vocab_size * shape.hidden_size
    return float(total)


def head_trains(shape: ModelShape, traits: StrategyTraits) -> bool:
    """Whether the LM head's weight gets a gradient: not frozen by the user, and under LoRA only when
    `modules_to_save` names it (a linear layer of the model whose output is the vocabulary)."""
    if shape.head_frozen:
        return False
    if not traits.lora_rank:
        return True
    leaves = lora_saved_leaves(traits)
    return any(leaf in leaves and n_out == shape.vocab_size for leaf, _, n_out, _ in shape.linear_layers)


@functools.lru_cache(maxsize=64)
def peft_expert_targets(model_type: str, targets: Tuple[str, ...]) -> Tuple[FrozenSet[str], Dict[str, int]]:
    """(the target names peft moves onto fused expert weights for `model_type`, {expert weight leaf: rank
    multiple}): peft's own rewrite for the mixture-of-experts models transformers 5 fuses (what
    `opt_lib.lora.convert_like_peft` applies to the real config), read without a model; a weight fused from two
    projections (gate and up) gets twice the rank. Nothing for a model type peft does not rewrite, or an older
    peft. Raises peft's ValueError for targets it cannot rewrite (gate_proj without up_proj)."""
    try:
        import peft
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return frozenset(), {}
    probe = peft.LoraConfig(r=1, lora_alpha=1, target_modules=list(targets))
    # Only the model type is read for a list of targets (the modules only for a regex).
    convert_peft_config_for_transformers(probe, cast(Any, SimpleNamespace(config=SimpleNamespace(
        model_type=model_type))), None)
    moved = frozenset(targets) - frozenset(probe.target_modules or ())
    ranks = {leaf: 1 for leaf in probe.target_parameters or ()}
    for pattern, rank in (probe.rank_pattern or {}).items():
        for leaf in ranks:
            if re.fullmatch(pattern, f"experts.{leaf}"):
                ranks[leaf] = int(rank)
    return moved, ranks


def lora_params(shape: ModelShape, traits: StrategyTraits, tensor: int = 1) -> float:
    """Trainable parameters LoRA adds (per rank of a `tensor`-way split): rank x (in + out) per adapted
    linear, plus the copies of `modules_to_save` (`lora_saved_params`).

    Counted on the model's own linear layers where the shape knows them (leaf names matched as
    peft matches them; its default targets for the model's type). Under tensor parallelism a
    column-parallel linear's A matrix (rank x in) and a row-parallel one's B (out x rank) stay whole.
    Without the layers: peft's defaults of a Llama-style model (q and v) or GPT-2 (c_attn), and
    one hidden x hidden linear per other target.
    """
    if not traits.lora_rank:
        return 0
    r = traits.lora_rank
    targets = _lora_targets(shape, traits) if shape.linear_layers else None
    if targets:
        moved, expert_ranks = _peft_expert_rewrite(shape, targets)
        total = 0.0
        for leaf, n_in, n_out, count in shape.linear_layers:
            if leaf in targets and leaf not in moved:   # peft adapts the experts for a moved name, not a dense layer
                row = leaf in _ROW_PARALLEL_LEAVES
                total += count * r * (n_in / (tensor if row else 1) + n_out / (1 if row else tensor))
        # A fused expert weight (E, d1, d2): peft's A is (rank x E, d2) and B (d1, rank x E).
        for leaf, experts, d1, d2, count in shape.expert_weights:
            if leaf in expert_ranks:
                total += count * r * expert_ranks[leaf] * experts * (d1 + d2)
        return total + lora_saved_params(shape, traits)
    return _lora_formula_params(shape, traits) / tensor + lora_saved_params(shape, traits)


def _peft_expert_rewrite(shape: ModelShape, targets: Tuple[str, ...]) -> Tuple[FrozenSet[str], Dict[str, int]]:
    """`peft_expert_targets` for the shape's model, nothing where it has no fused expert weights or peft cannot
    rewrite the targets (refused when lora is applied: `lora.expert_targets`)."""
    if not shape.expert_weights:
        return frozenset(), {}
    try:
        return peft_expert_targets(shape.model_type, targets)
    except ValueError:
        return frozenset(), {}


def lora_expert_weights(shape: ModelShape, traits: StrategyTraits) -> Tuple[Tuple[str, int, int, int, int], ...]:
    """The fused expert weights (`ModelShape.expert_weights` rows) that LoRA adapts: peft wraps each whole."""
    if not traits.lora_rank or not shape.expert_weights or not shape.linear_layers:
        return ()
    targets = _lora_targets(shape, traits)
    if not targets:
        return ()
    _, ranks = _peft_expert_rewrite(shape, targets)
    return tuple(row for row in shape.expert_weights if row[0] in ranks)


def _lora_formula_params(shape: ModelShape, traits: StrategyTraits) -> int:
    r, h = traits.lora_rank, shape.hidden_size
    kv = shape.kv_dim or h
    if traits.lora_targets is None:
        per_layer = r * (2 * h + shape.q_dim + kv) if shape.gated else r * (h + 3 * h)
    else:
        per_layer = r * 2 * h * len(traits.lora_targets)
    return shape.num_layers * per_layer


def precision_mode(traits: StrategyTraits) -> str:
    """How the blocks compute, which decides the dtype of every saved activation.

    "fp32"; "autocast" (fp32 weights under `torch.autocast`: the residual stream and the norms
    stay fp32, each matmul saves a half copy of its input and of its weight); "half" (the module
    itself computes in half: the `half` optimization, FSDP2 mixed precision, DeepSpeed bf16/fp16).
    """
    if traits.compute_dtype_bytes == 4:
        return "fp32"
    if traits.autocast and traits.sharding not in ("fsdp2", "deepspeed") and traits.param_dtype_bytes == 4:
        return "autocast"
    return "half"


def passes_per_step(traits: StrategyTraits) -> int:
    """Forward/backward passes of one rank per optimizer step: a pipeline's micro-batches x gradient
    accumulation's micro-steps. atorch's accumulation runs the native pipeline's schedule once per
    micro-step; DeepSpeed's pipeline engine declares its accumulation as its chunks (counted once)."""
    chunks = traits.pipeline_chunks if traits.pipeline_engine is not None else 1
    micro_steps = traits.accumulation_steps if traits.pipeline_engine != "deepspeed" else 1
    return max(1, chunks) * max(1, micro_steps)


def micro_batch_size(traits: StrategyTraits, global_batch: int) -> int:
    """Rows of one forward/backward on one rank: the global batch over the data ranks, then over the
    passes of a step (gradient-accumulation steps, the pipeline's micro-batches)."""
    return max(1, max(1, global_batch // traits.data) // passes_per_step(traits))

