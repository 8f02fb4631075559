"""Step time of one training step: FLOPs / measured rate + per-layer overhead + communication.

A step of one rank runs `passes` forward/backward passes of its pipeline stage (gradient
accumulation's micro-steps x a pipeline's micro-batches); a pipeline of p stages idles p - 1
micro-batch slots per schedule run (the bubble). Communication is not overlapped with compute.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple

from atorch.auto.cost_model.memory import stage_params
from atorch.auto.cost_model.shape import ModelShape
from atorch.auto.cost_model.traits import StrategyTraits, passes_per_step

# The device rates the step-time model divides by. "cpu" is measured (calibration script);
# the GPU entry is a datasheet-derived guess (no GPU was available to calibrate on) and only
# its ratios matter for ranking. Optional entries (`time_breakdown` reads them with defaults):
# "intra_node_bytes_per_s" and "ranks_per_node" (collectives of groups inside one node use the
# faster link), "host_bytes_per_s" (host <-> device copies of CPU offload; absent: host memory
# is the device's, as on a CPU) and "host_optimizer_params_per_s" (an optimizer step on the host).
DEVICE_PROFILES: Dict[str, Dict[str, float]] = {
    "cpu": {"flops_fp32": 3.91e10, "flops_bf16": 6.65e10, "layer_overhead_s": 6.86e-3, "step_overhead_s": 0.0,
            "comm_bytes_per_s": 1.02e9, "comm_latency_s": 1.43e-3},
    # PCIe 4.0 x16 (~25 GB/s); DeepSpeed's CPU Adam at ~1e9 parameters/s per rank (its paper's order).
    "cuda": {"flops_fp32": 5.0e13, "flops_bf16": 4.0e14, "layer_overhead_s": 2.0e-4, "step_overhead_s": 2.0e-3,
             "comm_bytes_per_s": 1.5e11, "comm_latency_s": 2.0e-5, "host_bytes_per_s": 2.5e10,
             "host_optimizer_params_per_s": 1.0e9},
}


def pipeline_bubble(traits: StrategyTraits) -> float:
    """A schedule of m micro-batches over p stages takes m + p - 1 micro-batch slots: (m + p - 1) / m.
    (`StrategyTraits.from_strategy` leaves `pipeline` at 1 unless a pipeline engine splits the model.)"""
    m = max(1, traits.pipeline_chunks)
    return (m + traits.pipeline - 1) / m if traits.pipeline > 1 else 1.0


def block_params(shape: ModelShape) -> float:
    """Parameters one token multiplies in one block: the non-embedding ones over the layers, of a
    mixture of experts only the top-k routed experts (`ModelShape.compute_params`)."""
    return (shape.compute_params - shape.embedding_params) / max(1, shape.num_layers)


def forward_backward_flops(tokens: int, seq_len: int, matmul_params: float, layers: int, q_dim: int, tensor: int,
                           trainable_fraction: float = 1.0) -> float:
    """FLOPs of one forward + backward of `tokens` (sequences of `seq_len`) through `layers` blocks
    multiplying `matmul_params` parameters in all, on one of `tensor` ranks splitting them: per token
    2N forward + 2N backward (activations) + 2N backward (weights, the trainable fraction only), and
    attention's 12 x seq_len x q_dim (heads x head_dim) per layer. The calibration's block probe
    divides by the same count (`calibration.shape_probe.block_flops`)."""
    weight_grad = 2 * matmul_params * trainable_fraction
    return tokens * ((4 * matmul_params + weight_grad) / tensor + 12 * layers * seq_len * q_dim / tensor)


def time_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                   rates: Mapping[str, float]) -> Dict[str, float]:
    """Per-step seconds by kind: compute, framework overhead and communication (not overlapped).

    `micro_batch`: rows one data rank processes per optimizer step (all its micro-steps and
    pipeline micro-batches together). A pipeline rank computes its heaviest stage's layers (the
    last: its blocks and the LM head) on those rows, stretched by the bubble.
    """
    tokens = micro_batch * seq_len
    L, t = shape.num_layers, traits.tensor
    layers = math.ceil(L / traits.pipeline)
    passes = passes_per_step(traits)
    stage = stage_params(shape, traits)
    bubble = pipeline_bubble(traits)
    # The LM head multiplies, lookups do not; a mixture of experts multiplies its top-k experts only.
    per_block = block_params(shape)
    matmul_params = layers * per_block + shape.embedding_params / 2
    q = shape.q_dim
    flops = forward_backward_flops(tokens, seq_len, matmul_params, layers, q, t, traits.trainable_fraction)
    if traits.checkpoint:
        flops += tokens * (2 * layers * per_block / t + 4 * layers * seq_len * q / t)
    rate = rates["flops_bf16"] if traits.compute_dtype_bytes == 2 else rates["flops_fp32"]
    if traits.fp8:
        rate *= 1.6
    # compute_time_factor (e.g. compile's measured compiled/eager ratio) scales what runs inside
    # the model, kernels and per-layer framework overhead alike; communication is unaffected.
    compute = flops / rate * traits.compute_time_factor * bubble
    # Framework overhead is per layer call: once per pass, each pass of the pipeline also waiting out the bubble.
    overhead = rates["step_overhead_s"] + layers * rates["layer_overhead_s"] * (1.5 if traits.checkpoint else 1.0) \
        * traits.compute_time_factor * passes * bubble
    comm, collectives = _communication(shape, traits, stage, tokens, layers, passes, rates)
    offload = _offload_seconds(traits, stage, passes, rates)
    return {"compute": compute, "overhead": overhead,
            "communication": comm + collectives * rates["comm_latency_s"] + offload}


def _bandwidth(rates: Mapping[str, float], group_ranks: int) -> float:
    """The link a group's collective runs over: the node's own when the whole group fits in one node."""
    per_node = rates.get("ranks_per_node", 0)
    if per_node and group_ranks <= per_node:
        return rates.get("intra_node_bytes_per_s", rates["comm_bytes_per_s"])
    return rates["comm_bytes_per_s"]


def _communication(shape: ModelShape, traits: StrategyTraits, stage: float, tokens: int, layers: int, passes: int,
                   rates: Mapping[str, float]) -> Tuple[float, int]:
    """(seconds moving bytes, number of collectives) of one step of a rank holding `stage` parameters.

    Data parallel: FSDP2 / ZeRO-3 gather parameters in every pass (forward and backward) and
    reduce-scatter in every accumulation micro-step (once per step with `sync_each_micro_step=False`;
    DeepSpeed ZeRO-2/3 reduce every pass); DDP and ZeRO-1/2 reduce once per step (DDP every
    micro-step with `sync_each_micro_step=True`). Tensor parallel:
    Megatron's 2 all-reduces forward and 2 backward per layer and pass. Pipeline: each micro-batch's
    activations forward and their gradients back, once per stage boundary.
    """
    t, d, p = traits.tensor, traits.data, traits.pipeline
    comm = 0.0
    collectives = 0
    grad_bytes = stage / t * traits.trainable_fraction * 4
    act = tokens * shape.hidden_size * traits.compute_dtype_bytes   # the step's hidden states, one layer's worth
    if d > 1:
        ring = (d - 1) / d
        bw = _bandwidth(rates, d * t * p)     # data ranks lie outermost: the group spans the whole job
        reductions = _gradient_reductions(traits, passes)
        if traits.param_shard > 1:        # FSDP: all-gather forward, all-gather backward, reduce-scatter
            comm += (2 * passes + reductions) * ring * grad_bytes / bw
            collectives += (2 * passes + reductions) * layers
        else:                             # DDP / ZeRO-1/2: one all-reduce volume (reduce-scatter + all-gather)
            comm += 2 * reductions * ring * grad_bytes / bw
            collectives += reductions * max(1, math.ceil(grad_bytes / 25e6)) * (2 if traits.optimizer_shard > 1 else 1)
    if t > 1:                             # Megatron TP: 2 all-reduces forward + 2 backward per layer
        comm += 4 * layers * 2 * (t - 1) / t * act / _bandwidth(rates, t)
        collectives += 4 * layers * passes
    if p > 1:                             # a micro-batch's boundary activations out, their gradients back
        comm += 2 * act / _bandwidth(rates, t * p) * pipeline_bubble(traits)
        collectives += 2 * passes
    return comm, collectives


def _gradient_reductions(traits: StrategyTraits, passes: int) -> int:
    """Gradient reductions over the data ranks per step: DeepSpeed ZeRO-2/3 reduce every pass, torch FSDP2
    every accumulation micro-step (unless `sync_each_micro_step=False`), DDP and torch ZeRO-1 once per
    step (every micro-step with `sync_each_micro_step=True`)."""
    if traits.sharding == "deepspeed" and traits.zero_stage >= 2:
        return passes
    if traits.fsdp2_syncs_each_micro_step or (traits.sharding != "deepspeed" and traits.accumulation_sync):
        return max(1, traits.accumulation_steps)
    return 1


def _offload_seconds(traits: StrategyTraits, stage: float, passes: int, rates: Mapping[str, float]) -> float:
    """Host <-> device copies and the host's optimizer step of CPU offload (0 where the host is the device).

    torch FSDP2's CPUOffloadPolicy: the parameter shard copied to the device for each pass's
    gathers, its gradient shard back after each reduce-scatter (every accumulation micro-step by
    default), the optimizer stepping on the host. DeepSpeed's
    offload_optimizer: the gradient partition to the host, the updated half partition back, CPU
    Adam on the host; offload_param: the half parameter partition to the device for each gather.
    """
    host_bw = rates.get("host_bytes_per_s")
    if not host_bw or not (traits.cpu_offload or traits.ds_offload_optimizer or traits.ds_offload_params):
        return 0.0
    shard = stage / traits.tensor / max(1, traits.data)
    trainable = shard * traits.trainable_fraction
    optimizer_rate = rates.get("host_optimizer_params_per_s", 0.0)
    step = trainable / optimizer_rate if optimizer_rate else 0.0
    if traits.cpu_offload:
        copies = shard * traits.param_dtype_bytes * 2 * passes + trainable * 4 * _gradient_reductions(traits, passes)
        return copies / host_bw + step
    seconds = 0.0
    if traits.ds_offload_optimizer:
        seconds += (trainable * 4 + shard * traits.compute_dtype_bytes) / host_bw + step
    if traits.ds_offload_params:
        seconds += shard * traits.compute_dtype_bytes * 2 * passes / host_bw
    return seconds
