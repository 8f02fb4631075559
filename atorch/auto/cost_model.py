"""Predict a strategy's per-rank peak memory and step time without running it.

The planner ranks candidates by predicted step time and never dry-runs one whose predicted
peak exceeds the device memory. Pure: plain values in (model shape, strategy, batch, world
size, device), an `Estimate` out; nothing is allocated or communicated.

Memory per rank = parameters + gradients + optimizer state (the ZeRO formulas: stage 1 shards
the Adam state over the data ranks, stage 2 also the gradients, FSDP also the parameters) +
activations. Activations use per-layer terms (b*s*h, b*s*ffn, b*heads*s^2 for an attention
that materializes its matrix) and a logits term (b*s*vocab), with and without activation
checkpointing; their coefficients are fitted to measured peaks by
`scripts/calibrate_cost_model.py`, not chosen by hand. Step time = FLOPs / measured rate + a
per-layer overhead + communication volume / measured bandwidth + a latency per collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from atorch.auto.strategy import Strategy, StrategyLike

# --------------------------------------------------------------------------------------------
# Calibration. Produced by `python scripts/calibrate_cost_model.py` on the 2-core CPU machine
# (torch 2.13, fp32 AdamW, tiny Llama/GPT-2 variants; see benchmarks/RESULTS.md, "Cost model").
# Activation coefficients are bytes per element of each feature, for one training step at
# steady state (optimizer state allocated); "recompute" is the one block rebuilt in backward.
# --------------------------------------------------------------------------------------------

ACTIVATION_COEFFICIENTS: Dict[str, Dict[str, float]] = {
    # feature -> bytes per element: per layer (layer_*) of b*s*h, b*s*ffn, b*heads*s^2; once of
    # b*s*vocab (logits, log-softmax, its gradient) and b*s*h; "matmul_params": autocast weight copies.
    "fp32": {"layer_bsh": 36.682, "layer_bsf": 16.644, "layer_bas2": 4.388, "bsv": 16.024, "bsh": 11.312},
    "fp32_checkpoint": {"layer_bsh": 4.0, "bsh": 11.488, "bsf": 8.831, "bas2": 0.735, "bsv": 15.62},
    "bf16": {"layer_bsh": 31.478, "layer_bsf": 9.467, "layer_bas2": 5.556, "bsv": 14.364, "bsh": 23.078,
             "matmul_params": 0.973},
    "bf16_checkpoint": {"layer_bsh": 4.0, "bsh": 7.157, "bsf": 0.0, "bas2": 2.088, "bsv": 13.829,
                        "matmul_params": 1.724},
}

# The device rates the step-time model divides by. "cpu" is measured (calibration script);
# the GPU entry is a datasheet-derived guess (no GPU was available to calibrate on) and only
# its ratios matter for ranking.
DEVICE_PROFILES: Dict[str, Dict[str, float]] = {
    "cpu": {"flops_fp32": 3.91e10, "flops_bf16": 6.65e10, "layer_overhead_s": 6.86e-3, "step_overhead_s": 0.0,
            "comm_bytes_per_s": 1.02e9, "comm_latency_s": 1.43e-3},
    "cuda": {"flops_fp32": 5.0e13, "flops_bf16": 4.0e14, "layer_overhead_s": 2.0e-4, "step_overhead_s": 2.0e-3,
             "comm_bytes_per_s": 1.5e11, "comm_latency_s": 2.0e-5},
}

ADAM_STATE_BYTES_PER_PARAM = 8       # exp_avg + exp_avg_sq in fp32
LORA_DEFAULT_RANK = 8


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a model; built from a HF config or a module."""

    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    layer_params: int           # parameters of one transformer block
    embedding_params: int       # token/position embeddings + LM head (not tensor-sharded)

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config (Llama, GPT-2 and lookalikes)."""
        h = _config_int(config, ("hidden_size", "n_embd", "d_model"))
        layers = _config_int(config, ("num_hidden_layers", "n_layer", "num_layers"))
        heads = _config_int(config, ("num_attention_heads", "n_head"))
        vocab = _config_int(config, ("vocab_size",))
        ffn = _config_int(config, ("intermediate_size", "n_inner", "ffn_dim"), default=4 * h) or 4 * h
        kv_heads = _config_int(config, ("num_key_value_heads",), default=heads) or heads
        head_dim = h // heads
        gated = hasattr(config, "intermediate_size")   # Llama-style SwiGLU has three MLP matrices
        attn = h * h * 2 + 2 * h * kv_heads * head_dim
        mlp = (3 if gated else 2) * h * ffn
        layer = attn + mlp + 2 * h
        final_norm = h
        if not gated:   # GPT-2 style: every linear and LayerNorm has a bias
            layer += (2 * h + 2 * kv_heads * head_dim) + (ffn + h) + 2 * h
            final_norm += h
        else:
            if getattr(config, "attention_bias", False):
                layer += 2 * h + 2 * kv_heads * head_dim
            if getattr(config, "mlp_bias", False):
                layer += 2 * ffn + h
        positions = _config_int(config, ("n_positions",), default=0) * h
        tied = bool(getattr(config, "tie_word_embeddings", False))
        embedding = vocab * h * (1 if tied else 2) + positions
        return cls(layers * layer + embedding + final_norm, layers, h, ffn, heads, vocab, layer, embedding)

    @classmethod
    def from_module(cls, model: nn.Module) -> "ModelShape":
        """From a module: its HF config when it has one (with exact parameter counts), else its layers."""
        num_params = sum(p.numel() for p in model.parameters())
        config = getattr(model, "config", None)
        if config is not None and _config_int(config, ("hidden_size", "n_embd", "d_model"), default=0):
            shape = cls.from_config(config)
            embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
            head = getattr(model, "lm_head", None)
            if isinstance(head, nn.Linear) and not _shares_storage(head.weight, model):
                embedding += head.weight.numel()
            layer = (num_params - embedding) // max(1, shape.num_layers)
            return cls(num_params, shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads,
                       shape.vocab_size, layer, embedding)
        # A plain module: the largest ModuleList is the layer stack; the widest Linear input is the width.
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        hidden = max((m.in_features for m in linears), default=1)
        ffn = max((m.out_features for m in linears), default=hidden)
        stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = max((len(s) for s in stacks), default=max(1, len(linears)))
        embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
        return cls(num_params, layers, hidden, ffn, 0, vocab, (num_params - embedding) // max(1, layers), embedding)


def _shares_storage(weight: torch.Tensor, model: nn.Module) -> bool:
    return any(m.weight is weight for m in model.modules() if isinstance(m, nn.Embedding))


def _config_int(config: Any, names: Tuple[str, ...], default: Optional[int] = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    if default is None:
        raise ValueError(f"model config {type(config).__name__} has none of {list(names)}; the cost model needs "
                         "them (pass a ModelShape instead)")
    return default


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy does to memory and time, read from its items and their configs.

    Sharding follows how atorch implements it: zero1 = torch ZeroRedundancyOptimizer under DDP
    (Adam state / d, DDP still keeps its gradient buckets); zero2 = FSDP2 without resharding
    after forward (parameters stay gathered for backward, gradients and state / d); fsdp =
    FSDP2 resharding after forward (one block gathered at a time, the root unit -- embeddings
    and head -- stays gathered). `use_ds_zero` configs take the textbook ZeRO formulas.
    """

    data: int = 1
    tensor: int = 1
    compute_dtype_bytes: int = 4        # activations and matmuls (amp/half: 2)
    param_dtype_bytes: int = 4          # stored parameters (half: 2)
    optimizer_shard: int = 1            # zero1, zero2, fsdp
    grad_shard: int = 1                 # zero2, fsdp
    param_shard: int = 1                # fsdp (and zero2's resting shards)
    fsdp2: Optional[str] = None         # "zero2" (params kept gathered) or "fsdp" (resharded) on torch FSDP2
    checkpoint: bool = False
    fused_attention: bool = False       # module_replace: sdpa, no b*heads*s^2 matrix
    trainable_fraction: float = 1.0     # lora
    fp8: bool = False
    ddp_buckets: bool = False           # a DDP wrapper keeps a flat copy of the gradients

    @classmethod
    def from_strategy(cls, strategy: StrategyLike, world_size: int, shape: ModelShape) -> "StrategyTraits":
        s = Strategy.from_any(strategy)
        dims = _parallel_dims(s, world_size)
        tensor = dims.get("tensor", 1) if "tensor_parallel" in s else 1
        data = dims.get("data", 1)
        names = set(s.names())
        amp = "amp_native" in names or "fp8" in names
        half = "half" in names
        sharder = next((n for n in ("fsdp", "zero2", "zero1") if n in names), None)
        deepspeed = sharder is not None and bool(_config_field(s.get(sharder).config, "use_ds_zero", False))
        shard = data if sharder else 1
        trainable = 1.0
        if "lora" in names:
            rank = _config_field(s.get("lora").config, "r", LORA_DEFAULT_RANK)
            trainable = min(1.0, 2 * rank / max(1, shape.hidden_size))
        grads_sharded = sharder in ("zero2", "fsdp")
        return cls(
            data=data, tensor=tensor,
            compute_dtype_bytes=2 if (amp or half) else 4, param_dtype_bytes=2 if half else 4,
            optimizer_shard=shard, grad_shard=shard if grads_sharded else 1,
            param_shard=shard if sharder == "fsdp" or (sharder == "zero2" and not deepspeed) else 1,
            fsdp2=sharder if grads_sharded and not deepspeed else None,
            checkpoint="checkpoint" in names, fused_attention="module_replace" in names,
            trainable_fraction=trainable, fp8="fp8" in names,
            ddp_buckets=data > 1 and not grads_sharded and not deepspeed)


