"""Bytes a training step saves for backward (a block, the final norm, the loss), per rank.

Activations are counted, not fitted: the bytes per token that a Hugging Face decoder block
saves for backward, tensor by tensor, in each precision mode (listed with
torch.autograd.graph.saved_tensors_hooks on Llama and GPT-2 blocks, eager and sdpa attention;
see `_block_saved_bytes`), and the loss's b*s*vocab buffers. Checked against measured peaks on
2 CPU ranks (tests/distributed/test_dry_run.py) and torch's trackers at 1B-7B
(benchmarks/memory_model.py).

A module or a transformers config gets its block's bytes measured by the activation probe
(`auto/activation_probe.py`) on its own first block; `shape_of` returns the shape with that scale.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from torch import nn

from atorch.auto.cost_model.shape import ModelShape, _config_key, _meta_model
from atorch.auto.cost_model.traits import StrategyTraits, head_trains, precision_mode

if TYPE_CHECKING:
    from atorch.auto.activation_probe import BlockProfile


def _block_saved_bytes(shape: ModelShape, mode: str, seq_len: int, fused_attention: bool,
                       fused_activation: bool = False, fused_norm: bool = False,
                       kv_cache: bool = False) -> Tuple[float, float]:
    """Bytes per token that one decoder block saves for backward: (replicated, tensor-sharded).

    Counted on Hugging Face's Llama and GPT-2 blocks (saved_tensors_hooks, one storage counted
    once). Replicated under Megatron tensor parallelism: the residual stream, the norms' inputs
    and outputs, the column-parallel inputs (and their autocast copies). Sharded: q, k, v, the
    attention output, the attention matrix and the MLP's intermediate tensors.

    Llama (RMSNorm, SwiGLU): fp32 saves x, norm(x), the q/k/v input, q, k, v, the attention
    output and the same three for the MLP half, plus gate, silu(gate), up and their product.
    Under autocast the norms stay fp32 (x and x*rsqrt saved in fp32), while q, k and v each save
    their own half copy of the shared input (activation casts are not cached; 5 copies a block).
    In half the norms save an fp32 upcast of their input. Eager attention saves the softmax
    output (fp32 under autocast and in half, plus its half copy) and k and v repeated to every
    head; sdpa saves k and v at their grouped-query width and no b*heads*s^2 matrix.
    GPT-2 (LayerNorm, GELU MLP): x, the qkv input, q, k, v, the attention output, x2, the MLP
    input, and five b*s*ffn tensors (Hugging Face's tanh GELU in Python ops keeps its input and
    three intermediates; `fused_activation`, module_replace's `nn.GELU(approximate="tanh")`,
    keeps only its input: two b*s*ffn tensors, 0.57x the block in half at GPT-2 XL's width; a
    model whose own activation is native, `ModelShape.python_gelu` False, keeps two as well).
    `fused_norm` (module_replace's `F.rms_norm`): in half, each norm keeps its normalized result
    in fp32 where Hugging Face's RMSNorm keeps it in half (+2 bytes a norm; same bytes in fp32
    and under autocast). Measured on CPU, where `F.rms_norm` runs as its composite.
    `kv_cache` (a training forward with Hugging Face's cache, no checkpointing): the cache's
    `torch.cat` copies k and v and attention saves the copies. Where q, k and v are views of one
    fused projection (GPT-2's c_attn) the projection stays saved through q, so the copies are 2 x
    kv more; with separate projections (Llama) they replace tensors that are then freed (measured:
    the same bytes with and without the cache). A model the activation probe ran with real
    parameters has its own block's figure instead (`ModelShape.kv_cache_elements`): GPT-NeoX's
    fused query_key_value output was saved only through v, which the copy replaces (-2 x hidden).
    """
    h, f, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    kv = (shape.kv_dim or h) if fused_attention else q
    matrix = 0.0 if fused_attention else seq_len * _attention_matrix_bytes(shape, mode)
    if shape.gated:
        qkvo = 2 * q + 2 * kv
        replicated = {"fp32": 4 * 6 * h, "autocast": 4 * 4 * h + 2 * 5 * h, "half": 4 * 2 * h + 2 * 4 * h}[mode]
        sharded = {"fp32": 4 * qkvo + 4 * 4 * f, "autocast": 2 * qkvo + 2 * 4 * f, "half": 2 * qkvo + 2 * 4 * f}[mode]
        if fused_norm and mode == "half":
            replicated += 2 * 2 * h
    else:
        ffn = 5 if shape.python_gelu and not fused_activation else 2      # b*s*ffn tensors the MLP keeps
        replicated = {"fp32": 4 * 4 * h, "autocast": 4 * 2 * h + 2 * 2 * h, "half": 2 * 4 * h}[mode]
        sharded = {"fp32": 4 * 4 * h + 4 * ffn * f, "autocast": 2 * 4 * h + 2 * ffn * f,
                   "half": 2 * 4 * h + 2 * ffn * f}[mode]
        if kv_cache:
            sharded += (4 if mode == "fp32" else 2) * 2 * (shape.kv_dim or h)
    return float(replicated), float(sharded + matrix)


# Bytes per head and token pair of eager attention's b x heads x s x s matrices, as counted on the formula's two
# blocks: Llama's softmax keeps its output in fp32 (`softmax(..., dtype=float32)`) and, under autocast and in
# half, a half copy for the matmul with v; GPT-2's softmax runs in the compute dtype, one half matrix in half,
# and under autocast an fp32 output (autocast's fp32 list) beside the half copy.
_ATTENTION_MATRIX_BYTES = {True: {"fp32": 4, "autocast": 6, "half": 6}, False: {"fp32": 4, "autocast": 6, "half": 2}}


def _attention_matrix_bytes(shape: ModelShape, mode: str) -> float:
    """Bytes per token pair (per sequence) of the formula's eager attention matrices, all heads: the quadratic part
    of `_block_saved_bytes` (sharded with the heads under tensor parallelism)."""
    return float(shape.num_heads * _ATTENTION_MATRIX_BYTES[shape.gated][mode])


def _frozen_inputs_bytes(shape: ModelShape, mode: str) -> Tuple[float, float]:
    """Bytes per token a block does *not* save when its base linears are frozen (LoRA): a frozen
    linear needs no input for a weight gradient. The q/k/v input stays (peft's default adapters
    on q and v, or GPT-2's c_attn, read it); the MLP input, the attention output and the MLP
    product are saved only for the frozen o/gate/up/down weights. Under autocast the three
    frozen q/k/v casts go too (the two adapters cast their own copies)."""
    h, f = shape.hidden_size, shape.intermediate_size
    nbytes = 4 if mode == "fp32" else 2
    replicated = nbytes * h + (2 * 3 * h if mode == "autocast" and shape.gated else 0)
    return float(replicated), float(nbytes * (shape.q_dim + f))


def _final_norm_saved_bytes(shape: ModelShape, mode: str, frozen_head: bool = False,
                            fused_norm: bool = False) -> float:
    """Bytes per token the final norm and the LM head's input save (replicated under tensor parallelism)."""
    h = shape.hidden_size
    if shape.gated:
        saved = {"fp32": 4 * 3 * h, "autocast": 4 * 2 * h + 2 * h, "half": 4 * h + 2 * 2 * h}[mode]
        if fused_norm and mode == "half":     # F.rms_norm keeps its normalized result in fp32
            saved += 2 * h
    else:
        saved = {"fp32": 4 * 2 * h, "autocast": 4 * h + 2 * h, "half": 2 * 2 * h}[mode]
    # A frozen head (LoRA) keeps no input for its weight gradient.
    return float(saved - ((4 if mode == "fp32" else 2) * h if frozen_head else 0))


def block_activation_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                           kv_cache: bool = False) -> float:
    """Bytes one decoder block saves for backward on one rank (what a checkpointed block rebuilds,
    without a cache: checkpointed blocks run with use_cache=False)."""
    mode = precision_mode(traits)
    # The cache's cost measured on the model's own block replaces the formula's (counted on GPT-2).
    cache_elements = shape.kv_cache_elements if kv_cache else None
    fused_attention = shape.fused_attention or (traits.fused_attention and shape.sdpa_capable)
    replicated, sharded = _block_saved_bytes(shape, mode, seq_len, fused_attention,
                                             traits.fused_activation, traits.fused_norm,
                                             kv_cache and cache_elements is None)
    if traits.lora_rank:
        frozen_replicated, frozen_sharded = _frozen_inputs_bytes(shape, mode)
        replicated, sharded = replicated - frozen_replicated, sharded - frozen_sharded
    # The probe's scale is measured on the block's linear part (`activation_probe`): the s x s matrices are not
    # scaled by it, they are counted as the formula has them plus what the model's own block keeps beyond.
    matrix = 0.0 if fused_attention else seq_len * _attention_matrix_bytes(shape, mode)
    saved = micro_batch * seq_len * (replicated + (sharded - matrix) / traits.tensor) * shape.activation_scale
    if fused_attention:     # a fused kernel that falls back to the math path keeps its s x s matrix (per head)
        saved += micro_batch * seq_len * seq_len * shape.sdpa_quadratic_bytes / traits.tensor
    else:
        saved += micro_batch * seq_len * (matrix + seq_len * shape.eager_quadratic(mode)) / traits.tensor
    if cache_elements is not None:
        # k, v and the projection they view are split over the tensor ranks with the heads.
        saved += micro_batch * seq_len * (4 if mode == "fp32" else 2) * cache_elements / traits.tensor
    return max(0.0, saved)


def activation_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """Bytes one rank's forward saves for backward: its blocks, the final norm and the loss's softmax.

    With activation checkpointing a block keeps only its input (the residual stream: fp32 unless
    the module computes in half). A pipeline stage runs its share of the blocks (the final norm
    and the loss are counted: the last stage has them).
    """
    mode = precision_mode(traits)
    tokens = micro_batch * seq_len
    blocks = math.ceil(shape.num_layers / traits.pipeline)
    if traits.checkpoint:
        per_block = 1.0 * tokens * (2 if mode == "half" else 4) * shape.hidden_size
    else:
        per_block = block_activation_bytes(shape, traits, micro_batch, seq_len,
                                           kv_cache=shape.kv_cache and not traits.kv_cache_off)
    return blocks * per_block + last_stage_bytes(shape, traits, micro_batch, seq_len)


def last_stage_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """What of `activation_bytes` only the last stage saves: the final norm and the loss's softmax, and
    under a pipeline schedule the logits it keeps for the micro-batch's backward (b*s*vocab in the
    compute dtype)."""
    mode = precision_mode(traits)
    tokens = micro_batch * seq_len
    frozen_head = bool(traits.lora_rank) and not head_trains(shape, traits)
    final = tokens * _final_norm_saved_bytes(shape, mode, frozen_head=frozen_head,
                                             fused_norm=traits.fused_norm)
    if traits.pipeline_engine is not None:
        final += tokens * shape.vocab_size / traits.tensor * traits.compute_dtype_bytes
    if shape.logit_softcapping:     # tanh's saved output, in the logits' dtype (measured on Gemma 2 at 2B)
        final += tokens * shape.vocab_size / traits.tensor * traits.compute_dtype_bytes
    return final + loss_softmax_bytes(shape, traits, micro_batch, seq_len)


def loss_softmax_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """The loss's saved fp32 softmax (log-softmax, or the vocabulary-parallel softmax slice)."""
    return micro_batch * seq_len * 4.0 * shape.vocab_size / traits.tensor


def loss_buffer_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                      head_grad: float) -> float:
    """The b*s*vocab buffers on top of the saved activations at the activation phase's peak.

    Hugging Face's loss (`ForCausalLMLoss`, as `atorch.auto.train_step` runs it: the model's
    output is dropped before backward): the log-softmax backward holds its saved output, the
    incoming gradient and its result, 2 x 4 bytes a logit beyond the saved softmax; then the LM
    head's backward holds the logits' gradient and the head's weight gradient (`head_grad`).
    atorch's tensor parallel: the vocabulary-parallel loss's forward holds the local logits, an
    fp32 copy and the shifted logits; with `gather_logits` (the default) the output hook then
    holds the local slice, the gathered list and the concatenated full logits (b*s*vocab in the
    compute dtype, twice). Its backward reuses the saved softmax as the gradient.
    """
    tokens = micro_batch * seq_len
    v, t, cb = shape.vocab_size, traits.tensor, traits.compute_dtype_bytes
    if traits.tensor_parallel and t > 1:
        upcast = 4 if cb < 4 else 0
        forward = tokens * v / t * (cb + upcast + 4)
        gather = tokens * v * cb * (2 + 1 / t) if traits.gather_logits else 0.0
        return max(forward, gather, head_grad)
    return max(tokens * v * 8.0, head_grad + tokens * v * (cb - 4))


# (config content, probe tokens) -> the activation probe's profile of that config's block.
_CONFIG_SCALES: "OrderedDict[Tuple[str, int], BlockProfile]" = OrderedDict()
_CONFIG_SCALES_MAX = 64


def _config_block_profile(config: Any, shape: ModelShape, seq_len: int) -> "BlockProfile":
    """The activation probe's profile of a transformers config's first block: its model built on the meta device
    and run under fake tensors (`activation_probe`; no memory, no compute) at three lengths in fp32 and in bf16,
    and a copy built on the CPU in a fake-tensor mode under autocast; cached per config content and probe length.
    An empty profile (scale 1.0) for any other config.

    The meta model runs eager attention, so the formula it is compared with counts the attention
    matrix too; the scale then corrects the linear rest of the block (q/k norms, parallel attention,
    non-gated MLPs, experts) for whichever attention the strategy uses, and what the block keeps per token
    pair beyond the formula's matrix is its `quadratic_extra` in each precision mode, counted where attention is
    not fused. With the config's `use_cache`, the block is also measured with the cache filled
    (`ModelShape.kv_cache_elements`). Costs 3-9 forwards of the first block at <= 128 tokens (fp32; bf16 and
    autocast where they can matter), 0.1-0.6 s for a 1-7B config here (2 cores), once per config.
    """
    from atorch.auto.activation_probe import FAKE_PROBE_TOKENS, BlockProfile, block_activation_profile

    key = _config_key(config)
    if key is None:
        return BlockProfile()
    cache_key = (key, max(1, min(int(seq_len), FAKE_PROBE_TOKENS)))
    if cache_key in _CONFIG_SCALES:
        _CONFIG_SCALES.move_to_end(cache_key)
        return _CONFIG_SCALES[cache_key]
    model = _meta_model(config, "counting the block activations of")
    if model is None:
        return BlockProfile()
    formula = _block_formula(dataclasses.replace(shape, fused_attention=False))
    # The extras of the other precision modes count only where attention is not fused: not for a config that
    # runs sdpa or flash attention itself.
    profile = block_activation_profile(model, cache_key[1], formula, kv_cache=shape.kv_cache, half_retry=True,
                                       half_extra=not shape.fused_attention)
    # Autocast only where the block keeps more or less than the formula in fp32 or in half. Where both match, so
    # does autocast: the formula's two blocks write attention the two ways there are (Llama's softmax kept in
    # fp32 beside a half copy, GPT-2's in the compute dtype, which autocast runs in fp32 beside the half copy),
    # and the probe skips a copy built on the CPU and three forwards (~0.2 s a 1B config).
    if any(extra for _, extra in profile.quadratic_extra) and not shape.fused_attention:
        autocast = _config_autocast_extra(config, cache_key[1], formula)
        profile = dataclasses.replace(profile, quadratic_extra=tuple(sorted(profile.quadratic_extra + autocast)))
    _CONFIG_SCALES[cache_key] = profile
    if len(_CONFIG_SCALES) > _CONFIG_SCALES_MAX:
        _CONFIG_SCALES.popitem(last=False)
    return profile


def _config_autocast_extra(config: Any, seq_len: int, formula: Callable[[int, str], float]
                           ) -> Tuple[Tuple[str, float], ...]:
    """(("autocast", bytes per sequence and squared token beyond the formula's matrix),) of a transformers config's
    first block under autocast, measured on its model built on the CPU in a fake-tensor mode (autocast has no
    region for the meta device); () when it cannot be built."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from atorch.auto.activation_probe import autocast_quadratic_extra

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = _meta_model(config, "counting the autocast attention of", device="cpu")
    if model is None:
        return ()
    return (("autocast", autocast_quadratic_extra(model, seq_len, formula, mode)),)


# config content -> `activation_probe.sdpa_quadratic_bytes` of its model built on the meta device with sdpa.
_CONFIG_SDPA: "OrderedDict[str, float]" = OrderedDict()


def _config_sdpa_quadratic_bytes(config: Any, shape: ModelShape) -> float:
    """What sdpa attention still saves per sequence and squared token in a transformers config's first block
    (`ModelShape.sdpa_quadratic_bytes`), measured under fake tensors and cached per config content; 0.0 for a
    model without sdpa attention (its eager matrix is the formula's) or any other config."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from atorch.auto.activation_probe import sdpa_quadratic_bytes

    key = _config_key(config)
    if key is None or not shape.sdpa_capable:
        return 0.0
    if key not in _CONFIG_SDPA:
        # Built in a fake-tensor mode on the CPU, not on the meta device: torch picks the attention kernel by the
        # device type, and on meta every kernel is the math path.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = _meta_model(config, "counting the sdpa attention of", attention="sdpa", device="cpu")
        _CONFIG_SDPA[key] = 0.0 if model is None else sdpa_quadratic_bytes(model, mode)
        if len(_CONFIG_SDPA) > _CONFIG_SCALES_MAX:
            _CONFIG_SDPA.popitem(last=False)
    _CONFIG_SDPA.move_to_end(key)
    return _CONFIG_SDPA[key]


def shape_of(obj: Any, seq_len: Optional[int] = None) -> ModelShape:
    """The `ModelShape` of a shape, a module or a config; with `seq_len`, its block activations
    measured by the activation probe (a module on itself, a transformers config on its model
    built on the meta device), as `estimate` uses it."""
    if isinstance(obj, ModelShape):
        return obj
    if isinstance(obj, nn.Module):
        return calibrated_shape(obj, seq_len) if seq_len else ModelShape.from_module(obj)
    shape = ModelShape.from_config(obj)
    if not seq_len:
        return shape
    profile = _config_block_profile(obj, shape, seq_len)
    return dataclasses.replace(shape, activation_scale=profile.scale, kv_cache_elements=profile.cache_elements,
                               sdpa_quadratic_bytes=_config_sdpa_quadratic_bytes(obj, shape),
                               eager_quadratic_bytes=profile.quadratic_extra)


# model -> {(seq_len, parameter count): profile}: one probe per model and sequence length.
_SCALES: "weakref.WeakKeyDictionary[nn.Module, Dict[Tuple[int, int], BlockProfile]]" = weakref.WeakKeyDictionary()


def _block_formula(shape: ModelShape) -> Callable[[int, str], float]:
    """What the activation probe compares its measurement with: the formula's bytes one block of
    `shape` saves for `tokens` tokens in `mode` ("fp32" or "half"), with the shape's own attention."""
    def formula(tokens: int, mode: str) -> float:
        replicated, sharded = _block_saved_bytes(shape, mode, tokens, shape.fused_attention)
        return tokens * (replicated + sharded)
    return formula


def calibrated_shape(model: nn.Module, seq_len: int) -> ModelShape:
    """`ModelShape.from_module(model)` with its block activations measured on the model itself
    (`activation_probe.block_activation_profile`, with the model's key/value cache too where its config
    fills one; cached per model and sequence length)."""
    from atorch.auto.activation_probe import block_activation_profile

    shape = ModelShape.from_module(model)
    key = (int(seq_len), shape.num_params)
    config = getattr(model, "config", None)
    eager = not shape.fused_attention and config is not None
    # A module running eager attention: what its block keeps per token pair beyond the formula's matrix, in each
    # precision mode, measured on its config's copy under fake tensors (no compute; the module itself is measured at
    # one length, in its own dtype). A module already on sdpa was probed as it runs, at the sequence length: its
    # scale holds whatever its kernel saves, and adding a term would count it twice.
    extra = _config_block_profile(config, shape, seq_len).quadratic_extra if eager else ()
    scales = _SCALES.setdefault(model, {})
    if key not in scales:
        scales[key] = block_activation_profile(model, key[0], _block_formula(shape), kv_cache=shape.kv_cache,
                                               quadratic_extra=dict(extra))
    profile = scales[key]
    measured = dict(extra)
    if eager:   # a meta module fitted on itself (on sdpa, what it saw is the meta device's math path: not kept)
        measured.update(profile.quadratic_extra)
    # What sdpa would save, for a module running eager attention that module_replace switches to sdpa (measured on
    # its config's copy under fake tensors: no compute).
    quadratic = _config_sdpa_quadratic_bytes(config, shape) if eager else 0.0
    return dataclasses.replace(shape, activation_scale=profile.scale, kv_cache_elements=profile.cache_elements,
                               sdpa_quadratic_bytes=quadratic, eager_quadratic_bytes=tuple(sorted(measured.items())))
