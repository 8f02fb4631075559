"""Step time of one training step: FLOPs / measured rate + per-layer overhead + communication."""

from __future__ import annotations

import math
from typing import Dict, Mapping

from atorch.auto.cost_model.shape import ModelShape
from atorch.auto.cost_model.traits import StrategyTraits

# The device rates the step-time model divides by. "cpu" is measured (calibration script);
# the GPU entry is a datasheet-derived guess (no GPU was available to calibrate on) and only
# its ratios matter for ranking.
DEVICE_PROFILES: Dict[str, Dict[str, float]] = {
    "cpu": {"flops_fp32": 3.91e10, "flops_bf16": 6.65e10, "layer_overhead_s": 6.86e-3, "step_overhead_s": 0.0,
            "comm_bytes_per_s": 1.02e9, "comm_latency_s": 1.43e-3},
    "cuda": {"flops_fp32": 5.0e13, "flops_bf16": 4.0e14, "layer_overhead_s": 2.0e-4, "step_overhead_s": 2.0e-3,
             "comm_bytes_per_s": 1.5e11, "comm_latency_s": 2.0e-5},
}


def time_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                   rates: Mapping[str, float]) -> Dict[str, float]:
    """Per-step seconds by kind: compute, framework overhead and communication (not overlapped)."""
    tokens = micro_batch * seq_len
    L, h, t, d = shape.num_layers, shape.hidden_size, traits.tensor, traits.data
    # The LM head multiplies, lookups do not; a mixture of experts multiplies its top-k experts only.
    matmul_params = shape.compute_params - shape.embedding_params / 2
    # 2N forward + 2N backward (activations) + 2N backward (weights, trainable only), attention
    # 12*L*s*(heads x head_dim).
    weight_grad = 2 * matmul_params * traits.trainable_fraction
    q = shape.q_dim
    flops = tokens * ((4 * matmul_params + weight_grad) / t + 12 * L * seq_len * q / t)
    if traits.checkpoint:
        flops += tokens * (2 * (shape.compute_params - shape.embedding_params) / t + 4 * L * seq_len * q / t)
    rate = rates["flops_bf16"] if traits.compute_dtype_bytes == 2 else rates["flops_fp32"]
    if traits.fp8:
        rate *= 1.6
    # compute_time_factor (e.g. compile's measured compiled/eager ratio) scales what runs inside
    # the model, kernels and per-layer framework overhead alike; communication is unaffected.
    compute = flops / rate * traits.compute_time_factor
    overhead = rates["step_overhead_s"] + \
        L * rates["layer_overhead_s"] * (1.5 if traits.checkpoint else 1.0) * traits.compute_time_factor
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