def _config_field(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _parallel_dims(strategy: Strategy, world_size: int) -> Dict[str, int]:
    item = strategy.get("parallel_mode")
    if item is None or item.config is None:
        return {"data": world_size}
    config = item.config
    dims = getattr(config, "dims", None)
    if dims is None and isinstance(config, (tuple, list)) and config:
        dims = config[0]
    if not dims:
        return {"data": world_size}
    return {str(name): int(size) for name, size in dims}


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank peak memory and step time of one training step."""

    peak_memory_bytes: int
    step_time_s: float
    breakdown: Dict[str, float] = field(default_factory=dict, compare=False)

    def throughput(self, batch_size: int) -> float:
        """Predicted samples/s for a global batch of `batch_size`."""
        return batch_size / self.step_time_s if self.step_time_s > 0 else 0.0


def activation_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """Peak activation bytes of one rank's forward+backward (fitted coefficients, see module docstring)."""
    c = ACTIVATION_COEFFICIENTS[_coefficient_key(traits)]
    b, s, h, L = micro_batch, seq_len, shape.hidden_size, shape.num_layers
    bsf = b * s * shape.intermediate_size
    bas2 = 0.0 if traits.fused_attention or shape.num_heads == 0 else b * shape.num_heads * s * s
    bsh = b * s * h
    bsv = b * s * shape.vocab_size
    if traits.checkpoint:
        total = c["layer_bsh"] * L * bsh + c["bsh"] * bsh + c["bsf"] * bsf + c["bas2"] * bas2 + c["bsv"] * bsv
    else:
        total = L * (c["layer_bsh"] * bsh + c["layer_bsf"] * bsf + c["layer_bas2"] * bas2) + c["bsv"] * bsv + \
            c["bsh"] * bsh
    # Measured (tests/distributed/test_dry_run.py): atorch's tensor parallel (vocab-parallel head,
    # sharded heads and MLP) divides the per-rank activation peak by the tensor size.
    return total / traits.tensor


def _coefficient_key(traits: StrategyTraits) -> str:
    return ("fp32" if traits.compute_dtype_bytes == 4 else "bf16") + ("_checkpoint" if traits.checkpoint else "")


def estimate(model_or_config: Union[nn.Module, Any, ModelShape], strategy: StrategyLike, batch_size: int,
             seq_len: int, world_size: int, device: Union[str, torch.device] = "cpu",
             profile: Optional[Mapping[str, float]] = None) -> Estimate:
    """Predict (per-rank peak memory, step time) of `strategy` for a *global* batch of `batch_size`.

    `model_or_config` is a module, a transformers config or a `ModelShape`. `profile` overrides
    the device rates of `DEVICE_PROFILES[device type]`.
    """
    if batch_size <= 0 or seq_len <= 0 or world_size <= 0:
        raise ValueError(f"batch_size={batch_size}, seq_len={seq_len}, world_size={world_size} must all be > 0")
    shape = _shape_of(model_or_config)
    traits = StrategyTraits.from_strategy(strategy, world_size, shape)
    device_type = torch.device(device).type if not isinstance(device, str) else torch.device(device).type
    rates = dict(DEVICE_PROFILES.get(device_type, DEVICE_PROFILES["cuda"]))
    rates.update(profile or {})

    micro = max(1, batch_size // traits.data)
    memory = memory_breakdown(shape, traits, micro, seq_len)
    time = time_breakdown(shape, traits, micro, seq_len, rates)
    peak = int(sum(memory.values()))
    return Estimate(peak, sum(time.values()), {**{f"mem_{k}": v for k, v in memory.items()},
                                               **{f"time_{k}": v for k, v in time.items()}})


def _shape_of(obj: Any) -> ModelShape:
    if isinstance(obj, ModelShape):
        return obj
    if isinstance(obj, nn.Module):
        return ModelShape.from_module(obj)
    return ModelShape.from_config(obj)


def memory_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> Dict[str, float]:
    """Per-rank bytes by kind: the ZeRO formulas, FSDP2's gathered units, and the fitted activations."""
    t = traits.tensor
    # atorch's tensor_parallel shards the embeddings and the LM head too (norms are negligible).
    params_per_rank = shape.num_params / t
    trainable = params_per_rank * traits.trainable_fraction
    pbytes = traits.param_dtype_bytes
    # half keeps gradients and Adam state in the parameter dtype; everything else in fp32.
    out = {"params": params_per_rank * pbytes / traits.param_shard,
           "grads": trainable * pbytes / traits.grad_shard,
           "optimizer": trainable * (ADAM_STATE_BYTES_PER_PARAM * pbytes / 4) / traits.optimizer_shard,
           "activations": activation_bytes(shape, traits, micro_batch, seq_len)}
    if traits.compute_dtype_bytes < pbytes and traits.fsdp2 is None:
        # Autocast keeps low-precision copies of the matmul weights for backward (fitted bytes/parameter).
        coef = ACTIVATION_COEFFICIENTS[_coefficient_key(traits)].get("matmul_params", 0.0)
        out["weight_casts"] = coef * (params_per_rank - shape.embedding_params / t / 2)
    if traits.ddp_buckets:
        out["ddp_buckets"] = trainable * pbytes
    if traits.fsdp2 is not None:
        gathered_bytes = traits.compute_dtype_bytes if traits.compute_dtype_bytes < pbytes else pbytes
        root = shape.embedding_params / t
        block = shape.layer_params / t
        if traits.fsdp2 == "zero2":   # every unit stays gathered from its forward to its backward
            out["gathered_params"] = params_per_rank * gathered_bytes
        else:                          # the root unit stays gathered; blocks: the current one and a prefetch
            out["gathered_params"] = (root + 2 * block) * gathered_bytes
        # Reduce-scatter of the largest unit: its unsharded fp32 gradients and the flat send buffer.
        out["reduce_scatter"] = 2 * max(root, block) * 4
    return out


def time_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                   rates: Mapping[str, float]) -> Dict[str, float]:
    """Per-step seconds by kind: compute, framework overhead and communication (not overlapped)."""
    tokens = micro_batch * seq_len
    L, h, t, d = shape.num_layers, shape.hidden_size, traits.tensor, traits.data
    matmul_params = shape.num_params - shape.embedding_params / 2     # the LM head multiplies, lookups do not
    # 2N forward + 2N backward (activations) + 2N backward (weights, trainable only), attention 12*L*s*h.
    weight_grad = 2 * matmul_params * traits.trainable_fraction
    flops = tokens * ((4 * matmul_params + weight_grad) / t + 12 * L * seq_len * h / t)
    if traits.checkpoint:
        flops += tokens * (2 * (shape.num_params - shape.embedding_params) / t + 4 * L * seq_len * h / t)
    rate = rates["flops_bf16"] if traits.compute_dtype_bytes == 2 else rates["flops_fp32"]
    if traits.fp8:
        rate *= 1.6
    compute = flops / rate
    overhead = rates["step_overhead_s"] + L * rates["layer_overhead_s"] * (1.5 if traits.checkpoint else 1.0)
    bw, lat = rates["comm_bytes_per_s"], rates["comm_latency_s"]
    comm = 0.0
    collectives = 0
    grad_bytes = shape.num_params / t * traits.trainable_fraction * 4
    if d > 1:
        ring = (d - 1) / d
        if traits.param_shard > 1:        # FSDP: all-gather forward, all-gather backward, reduce-scatter
            comm += 3 * ring * grad_bytes / bw
            collectives += 3 * L
        else:                             # DDP / ZeRO-1/2: one all-reduce volume (reduce-scatter + all-gather)
            comm += 2 * ring * grad_bytes / bw
            collectives += max(1, math.ceil(grad_bytes / 25e6)) * (2 if traits.optimizer_shard > 1 else 1)
    if t > 1:                             # Megatron TP: 2 all-reduces forward + 2 backward per layer
        act = micro_batch * seq_len * h * traits.compute_dtype_bytes
        comm += 4 * L * 2 * (t - 1) / t * act / bw
        collectives += 4 * L
    return {"compute": compute, "overhead": overhead, "communication": comm + collectives * lat}
