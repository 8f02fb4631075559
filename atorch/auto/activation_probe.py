"""Measure what one decoder block of the user's own model saves for backward, to calibrate the cost model.

The cost model's activation formulas (`cost_model.activations._block_saved_bytes`) are counted on Hugging
Face's Llama and GPT-2 blocks. Other architectures save other things: GPT-NeoX, OPT, Falcon
and StarCoder2 blocks save 35-50% less than the Llama formula says (non-gated MLPs, parallel
attention, fused biases), Mixtral-style mixture-of-experts blocks up to 1.8x more (router
logits, per-expert gathers), dropout adds its masks. A formula per architecture would never
be finished; one forward of the first block of the model itself is exact for that model.

`block_activation_scale(model, seq_len, formula)` runs the model's forward on a batch of
`PROBE_BATCH` sequences of `seq_len` tokens (at most `PROBE_TOKENS`) under
`torch.autograd.graph.saved_tensors_hooks`, counts the bytes of every tensor the first block
saves (one storage counted once, parameters and buffers excluded), stops the forward as soon as
that block returns (nothing after it runs), and returns the bytes per sequence / formula
(`formula(tokens, mode)`: the cost model's bytes for that block, passed in so that this module
stays below the cost model). The cost model multiplies its block formula by this scale for
every strategy (`ModelShape.activation_scale`), so the strategy-dependent parts (precision,
tensor sharding, fused modules, LoRA) keep their shape and the architecture-dependent level
comes from the measurement. Where the model's config fills Hugging Face's key/value cache in a
training forward, `block_activation_profile` also runs the block with it: what the cache's k/v
copies cost depends on what else keeps k's and v's storages saved.

The scale is taken from the block's linear part only: eager attention also saves b x heads x s x s
matrices, and a scale measured at one length would spread a quadratic term linearly (a 128-token probe
gives a quadratic part 1/8 of its share at 1024 tokens). A meta model is measured at three lengths and
fitted (constant + per token + per token pair); the formula's own split (its attention matrix is its
quadratic part) leaves the linear scale, and what the block saves per token pair beyond the formula's
matrix (`BlockProfile.quadratic_extra`, by precision mode) is carried separately: BLOOM's softmax kept in
fp32 beside its half copy, where the formula (counted on GPT-2) keeps one half matrix; Gemma 2's
soft-capped scores (tanh keeps its output).

Where it runs: on the model's own device with its own parameters (a CPU model computes one
block for real: a 7B block at 1024 tokens is ~0.4 TFLOP a sequence, seconds here), or, for a
model on the
meta device, under `FakeTensorMode` (no compute, no memory). A model whose forward cannot run that way
(data-dependent shapes on meta, an unusual forward signature) keeps the formula (scale 1.0)
and the reason is logged once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

logger = logging.getLogger(__name__)

# The scale is a correction, not a replacement: a measurement this far from the formula is
# more likely a probe artifact (a block that shares its work with the model, a custom
# autograd function hiding its saves) than the architecture; it is clipped and logged.
SCALE_RANGE = (0.25, 4.0)
# The probe's sequence length, at most. Real parameters: up to 1024 tokens (a 7B block at 1024
# tokens is ~0.4 TFLOP, seconds on a CPU), since blocks whose attention is not fused save
# s^2-sized tensors the formula may not know, which only the real length shows. Meta models
# run under fake tensors, where attention takes its unfused math path even for a model whose
# real kernel is fused: a short sequence keeps that s^2 matrix small (at 128 tokens ~6% of a
# 7B block's saves).
PROBE_TOKENS = 1024
FAKE_PROBE_TOKENS = 128
# Sequences in the probe's batch. One is a special case for some blocks: GPT-NeoX and Falcon save
# 9% more per sequence at batch 1 than at 2 or 4 (measured at 128 and 256 tokens; from 2 on, the
# saves grow by the same bytes per sequence), so the per-sequence figure is taken at 2.
PROBE_BATCH = 2


class _BlockDone(Exception):
    """Raised from the first block's forward hook to stop the model's forward there."""


@dataclass(frozen=True)
class BlockProfile:
    """What the activation probe measured of a model's first block (`block_activation_profile`)."""

    # Measured / formula bytes of the block's linear part (per token); 1.0: not measured.
    scale: float = 1.0
    # Elements per token the block saves more with Hugging Face's key/value cache filled; None: not measured.
    cache_elements: Optional[float] = None
    # (precision mode, bytes per sequence and squared token the block saves beyond the formula's attention
    # matrix): "fp32", "half", "autocast" where measured. Empty: the formula's matrix, or not measured.
    quadratic_extra: Tuple[Tuple[str, float], ...] = ()


