"""Per-rank memory of one training step, by backend: model states, buffers, activations, the peak.

Replicated (DDP, torch ZeRO-1, tensor/pipeline stages), torch FSDP2, or DeepSpeed ZeRO (a
half-precision module with fp32 master partitions); CPU offload moves states to `host_*`
entries. The peak (`peak_bytes`) is what is always held plus the largest of the step's moments.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

from atorch.auto.cost_model.activations import (activation_bytes, block_activation_bytes, last_stage_bytes,
                                                loss_buffer_bytes, loss_softmax_bytes)
from atorch.auto.cost_model.shape import ModelShape, _largest_param_elements, _parameter_sizes
from atorch.auto.cost_model.traits import (StrategyTraits, head_trains, lora_expert_weights, lora_params,
                                           lora_saved_leaves, precision_mode)

ADAM_STATE_BYTES_PER_PARAM = 8       # exp_avg + exp_avg_sq in fp32 (other optimizers: `traits.optimizer`)

# What DeepSpeed allocates with atorch's engine configs (checked against DeepSpeed 0.19 in
# tests/distributed/test_memory_model.py): the ZeRO-1/2 reduce bucket and ZeRO-3's contiguous
# reduce buffer, both `reduce_bucket_size` elements in the module's dtype (atorch derives it from
# the model: `_ds_config.bucket_elements`; DeepSpeed's own default is 5e8); ZeRO-3's prefetch.
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
DS_STAGE3_PREFETCH_ELEMENTS = 50_000_000
# ZeRO-3 keeps every parameter smaller than this whole on every rank (DeepSpeed's default
# `stage3_param_persistence_threshold`): norms and biases, and every parameter of a tiny model.
DS_STAGE3_PERSISTENCE_ELEMENTS = 100_000


def _ds_persistent_elements(shape: ModelShape, threshold: int = DS_STAGE3_PERSISTENCE_ELEMENTS) -> int:
    """Elements ZeRO-3 keeps whole on every rank: the parameters below the persistence threshold."""
    return sum(elements * count for elements, count in _parameter_sizes(shape) if elements < threshold)


# Entries of `memory_breakdown` that are model states (the ZeRO paper's "model states"), and
# those that stay allocated from one step to the next (what a rank holds once a backward pass
# has finished and its activations are freed); the others exist only during part of a step.
MODEL_STATE_KEYS = ("params", "grads", "master", "optimizer")
RESIDENT_KEYS = MODEL_STATE_KEYS + ("ddp_buckets", "ds_reduce_buffer", "grad_fp32", "ds_persistent_params",
                                    "ds_offload_buffers", "ds_offload_host_buffers", "pipeline_buffers")


# The moments of a step, each a set of breakdown entries alive together; everything in no
# phase is held all the time. Gradients are set to None by zero_grad, so none exist during the
# next forward. Backward frees activations as it creates gradients, block by block: with a
# stack of similar blocks their sum is largest at one end, so backward is checked at its start
# (all activations, the loss freed) and at its end (all gradients).
# Under gradient accumulation the gradients of the earlier micro-steps live through the later
# micro-steps' forward and backward (`accumulated_grads`).
FORWARD_END_KEYS = ("activations", "lora_expert_copies", "loss_softmax", "loss_buffers", "weight_casts",
                    "gathered_params", "gathered_blocks", "ds_reduce_bucket", "accumulated_grads")
# The last block's all-gather in forward, before the LM head's logits and loss exist: FSDP2 holds
# the unit it gathers twice (its flat all-gather output and the unsharded parameters copied out of
# it) and keeps the previous unit's flat output until this gather is issued, next to the gathered
# root (`forward_gather`: the second copy and the previous output). Measured on 2 CPU ranks (the
# live storages at the peak); it decides the peak of LoRA + FSDP2, whose backward reduces no
# base-weight gradients.
FORWARD_GATHER_KEYS = ("activations", "lora_expert_copies", "weight_casts", "gathered_params", "gathered_blocks",
                       "forward_gather", "ds_reduce_bucket", "accumulated_grads")
# A block's backward: its unsharded gradients and their reduce-scatter copy (`unit_grads`), a
# checkpointed block rebuilt, FSDP2's root unit holding the LM head's unsharded gradient until the
# root reduces last.
BACKWARD_KEYS = ("weight_casts", "gathered_params", "ds_reduce_bucket", "unit_grads", "recompute", "held_root_grads",
                 "lora_expert_backward")
# The first block's backward: every activation, the next block prefetched (FSDP2 resharding after
# forward), every block still gathered (FSDP2 without resharding, `gathered_blocks`).
BACKWARD_START_KEYS = ("activations", "lora_expert_copies", "accumulated_grads", "prefetch",
                       "gathered_blocks") + BACKWARD_KEYS
# The last blocks' backward: the gradients that exist by then (`backward_grads`: all of them, but
# under FSDP2 only the shards of the blocks already reduced, next to the prefetch; the root's reduce last).
BACKWARD_END_KEYS = ("backward_grads",) + BACKWARD_KEYS
# The tied embedding's backward, the last of backward: what a model whose LM head shares the input embedding's
# weight holds there (`_sums_tied_head`), next to what earlier micro-steps left.
TIED_EMBEDDING_KEYS = ("tied_embedding_backward", "accumulated_grads")
# After backward: the root unit's reduce-scatter; DeepSpeed's fp32 gradient copy for the step.
GRADIENT_PHASE_KEYS = ("grads", "reduce_scatter", "step_grad_fp32")
# The optimizer step: the gradients and the step's own temporaries (`optimizer_step`).
STEP_PHASE_KEYS = ("grads", "step_grad_fp32", "optimizer_step")
PHASES = (FORWARD_GATHER_KEYS, FORWARD_END_KEYS, BACKWARD_START_KEYS, BACKWARD_END_KEYS, TIED_EMBEDDING_KEYS,
          GRADIENT_PHASE_KEYS, STEP_PHASE_KEYS)
# Entries of the activation phases (forward and backward), for callers that want them summed.
ACTIVATION_PHASE_KEYS = tuple(dict.fromkeys(FORWARD_GATHER_KEYS + FORWARD_END_KEYS + BACKWARD_KEYS +
                                            ("prefetch", "tied_embedding_backward")))


def peak_bytes(breakdown: Mapping[str, float], phases: Optional[Tuple[Tuple[str, ...], ...]] = None) -> int:
    """Per-rank device peak: what is always held + the largest of the step's moments (`PHASES`).

    Checked against torch's FSDPMemTracker at 1B-7B (benchmarks/memory_model.py) and measured
    bytes on 2 ranks. `host_*` entries (CPU offload) are not device memory. `phases` restricts
    the moments considered (e.g. `PHASES[:-1]`: forward and backward only).
    """
    device = {k: v for k, v in breakdown.items() if not k.startswith("host_")}
    in_a_phase = {k for keys in PHASES for k in keys}
    always = sum(v for k, v in device.items() if k not in in_a_phase)
    return int(always + max(sum(device.get(k, 0.0) for k in keys) for keys in (phases or PHASES)))


def model_state_bytes(breakdown: Mapping[str, float]) -> float:
    """Parameters, gradients, fp32 master weights and optimizer state on the device (the paper's model states)."""
    return sum(breakdown.get(k, 0.0) for k in MODEL_STATE_KEYS)


def resident_bytes(breakdown: Mapping[str, float]) -> float:
    """Device bytes held right after a backward pass: model states and the buffers that outlive a step."""
    return sum(breakdown.get(k, 0.0) for k in RESIDENT_KEYS)


def stage_params(shape: ModelShape, traits: StrategyTraits) -> float:
    """Parameters of the heaviest pipeline stage (the whole model without a pipeline), before tensor sharding.

    The blocks are balanced over the stages (`modules/pipeline/partition.py`), so the heaviest
    stage holds ceil(layers / stages) blocks, plus the input embeddings (first stage) or the LM
    head (last). A tied head is one matrix with the embedding, yet each end stage holds it whole.
    """
    p = traits.pipeline
    if p <= 1:
        return float(shape.num_params)
    head = shape.vocab_size * shape.hidden_size
    blocks = -(-shape.num_layers // p) * shape.layer_params
    return max(shape.num_params / p, blocks + max(_input_embedding_params(shape), head))


def _input_embedding_params(shape: ModelShape) -> int:
    """The token (and learned position) embeddings: `embedding_params` without an untied LM head."""
    return shape.embedding_params - (0 if shape.tied_embeddings else shape.vocab_size * shape.hidden_size)


def tensor_replicated_params(shape: ModelShape) -> float:
    """Parameters tensor parallelism keeps whole on every rank: what the model's own plan leaves whole
    where the shape was read off a model that has one; else by formula, learned position embeddings
    (GPT-2's `wpe`), the norms, and the biases of row-parallel linears (added after the reduction)."""
    if shape.tensor_whole_params >= 0:
        return float(shape.tensor_whole_params)
    positions = max(0, _input_embedding_params(shape) - shape.vocab_size * shape.hidden_size)
    h = shape.hidden_size
    # Per block: two norms (Llama's RMSNorm: a weight; GPT-2's LayerNorm: weight and bias, and the
    # attention's and the MLP's output-projection biases); then the final norm.
    per_block, final = (2 * h, h) if shape.gated else (6 * h, 2 * h)
    return float(positions + shape.num_layers * per_block + final)


def memory_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                     device_type: str = "cpu") -> Dict[str, float]:
    """Per-rank bytes by kind, for the backend the traits describe.

    - replicated (DDP, torch ZeRO-1, tensor/pipeline stages): parameters, gradients and Adam
      state in the parameter dtype (`half`: 2 bytes, else fp32); torch ZeRO-1 splits the Adam
      state; DDP adds its flat gradient buckets; autocast adds half copies of the weights.
    - torch FSDP2: sharded fp32 parameters, gradients (reduced in fp32) and Adam state; the
      gathered units (in the mixed-precision dtype) and one reduce-scatter buffer on top.
    - DeepSpeed ZeRO: the module itself in the half dtype under bf16/fp16 (sharded at stage 3),
      fp32 master partitions and Adam state / data ranks, the partition's gradients in the module
      dtype and their fp32 copy for the step, DeepSpeed's reduce bucket (500M elements by default).
    - LoRA: frozen base weights have no gradients or optimizer state; adapters do.
    - CPU offload (on a GPU): the offloaded states move to `host_*` entries, outside the peak.
    """
    t = traits.tensor
    # atorch's tensor_parallel shards the token embeddings and the LM head too; what it leaves
    # whole on every rank is counted once per rank.
    stage = stage_params(shape, traits)
    whole = min(tensor_replicated_params(shape), stage) if t > 1 else 0.0
    base = (stage - whole) / t + whole
    adapters = lora_params(shape, traits, tensor=t) / traits.pipeline
    params_per_rank = base + adapters
    # Without LoRA: every parameter but those the user froze (spread evenly over the stages and shards).
    trainable = adapters if traits.lora_rank else params_per_rank * (1 - shape.frozen_params / max(1, shape.num_params))
    if traits.sharding == "deepspeed":
        out = _deepspeed_states(shape, traits, params_per_rank, trainable)
    elif traits.sharding == "fsdp2":
        out = _fsdp2_states(shape, traits, params_per_rank, trainable)
    else:
        out = _replicated_states(shape, traits, params_per_rank, trainable)
    if "grads" in out:
        out.setdefault("backward_grads", out["grads"])
    if traits.optimizer.step_temporaries:
        # Plain SGD updates in place. DeepSpeed's CPU Adam (offload) steps in place in host memory.
        if traits.sharding != "deepspeed":
            out["optimizer_step"] = _torch_adam_step_bytes(shape, traits, trainable, device_type)
        elif not traits.ds_offload_optimizer:
            out["optimizer_step"] = _deepspeed_step_bytes(shape, traits, trainable, device_type)
    if traits.accumulation_steps > 1 and traits.pipeline_engine != "deepspeed":
        out["accumulated_grads"] = _accumulated_grad_bytes(traits, trainable)
    if traits.pipeline_engine == "native":
        # torch.distributed.pipelining keeps a buffer per micro-batch for what crosses the stage
        # boundary (the hidden states in, or their gradients out), allocated once.
        out["pipeline_buffers"] = float(traits.pipeline_chunks * micro_batch * seq_len * shape.hidden_size
                                        * traits.compute_dtype_bytes)
    out["activations"] = _stage_activations(shape, traits, micro_batch, seq_len)
    if traits.pipeline_engine is None:
        # The loss's saved softmax is freed by the loss's backward, before any block's backward.
        out["loss_softmax"] = loss_softmax_bytes(shape, traits, micro_batch, seq_len)
        out["activations"] -= out["loss_softmax"]
    head_grad = 0.0
    if head_trains(shape, traits):
        # The LM head's whole (unsharded) weight gradient, in the dtype backward produces it
        # (the compute dtype under FSDP2/DeepSpeed mixed precision); under autocast the half
        # gradient of the cast weight is accumulated into the fp32 one.
        head = shape.head_params / t
        gbytes = traits.storage_bytes if traits.sharding != "fsdp2" else min(traits.compute_dtype_bytes,
                                                                           traits.param_dtype_bytes)
        head_grad = head * (gbytes + (2 if precision_mode(traits) == "autocast" else 0))
    out["loss_buffers"] = loss_buffer_bytes(shape, traits, micro_batch, seq_len, head_grad)
    if precision_mode(traits) == "autocast":
        # Autocast caches a half copy of every matmul weight (the head's included) for the
        # forward, and each linear saves it for backward: 2 bytes a matmul parameter.
        lookups = (shape.embedding_params - shape.vocab_size * shape.hidden_size) / t
        out["weight_casts"] = 2.0 * max(0.0, params_per_rank - lookups)
    if traits.checkpoint:
        # Backward rebuilds one block at a time, while the gradients are being produced.
        out["recompute"] = block_activation_bytes(shape, traits, micro_batch, seq_len)
    copies, backward = _lora_expert_weight_bytes(shape, traits)
    if copies:
        out["lora_expert_copies"] = copies
    if backward:
        out["lora_expert_backward"] = backward
    if device_type != "cpu":
        for key in _host_keys(traits):
            if key in out:
                out[f"host_{key}"] = out.pop(key)
    return out


def _sums_tied_head(shape: ModelShape, traits: StrategyTraits) -> bool:
    """Whether backward sums the LM head's and the input embedding's gradients of one shared weight, holding three
    vocab x hidden gradients at the embedding's backward (`tied_embedding_backward`, phase `TIED_EMBEDDING_KEYS`).

    The input embedding and the LM head are one leaf, reached twice in the graph: autograd holds the head's weight
    gradient (computed first) in that leaf's input buffer until the embedding's arrives (computed last, the last op
    of backward), then sums the two out of place: head, embedding and sum, alive together. Measured with torch's
    trackers (FakeTensorMode, benchmarks/memory_model.py) at 1-2B with vocabularies of 128k-256k, where it is the
    peak the model missed (with checkpointing: Gemma 2 0.93x of it, Llama-3.2-1B 0.89x, both 0.78-0.82x in fp32).
    Not where pipeline stages hold their own copies of the weight, nor under DeepSpeed (not measured)."""
    return shape.tied_embeddings and head_trains(shape, traits) and traits.pipeline == 1


def _lora_expert_weight_bytes(shape: ModelShape, traits: StrategyTraits) -> Tuple[float, float]:
    """(bytes held in forward and at the start of backward, bytes a block's backward adds) for LoRA on fused
    expert weights.

    peft adapts a fused expert weight W (experts x d1 x d2) through a parametrization that builds the whole
    W' = W + scale * B @ A in W's dtype (one baddbmm) at each forward of the layer, and the experts' matmuls
    save views of it for backward: a full copy of every adapted expert weight per block and micro-batch in
    flight, held until that block's backward (measured: 1.00x the expert weight bytes, peft 0.21). Under
    autocast the matmuls save half casts of W' slices instead (`weight_casts` counts them as for the weight
    itself), and the block being run holds its fp32 W's. Checkpointed blocks keep none; backward rebuilds one
    block's. A block's backward builds the gradient of each whole W' (in W's dtype) before reducing it to A's
    and B's: the smaller ones while every copy of the block lives, the largest (the input projection, run first
    and differentiated last) after the others' copies are freed. Without these the model put LoRA on a
    Qwen3-MoE whose experts dominate at 0.66-0.82x of its measured peak."""
    adapted = lora_expert_weights(shape, traits)
    if not adapted:
        return 0.0, 0.0
    mode = precision_mode(traits)
    weight_bytes = 2 if mode == "half" or traits.param_dtype_bytes == 2 else 4
    sizes = sorted(float(experts * d1 * d2 * weight_bytes) for _, experts, d1, d2, _ in adapted)
    per_block = sum(sizes)
    if mode == "autocast":
        return per_block, sizes[-1]
    backward = max([sizes[-1] - (per_block - sizes[-1])] + sizes[:-1])
    if traits.checkpoint:
        return 0.0, per_block + backward
    blocks = max(-(-count // traits.pipeline) for *_, count in adapted)
    return per_block * blocks * _in_flight_micro_batches(traits), backward


def _host_keys(traits: StrategyTraits) -> Tuple[str, ...]:
    """Breakdown entries CPU offload keeps in host memory instead of the device's.

    - torch FSDP2 `CPUOffloadPolicy`: the sharded parameters, gradients and optimizer state (the
      optimizer steps on the host, its temporaries too), and the gradient shards accumulation
      reduce-scatters in each micro-step; units are gathered onto the device (and, synced once a
      step, so are their accumulated unsharded gradients).
    - DeepSpeed `offload_optimizer`: the fp32 master partition, Adam state and the fp32 gradient
      partition DeepSpeed reduces into; the half module (stages 1-2) or its partitions (stage 3)
      and the reduce bucket stay on the device. `offload_param` (stage 3) moves the partitions too.
    """
    if traits.sharding == "deepspeed":
        if not traits.ds_offload_optimizer and not traits.ds_offload_params:
            return ()
        moved = ("master", "optimizer", "grad_fp32", "ds_offload_host_buffers") if traits.ds_offload_optimizer else ()
        return moved + (("params",) if traits.ds_offload_params else ())
    if traits.cpu_offload:
        accumulated = ("accumulated_grads",) if traits.fsdp2_syncs_each_micro_step else ()
        return ("params", "grads", "backward_grads", "master", "optimizer", "grad_fp32", "step_grad_fp32",
                "optimizer_step") + accumulated
    return ()


# Temporaries of torch's Adam/AdamW step, in copies of the parameters' local tensors (measured
# with PeakMemoryTracker on real tensors: tests/unit/test_cost_model_moments.py). The foreach
# implementation (torch's default on CUDA) builds one list the size of every parameter (sqrt of
# the second moment). The per-tensor one (the default on CPU) holds 2 temporaries of the
# parameter it updates, FSDP2's DTensor shards included. (A tracker opened around the step alone
# once counted the shards its in-place updates return as 3 new copies of every shard, and this
# model copied that: torch FSDP2 candidates on CPU were predicted 1.1-1.7x over their measured
# peak and pruned while they fit.)
ADAM_FOREACH_COPIES = 1
ADAM_PER_TENSOR_COPIES = 2


def adam_step_bytes(trainable_elements: float, largest_elements: float, state_bytes: int, foreach: bool) -> float:
    """Bytes torch's Adam/AdamW step allocates beyond the parameters, gradients and its state.

    `trainable_elements`: the rank's trainable parameter elements; `largest_elements`: its largest
    single parameter tensor (the local shard under FSDP2); `state_bytes`: the moments' dtype size.
    """
    if foreach:
        return ADAM_FOREACH_COPIES * trainable_elements * state_bytes
    return ADAM_PER_TENSOR_COPIES * min(largest_elements, trainable_elements) * state_bytes


def _torch_adam_step_bytes(shape: ModelShape, traits: StrategyTraits, trainable: float, device_type: str) -> float:
    """`adam_step_bytes` for the rank's local optimizer (torch's default implementation on `device_type`)."""
    shard = traits.optimizer_shard
    widest = _largest_param_elements(shape)
    if traits.lora_rank:     # an adapter's A or B, or a copy LoRA trains whole (modules_to_save)
        saved = lora_saved_leaves(traits)
        widest = max([shape.hidden_size * traits.lora_rank,
                      *(n_in * n_out for leaf, n_in, n_out, _ in shape.linear_layers if leaf in saved)])
    largest = widest / traits.tensor / (traits.data if traits.sharding == "fsdp2" else 1)
    # CPU offload steps on host tensors: torch picks the per-tensor implementation there.
    on_host = device_type == "cpu" or traits.cpu_offload
    return adam_step_bytes(trainable / shard, largest, traits.param_dtype_bytes, foreach=not on_host)


# DeepSpeed ZeRO-3's default `sub_group_size`: its optimizer steps one flat sub-group at a time.
DS_SUB_GROUP_ELEMENTS = 1_000_000_000


def _deepspeed_step_bytes(shape: ModelShape, traits: StrategyTraits, trainable: float, device_type: str) -> float:
    """The user's torch optimizer stepping inside a DeepSpeed engine: on one flat fp32 master partition
    per group (ZeRO, and bf16 at stage 0), so torch's per-tensor temporaries (CPU) are two copies of the
    whole partition, not of the largest parameter (a ZeRO-2 bf16 step measured 4.9 MB above what was held,
    where only the fp32 gradient copy, 2.0 MB, was counted: DeepSpeed candidates were predicted to fit and
    ran out of memory); foreach (CUDA) holds one. In fp32 without ZeRO the optimizer steps the module's
    own parameters, as outside DeepSpeed."""
    state_shard = _ds_state_shard(traits)
    if state_shard == 1 and traits.storage_bytes == 4:
        return _torch_adam_step_bytes(shape, traits, trainable, device_type)
    flat = trainable / state_shard
    if traits.zero_stage >= 3:
        flat = min(flat, DS_SUB_GROUP_ELEMENTS)
    return adam_step_bytes(flat, flat, 4, foreach=device_type != "cpu")


def _replicated_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    pbytes = traits.param_dtype_bytes
    # torch's Adam keeps its two moments in the parameter dtype.
    out = {"params": params * pbytes, "grads": trainable * pbytes,
           "optimizer": trainable * traits.optimizer.state_copies * pbytes / traits.optimizer_shard}
    if traits.ddp_buckets:
        out["ddp_buckets"] = trainable * pbytes
    if _sums_tied_head(shape, traits):
        # The three head-sized gradients in the parameters' dtype (under autocast the head's half gradient is cast
        # back before autograd holds it) and every other gradient; no weight cast (freed with the blocks' backward).
        # Measured without a wrapper on one rank; DDP adds its buckets, held throughout. Accumulating, the earlier
        # micro-steps' gradients (`accumulated_grads`) include the leaf's own: a fourth head-sized one.
        head = shape.head_params / traits.tensor * pbytes
        out["tied_embedding_backward"] = 3 * head if traits.accumulation_steps > 1 else out["grads"] + 2 * head
    return out


def _fsdp2_grad_dtype_bytes(traits: StrategyTraits) -> int:
    """Bytes per element of FSDP2's gradients: MixedPrecisionPolicy(reduce_dtype=fp32) under amp (fp32 next
    to the fp32 shards), else the parameters' dtype."""
    return 4 if traits.autocast else traits.param_dtype_bytes


def fsdp2_rank0_share(shape: ModelShape, ranks: int) -> float:
    """A rank's parameter elements under atorch's FSDP2 over `ranks` (`_sharding.shard_elements`: each shard
    padded to whole rows of the dimension it splits) over an even share, num_params / ranks; 1.0 where the shape
    does not list its parameters."""
    from atorch.auto.opt_lib._sharding import shard_elements

    if ranks <= 1 or not shape.param_shapes:
        return 1.0
    total = sum(math.prod(dims) * count for dims, count in shape.param_shapes)
    local = sum(shard_elements(dims, ranks) * count for dims, count in shape.param_shapes)
    return max(1.0, local * ranks / max(1, total))


def _fsdp2_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    d, t, pbytes = traits.data, traits.tensor, traits.param_dtype_bytes
    gbytes = _fsdp2_grad_dtype_bytes(traits)
    # Rank 0's shards, where a first dimension does not divide by the data ranks (whole parameters only: the
    # tensor and pipeline splits change which dimensions FSDP2 sees).
    uneven = fsdp2_rank0_share(shape, d) if t == 1 and traits.pipeline == 1 else 1.0
    out = {"params": params * pbytes / d * uneven, "grads": trainable * gbytes / d * uneven,
           "optimizer": trainable * traits.optimizer.state_copies * pbytes / d * uneven}
    gathered_bytes = traits.compute_dtype_bytes if traits.compute_dtype_bytes < pbytes else pbytes
    root = shape.embedding_params / t
    block = shape.layer_params / t
    # The root unit stays gathered, and the block computing.
    out["gathered_params"] = min(params, root + block) * gathered_bytes
    if not traits.reshard_after_forward:
        # Every unit stays gathered from its forward to its backward, which reshards each block
        # after it: all of them at the first block's backward, none but the last at the end.
        out["gathered_blocks"] = params * gathered_bytes - out["gathered_params"]
    else:
        # In backward, the next block prefetched.
        out["prefetch"] = block * gathered_bytes
        out["forward_gather"] = (block + max(root, block)) * gathered_bytes
    if head_trains(shape, traits):
        # The root unit reduces last: the LM head's unsharded gradient lives through the blocks' backward.
        out["held_root_grads"] = shape.head_params / t * gathered_bytes
    # A unit's backward leaves its unsharded gradients (in the compute dtype) and copies them into
    # the flat fp32 reduce-scatter input. The largest unit (the root: embeddings and head) reduces
    # last, when the activations are gone; a block reduces while most activations are still alive
    # (checked against FSDPMemTracker at 1B-7B, benchmarks/memory_model.py).
    # FSDP2 reduces only the gradients that exist: under LoRA (frozen base weights) or with frozen
    # parameters a unit's unsharded gradients and its reduce-scatter input shrink to its trainable
    # share (spread evenly over the units, as `trainable` is).
    share = min(1.0, trainable / max(1.0, params))
    per_param = (gathered_bytes + 4) * share
    out["reduce_scatter"] = max(root, block) * per_param
    out["unit_grads"] = block * per_param
    # Sharded gradients exist only for the units already reduced: while the last block runs backward,
    # the later blocks' (the root reduces after it); one block earlier, one shard fewer next to the
    # prefetched last block. Counting every shard there put FSDP2 + checkpointing 1.13-1.21x over
    # its measured peak (GPT-2, GPT-NeoX at 4 x 16 tokens: the live storages at the peak, 2 CPU ranks).
    blocks = math.ceil(shape.num_layers / traits.pipeline)
    block_shard = block * gbytes / d * share
    later = max(0, blocks - 1) * block_shard
    if traits.reshard_after_forward and blocks >= 2:
        later += max(0.0, out["prefetch"] - block_shard)
    out["backward_grads"] = later
    if _sums_tied_head(shape, traits):
        # The three head-sized gradients in the compute dtype, the root unit still gathered, the last block's
        # reduce-scatter input not yet freed, and every block reduced to its shard (measured: resharding after
        # forward or not). Accumulating, the earlier micro-steps' gradients (`accumulated_grads`) stand for the
        # blocks' shards; offloaded shards are in host memory.
        head = shape.head_params / t
        tied = (root + 3 * head) * gathered_bytes + block * gbytes * share
        if traits.accumulation_steps == 1 and not traits.cpu_offload:
            tied += blocks * block_shard
        out["tied_embedding_backward"] = tied
    return out


def _deepspeed_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    from atorch.auto.opt_lib._ds_config import bucket_elements

    d, stage = traits.data, traits.zero_stage
    hbytes = traits.storage_bytes           # bf16/fp16 enabled: the module is half; else fp32
    # The user's reduce_bucket_size, else the one atorch derives from the trainable elements.
    bucket = traits.ds_bucket_elements or bucket_elements(int(trainable))
    shard = d if stage >= 1 else 1
    # Stage 0 (DeepSpeed 3D's default): in bf16 DeepSpeed's BF16_Optimizer still splits the fp32
    # master weights and the optimizer state over the data ranks, next to a whole half gradient
    # buffer; in fp16 its FP16_Optimizer keeps them whole; in fp32 the user's optimizer steps the
    # module itself, with no master copy (measured on 4 ranks, DeepSpeed 0.19).
    state_shard = _ds_state_shard(traits)
    out = {"params": params * hbytes / (d if stage >= 3 else 1),
           # the partition's reduced gradients, in the module dtype (stage 0: every gradient)
           "grads": trainable * hbytes / shard,
           # DeepSpeed clones its partition into fp32 master weights even when the module is fp32
           "master": trainable * 4 / state_shard,
           "optimizer": trainable * traits.optimizer.state_bytes_per_fp32_param / state_shard}
    if stage == 0 and hbytes == 4:
        del out["master"]
    largest = _largest_param_elements(shape) / traits.tensor
    if traits.ds_offload_optimizer:
        # The CPU Adam steps on a persistent fp32 gradient partition in host memory (measured on
        # 2 ranks, DeepSpeed 0.19). Stages 1-2 reduce straight into it (no half partition) and keep
        # a half copy of the partition on the host plus a gradient staging buffer of the largest
        # parameter on each side; stage 3 keeps its half gradient partition on the device.
        out["grad_fp32"] = trainable * 4 / shard
        if stage < 3:
            del out["grads"]
            out["ds_offload_host_buffers"] = (trainable / shard + largest) * hbytes
            out["ds_offload_buffers"] = largest * hbytes
    elif hbytes < 4:
        # The step upcasts the partition's gradients to fp32 and frees the copy afterwards (ZeRO-3
        # too: measured after the second backward, no fp32 gradient partition is alive).
        out["step_grad_fp32"] = trainable * 4 / state_shard
    if stage >= 3:
        # Parameters below the persistence threshold stay whole on every rank, next to the partitions.
        threshold = DS_STAGE3_PERSISTENCE_ELEMENTS if traits.ds_persistence_elements is None \
            else traits.ds_persistence_elements
        out["ds_persistent_params"] = min(_ds_persistent_elements(shape, threshold), params) * hbytes
        # The contiguous reduce buffer, allocated at start-up, and the layers gathered for compute.
        out["ds_reduce_buffer"] = bucket * hbytes
        unit = max(shape.embedding_params / 2, shape.layer_params) / traits.tensor
        prefetch = DS_STAGE3_PREFETCH_ELEMENTS if traits.ds_prefetch_elements is None else traits.ds_prefetch_elements
        out["gathered_params"] = min(params, unit + prefetch) * hbytes
    elif stage >= 1:
        # The reduce bucket of the backward pass (`reduce_bucket_size` elements), freed once the
        # gradients are reduced.
        out["ds_reduce_bucket"] = bucket * hbytes
    return out


def _ds_state_shard(traits: StrategyTraits) -> int:
    """Over how many ranks a DeepSpeed engine splits the fp32 master weights and optimizer state
    (`_deepspeed_states`: ZeRO's data ranks; at stage 0 too in bf16; else whole)."""
    return traits.data if traits.zero_stage >= 1 or (traits.storage_bytes < 4 and traits.bf16) else 1


def _accumulated_grad_bytes(traits: StrategyTraits, trainable: float) -> float:
    """Gradient bytes the earlier micro-steps of an accumulating step leave alive through the next
    micro-step's forward and backward (measured on 2 ranks: tests/distributed/test_memory_model_inputs.py).

    - replicated (DDP under `no_sync`, torch ZeRO-1): every parameter's `.grad`;
    - torch FSDP2 reduce-scattering every micro-step (the default): the sharded gradients, 1/data;
    - torch FSDP2 without gradient sync (`sync_each_micro_step=False`): every unit's unsharded
      gradient, accumulated in the reduce dtype (fp32 under amp), not 1/data of it;
    - DeepSpeed ZeRO-1 (and DeepSpeed's stage 0): the whole half `.grad` until the accumulation
      boundary; stages 2-3 reduce every micro-step into the rank's partition.
    """
    if traits.sharding == "fsdp2":
        grad_bytes = trainable * _fsdp2_grad_dtype_bytes(traits)
        return grad_bytes / traits.data if traits.fsdp2_syncs_each_micro_step else grad_bytes
    if traits.sharding == "deepspeed":
        if traits.ds_offload_optimizer and traits.zero_stage >= 1:
            return 0.0          # reduced into the fp32 partition on the host
        return trainable * traits.storage_bytes / (traits.data if traits.zero_stage >= 2 else 1)
    return trainable * traits.param_dtype_bytes


def _stage_activations(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """The activations of the rank that holds the most: every micro-batch in flight saves its blocks'; the
    last stage's own (the logits, the loss) count once per micro-batch it holds. Under 1F1B the first
    stage holds `stages` micro-batches and the last one only one (it runs each backward right after its
    forward): counting the logits `stages` times put 1F1B 1.22-1.39x over its measured peak when
    activations dominate."""
    per_micro_batch = activation_bytes(shape, traits, micro_batch, seq_len)
    in_flight = _in_flight_micro_batches(traits)
    if traits.pipeline_engine is None or traits.pipeline_schedule == "gpipe" or in_flight == 1:
        return per_micro_batch * in_flight
    blocks_only = per_micro_batch - last_stage_bytes(shape, traits, micro_batch, seq_len)
    return max(blocks_only * in_flight, per_micro_batch)


def _in_flight_micro_batches(traits: StrategyTraits) -> int:
    """Micro-batches whose activations a pipeline stage holds at once (1 without a pipeline)."""
    if traits.pipeline_engine is None:
        return 1
    if traits.pipeline_schedule == "gpipe":
        return traits.pipeline_chunks
    return min(traits.pipeline, traits.pipeline_chunks)