@dataclass(frozen=True)
class BlockActivations:
    """What the first block saved for backward, for `batch` sequences of `seq_len` tokens."""

    saved_bytes: int
    seq_len: int
    dtype: torch.dtype


def find_blocks(model: nn.Module) -> Optional[List[nn.Module]]:
    """The model's repeated transformer blocks in forward order (None without any).

    The classes Hugging Face names in `_no_split_modules` (one block each), else the children of
    the largest uniform `nn.ModuleList` (`find_transformer_block_classes`): not simply the
    longest ModuleList, which in a mixture of experts is a layer's experts (Qwen3-MoE: 128
    experts, 48 layers).
    """
    from atorch.utils.module_utils import find_transformer_block_classes, modules_of_classes

    classes = find_transformer_block_classes(model)
    blocks = list(modules_of_classes(model, classes)) if classes else []
    return blocks or None


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    """The identity of a tensor's storage (stable across views, and on the meta device too)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    """Training mode for the probe's forward, and the model's buffers as they were afterwards: a
    forward in training mode may update them (BatchNorm's running statistics), and an estimate
    must not change the model. Buffers are small in a language model (rotary frequencies)."""
    modes = {m: m.training for m in model.modules()}
    # Every buffer, restored whatever its version counter says: BatchNorm's kernel updates its
    # running statistics in place without bumping it. A buffer the forward replaced (a rotary
    # embedding's rescaled frequencies) gets its old tensor back too.
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]
    model.train()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        with torch.no_grad():
            for m, name, buffer, value in buffers:
                buffer.copy_(value)
                m._buffers[name] = buffer


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """FakeTensorMode logs a traceback at ERROR for an op without a meta kernel before raising;
    the probe handles the exception, so the traceback would only alarm the user."""
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_logger.level
    fake_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_logger.setLevel(level)


def measure_first_block(model: nn.Module, seq_len: int, batch: int = 1, use_cache: bool = False,
                        fake_mode: Optional[FakeTensorMode] = None) -> BlockActivations:
    """Run `model`'s forward on `batch` sequences of `seq_len` tokens and count what its first block saves.

    The tokens are all id 0, passed as `input_ids` (what a Hugging Face causal LM takes), with
    `use_cache` (Hugging Face's key/value cache filled by the forward, as a training forward with
    the config's `use_cache` does; a forward that takes no `use_cache` runs without it). Raises
    ValueError when the model has no block stack or is already distributed; whatever its forward
    raises otherwise propagates (the caller decides). `fake_mode`: the fake-tensor mode a meta model
    runs under, reused across calls (its fake copies of the parameters are made once); a new one by default.
    """
    blocks = find_blocks(model)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks")
    first_param = next(iter(blocks[0].parameters()), None)
    if first_param is None:
        raise ValueError(f"{type(model).__name__}'s first block has no parameters")
    reason = _distributed(model)
    if reason:   # its forward would run collectives on this rank alone
        raise ValueError(f"{type(model).__name__} is already distributed ({reason})")
    device = first_param.device
    tensors = list(model.parameters()) + list(model.buffers())
    # On the meta device Hugging Face's mask code reads values (`.item()`): run under fake tensors,
    # which carry the same shapes and let it through (no compute, no memory either way).
    fake = (fake_mode or FakeTensorMode(allow_non_fake_inputs=True)) if device.type == "meta" else None
    if fake is not None:   # the fake copies the forward will see (the mode memoizes them)
        tensors += [fake.from_tensor(t) for t in tensors]
    # Parameters and buffers are saved by reference (a linear saves its weight): not activations.
    owned: Set[Optional[int]] = {_storage_key(t) for t in tensors}
    seen: Set[Optional[int]] = set()
    state = {"inside": False, "bytes": 0}
    # The saved tensors, held here for the probe's duration (a freed storage's address could be
    # reused and then miss the count) and not by the graph: a pack hook that returns the tensor
    # itself makes an op that saves its own output (softmax, exp, SiLU's sigmoid) hold that
    # output in a C++ reference cycle that Python's collector cannot see, and the probe's whole
    # graph outlived it (measured: 28 tensors kept alive per probe on the tiny Llama).
    kept: List[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> None:
        if state["inside"]:
            key = _storage_key(tensor)
            if key is not None and key not in owned and key not in seen:
                seen.add(key)
                state["bytes"] += tensor.untyped_storage().nbytes()
                kept.append(tensor)
        return None   # never unpacked: the probe runs no backward

    def enter(*_: object) -> None:
        state["inside"] = True

    def leave(*_: object) -> None:
        state["inside"] = False
        raise _BlockDone()

    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="cpu" if fake is not None else device)
    hooks = [blocks[0].register_forward_pre_hook(enter), blocks[0].register_forward_hook(leave)]
    # Dropout draws random numbers: the user's generator streams are left as they were.
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), _train_mode(model), torch.enable_grad(), \
                _quiet_fake_tensor_errors(), (fake if fake is not None else contextlib.nullcontext()), \
                torch.autograd.graph.saved_tensors_hooks(pack, never_unpacked):
            for kwargs in ({"use_cache": use_cache}, {}):   # a non-Hugging Face forward may not take use_cache
                try:
                    model(input_ids=tokens, **kwargs)
                except _BlockDone:
                    break
                except TypeError as e:
                    if kwargs and "use_cache" in str(e):
                        continue
                    raise
                raise ValueError(f"{type(model).__name__}'s forward never ran its first block")
    finally:
        for hook in hooks:
            hook.remove()
        kept.clear()
    return BlockActivations(int(state["bytes"]), seq_len, first_param.dtype)


def never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("the activation probe's graph is not for backward")


def _distributed(model: nn.Module) -> Optional[str]:
    """Why `model` cannot run a forward on one rank alone (sharded or wrapped parameters), or None."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "DTensor parameters"
    for module in model.modules():
        kind = type(module).__name__
        if kind in ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine") or \
                hasattr(module, "_fsdp_wrapped_module"):
            return kind
    return None


_WARNED: Set[str] = set()


FormulaBytes = Callable[[int, str], float]
"""(tokens, "fp32" or "half") -> the bytes the cost model's formula says one block saves."""


def block_activation_scale(model: nn.Module, seq_len: int, formula: FormulaBytes) -> float:
    """Measured / `formula` bytes of the linear part of what the first block of `model` saves per sequence;
    1.0 if unmeasurable.

    Measured at min(`seq_len`, `PROBE_TOKENS`) tokens (`FAKE_PROBE_TOKENS` on the meta device, and there at
    three lengths). `formula` is asked for the model as it is (no strategy): "half" when its parameters are
    half, else "fp32".
    """
    return block_activation_profile(model, seq_len, formula).scale


# The lengths a meta model is measured at, as fractions of its probe length: what the block saves is fitted as
# constant + per token + per token pair. Three, not two: a block's constant (Gemma's (1 + weight) of each norm,
# computed in every forward) would otherwise read as a quadratic term.
FIT_FRACTIONS = (4, 2, 1)
# What the fit reads as no quadratic term beyond the formula's: at most one fp32 value per token pair and sequence,
# the b x 1 x s x s mask Hugging Face builds under fake tensors, which a block may save (`masked_fill`) but every
# block shares.
QUADRATIC_NOISE_BYTES = 4.0


def _mode_of(dtype: torch.dtype) -> str:
    return "half" if dtype in (torch.float16, torch.bfloat16) else "fp32"


def _fit_lengths(seq_len: int) -> Optional[Tuple[int, ...]]:
    """The three lengths a probe of `seq_len` tokens is fitted at; None when `seq_len` is too short for three."""
    lengths = tuple(sorted({max(1, seq_len // fraction) for fraction in FIT_FRACTIONS}))
    return lengths if len(lengths) == 3 else None


def quadratic_through(points: Sequence[Tuple[float, float]]) -> Tuple[float, float, float]:
    """(c, a, q) of the parabola c + a s + q s^2 through three (s, bytes) points."""
    (s1, m1), (s2, m2), (s3, m3) = sorted(points)
    slope12, slope13 = (m2 - m1) / (s2 - s1), (m3 - m1) / (s3 - s1)
    q = (slope13 - slope12) / (s3 - s2)
    a = slope12 - q * (s1 + s2)
    return m1 - a * s1 - q * s1 * s1, a, q


def formula_split(formula: FormulaBytes, mode: str, tokens: int) -> Tuple[float, float]:
    """(bytes per token, bytes per squared token) of `formula` in `mode`: its linear part and its attention
    matrix (it has no constant), read at `tokens` and 2 x `tokens`."""
    one, two = formula(tokens, mode), formula(2 * tokens, mode)
    quadratic = (two - 2 * one) / (2.0 * tokens * tokens)
    return one / tokens - quadratic * tokens, quadratic


def fit_first_block(model: nn.Module, lengths: Sequence[int],
                    context: Callable[[], "contextlib.AbstractContextManager[object]"] = contextlib.nullcontext
                    ) -> Tuple[float, float, float]:
    """(constant, bytes per token, bytes per squared token) of what the first block of `model` saves per sequence,
    measured at three `lengths` (`measure_first_block`), each inside a fresh `context()` (an autocast region: its
    weight casts are cached per region, so each measurement holds them once, in the constant)."""
    points = []
    # One fake-tensor mode for a meta model's three forwards: its parameters are converted once (a third of the
    # time of a forward of a 1B model's first block under fake tensors).
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for length in lengths:
        with context():
            saved = measure_first_block(model, length, batch=PROBE_BATCH, fake_mode=fake).saved_bytes
        points.append((float(length), saved / PROBE_BATCH))
    return quadratic_through(points)


def _quadratic_extra(name: str, mode: str, measured: float, formula: float) -> float:
    """Measured - formula bytes per sequence and squared token, 0.0 within `QUADRATIC_NOISE_BYTES`."""
    extra = measured - formula
    if abs(extra) <= QUADRATIC_NOISE_BYTES:
        return 0.0
    logger.info("activation probe: %s's first block saves %+.1f bytes per sequence and token pair in %s beyond the "
                "cost model's attention matrix (%.1f)", name, extra, mode, formula)
    return extra


def block_activation_profile(model: nn.Module, seq_len: int, formula: FormulaBytes, kv_cache: bool = False,
                             half_retry: bool = False, quadratic_extra: Optional[Mapping[str, float]] = None,
                             half_extra: bool = True) -> BlockProfile:
    """The first block's linear scale (`block_activation_scale`), with `kv_cache` the elements per token it saves
    more with Hugging Face's key/value cache filled than without, and on a meta model what it saves per token pair
    beyond the formula's attention matrix (`BlockProfile.quadratic_extra`).

    The cache's `torch.cat` copies k and v, and attention saves the copies instead of k and v;
    what that costs depends on what else keeps k's and v's storages saved: GPT-2's q is a view of
    the fused c_attn output, which stays saved (+2 x kv), while GPT-NeoX's q and k are fresh
    rotary outputs and only v viewed the fused query_key_value output, which the copy frees
    (-2 x hidden). Only the model's own block says which, so it is run both ways.

    A meta model (fake tensors: no compute) is fitted at three lengths (`FIT_FRACTIONS`): the scale is its
    per-token bytes over the formula's, and the per-token-pair bytes beyond the formula's matrix are its
    quadratic extra in its dtype's mode. A model with real parameters computes, so it is measured at one
    length; the quadratic part subtracted there is the formula's matrix plus `quadratic_extra[mode]` (what the
    caller measured on a meta copy of the same model; 0.0 without one).

    `half_retry`: the caller owns `model` (a meta copy built from a config): a forward that fails in fp32 is
    tried once more in bf16 (fake mixture-of-experts kernels such as grouped_mm take bf16 only), compared with
    the formula's half-precision bytes; and, with `half_extra` (the caller counts eager attention), an fp32
    model is also fitted in bf16 afterwards, for the half mode's extra (BLOOM's fp32 softmax shows only there).
    """
    name = type(model).__name__
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    seq_len = max(1, min(int(seq_len), FAKE_PROBE_TOKENS if on_meta else PROBE_TOKENS))
    lengths = _fit_lengths(seq_len) if on_meta else None
    try:
        try:
            dtype, fit, one = _measure(model, seq_len, lengths)
        except Exception:  # noqa: BLE001 - retried in bf16 where allowed, else reported below
            if not half_retry or next(model.parameters()).dtype != torch.float32:
                raise
            model.to(torch.bfloat16)
            dtype, fit, one = _measure(model, seq_len, lengths)
    except Exception as e:  # noqa: BLE001 - any failure of an arbitrary model's forward means "not measurable"
        if name not in _WARNED:
            _WARNED.add(name)
            logger.info("activation probe: %s not measured (%s: %s); the cost model keeps its block formula",
                        name, type(e).__name__, e)
        return BlockProfile()
    mode = _mode_of(dtype)
    linear, quadratic = formula_split(formula, mode, seq_len)
    extras: Dict[str, float] = {}
    if fit is not None:
        _, per_token, per_pair = fit
        extras[mode] = _quadratic_extra(name, mode, per_pair, quadratic)
        if half_retry and half_extra and mode == "fp32" and lengths is not None:
            half = _half_quadratic(model, lengths)
            if half is not None:
                extras["half"] = _quadratic_extra(name, "half", half, formula_split(formula, "half", seq_len)[1])
    else:   # measured at one length (`_measure` returns the fit or the one measurement)
        per_pair = quadratic + dict(quadratic_extra or {}).get(mode, 0.0)
        per_token = cast(BlockActivations, one).saved_bytes / PROBE_BATCH / seq_len - per_pair * seq_len
    # Under fake tensors (a meta model) the cache's copies do not show: the same bytes with and without
    # it (GPT-2, GPT-NeoX), where real parameters show +2 x kv and -2 x hidden; the formula's term stays.
    cache_elements = _cache_elements(model, seq_len, one) if kv_cache and not on_meta and one is not None else None
    return BlockProfile(_clipped_scale(name, per_token, linear, seq_len), cache_elements, tuple(sorted(extras.items())))


_Fit = Tuple[float, float, float]


def _measure(model: nn.Module, seq_len: int, lengths: Optional[Tuple[int, ...]]
             ) -> Tuple[torch.dtype, Optional[_Fit], Optional[BlockActivations]]:
    """(the first block's dtype, its fit at `lengths`, or without lengths its bytes at `seq_len`)."""
    if lengths is None:
        one = measure_first_block(model, seq_len, batch=PROBE_BATCH)
        return one.dtype, None, one
    fit = fit_first_block(model, lengths)
    blocks = find_blocks(model) or []
    return next(blocks[0].parameters()).dtype, fit, None


def _half_quadratic(model: nn.Module, lengths: Sequence[int]) -> Optional[float]:
    """Bytes per sequence and squared token the first block of `model` (owned by the caller: it is left in bf16)
    saves in bf16; None when that forward fails (the half mode then keeps the formula's matrix)."""
    try:
        model.to(torch.bfloat16)
        return fit_first_block(model, lengths)[2]
    except Exception as e:  # noqa: BLE001 - as in block_activation_profile: the formula stands
        name = type(model).__name__
        if f"half:{name}" not in _WARNED:
            _WARNED.add(f"half:{name}")
            logger.info("activation probe: %s not measured in bf16 (%s: %s)", name, type(e).__name__, e)
        return None


def autocast_quadratic_extra(model: nn.Module, seq_len: int, formula: FormulaBytes,
                             mode: FakeTensorMode) -> float:
    """Bytes per sequence and squared token the first block of `model` saves under `torch.autocast` (bf16) beyond
    the formula's autocast attention matrix; 0.0 when unmeasurable (logged once).

    `model`: fp32, built on a real device type inside the fake-tensor mode `mode` (autocast dispatches by device
    type, and has no region for the meta device). Each length runs in its own autocast region, so the block's
    weight casts are counted once in each, in the fit's constant."""
    lengths = _fit_lengths(max(1, min(int(seq_len), FAKE_PROBE_TOKENS)))
    first = next(iter(model.parameters()), None)
    if lengths is None or first is None:
        return 0.0
    device_type = first.device.type
    try:
        with mode:
            _, _, measured = fit_first_block(model, lengths, lambda: torch.autocast(device_type, torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - as in block_activation_profile: the formula's matrix stands
        name = type(model).__name__
        if f"autocast:{name}" not in _WARNED:
            _WARNED.add(f"autocast:{name}")
            logger.info("activation probe: %s not measured under autocast (%s: %s)", name, type(e).__name__, e)
        return 0.0
    return _quadratic_extra(type(model).__name__, "autocast", measured,
                            formula_split(formula, "autocast", lengths[-1])[1])


def _cache_elements(model: nn.Module, seq_len: int, without: BlockActivations) -> Optional[float]:
    """(Saved bytes with the cache - `without`) per token, in elements of the block's dtype; None if unmeasurable."""
    try:
        with_cache = measure_first_block(model, seq_len, batch=PROBE_BATCH, use_cache=True)
    except Exception as e:  # noqa: BLE001 - as in block_activation_profile: the formula's term stays
        logger.info("activation probe: %s not measured with its key/value cache (%s: %s); the cost model keeps "
                    "its formula for the cache", type(model).__name__, type(e).__name__, e)
        return None
    element = torch.empty((), dtype=without.dtype).element_size()
    return (with_cache.saved_bytes - without.saved_bytes) / (PROBE_BATCH * seq_len * element)


# The lengths the sdpa probe compares (`sdpa_quadratic_bytes`), and what it takes for no quadratic term: under
# 2% of the block's saves at the longer length, or at most one fp32 value per token pair and sequence. That is
# the b x 1 x s x s mask Hugging Face builds under fake tensors (it cannot tell there that the mask is causal
# only), held once for all blocks; a math path's matrix is one per head.
SDPA_PROBE_TOKENS = (64, 128)
SDPA_QUADRATIC_SHARE = 0.02
SDPA_MASK_BYTES = 4.0


def sdpa_quadratic_bytes(model: nn.Module, mode: Optional[FakeTensorMode] = None) -> float:
    """Bytes per sequence and squared token that the first block of `model`, running sdpa attention, still saves
    for backward: 0.0 where the fused kernel runs (it saves b x heads x s: linear), the b x heads x s x s matrix
    where torch falls back to its math path on this device (on CPU: Falcon's multi-query attention passed
    without enable_gqa, DeepSeek-V3's query/key head 96 against a value head 64). Measured at two lengths,
    s and 2s: what grows 4x is the quadratic part. The cost model adds it where it counts attention as fused
    (`ModelShape.sdpa_quadratic_bytes`); the probe above runs eager attention, whose quadratic part is another
    (`BlockProfile.quadratic_extra`, counted where attention is not fused).
    `mode`: the fake-tensor mode `model` was built in, on a real device type (on the meta device every kernel
    takes the math path), entered for the forward. 0.0 when unmeasurable (logged once)."""
    short, long = SDPA_PROBE_TOKENS
    try:
        with mode if mode is not None else contextlib.nullcontext():
            one = measure_first_block(model, short, batch=PROBE_BATCH).saved_bytes / PROBE_BATCH
            two = measure_first_block(model, long, batch=PROBE_BATCH).saved_bytes / PROBE_BATCH
    except Exception as e:  # noqa: BLE001 - as in block_activation_profile: the formula stands
        name = type(model).__name__
        if f"sdpa:{name}" not in _WARNED:
            _WARNED.add(f"sdpa:{name}")
            logger.info("activation probe: %s's sdpa attention not measured (%s: %s)", name, type(e).__name__, e)
        return 0.0
    # one = a s + q s^2, two = 2 a s + 4 q s^2 (s = short): two - 2 one = 2 q s^2.
    quadratic = (two - 2 * one) / (2.0 * short * short)
    if quadratic <= SDPA_MASK_BYTES or quadratic * long * long <= SDPA_QUADRATIC_SHARE * two:
        return 0.0
    return quadratic


def _clipped_scale(name: str, per_token: float, expected: float, seq_len: int) -> float:
    """Measured / formula bytes per token of the block's linear part, clipped to `SCALE_RANGE` (logged); 1.0 when
    either is not positive."""
    if not expected > 0 or per_token <= 0:
        return 1.0
    scale = per_token / expected
    low, high = SCALE_RANGE
    if not low <= scale <= high:
        logger.warning("activation probe: %s's first block saved %.3g bytes a token (linear part, %d tokens), %.2fx "
                       "the cost model's formula; using %.2fx", name, per_token, seq_len, scale,
                       min(max(scale, low), high))
        scale = min(max(scale, low), high)
    return scale
