"""A step-time model that learns: device constants from a short probe, then a refit on every dry run.

Two layers over the cost model (`atorch.auto.cost_model.estimate`, used as is):

1. **Probe**: `calibrate_model` measures what the step will run -- matmul FLOP/s at the
   model's own GEMM shapes (tokens per rank x hidden x hidden / kv / intermediate / vocab,
   forward and backward, per tensor split and dtype) and all-reduce times at the sizes the
   strategies move, fitted to a bandwidth and a latency; `cost_model_predictor(profile=...)`
   gives each strategy the rates of its own tokens and split (`ShapedConstants`).
   (`calibrate_device`, one large square matmul, overstates a small model's rates.) Measured
   once per device kind (and shape, backend and group size), cached as JSON in
   `$ATORCH_CALIBRATION_CACHE` or `~/.cache/atorch/calibration.json` (never pickle); a corrupt
   file or entry is ignored with a warning naming the file.
2. **Refit** (`LearningPredictor`), on every measured dry run (`observe(strategy, step_time_s)`):
   one non-negative weight per part of the cost model's step time (compute, overhead,
   communication; least squares on relative errors, shrunk towards a common rescale), then
   per-option corrections: log(measured / predicted) ~ bias + one effect per option of the
   strategy (amp, checkpoint, each sharder, tensor=2, ...), ridge-shrunk towards 0 and fitted
   with a Huber loss. An option the cost model misjudges (autocast on a CPU) is learned from
   the trials that used it and corrects the candidates not yet run, which reorders them; one
   trial only rescales, and one wild measurement is downweighted. Memory is left as the base
   model says.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch
import torch.distributed as dist

from atorch.auto.cost_model import Estimate, ModelShape, StrategyTraits, estimate, shape_of
from atorch.auto.devices import cpu_model_name
from atorch.auto.strategy import Strategy, StrategyLike
from atorch.utils.finite_numbers import is_finite_number

logger = logging.getLogger(__name__)

CACHE_ENV = "ATORCH_CALIBRATION_CACHE"
CACHE_VERSION = 1
COMPONENTS = ("time_compute", "time_overhead", "time_communication")

Predictor = Callable[[Strategy], Estimate]


# -- probe --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceConstants:
    """Measured rates of one device kind (and of its collectives at one backend and group size)."""

    device_kind: str
    flops_fp32: float
    flops_bf16: float
    comm_key: Optional[str] = None            # "<backend>:<group size>", when measured
    comm_bytes_per_s: Optional[float] = None  # all-reduce bus bandwidth (ring volume 2(n-1)/n x bytes)
    comm_latency_s: Optional[float] = None    # per all-reduce

    def as_profile(self) -> Dict[str, float]:
        """The keys `cost_model.estimate(profile=...)` overrides."""
        out = {"flops_fp32": self.flops_fp32, "flops_bf16": self.flops_bf16}
        if self.comm_bytes_per_s is not None and self.comm_latency_s is not None:
            out.update(comm_bytes_per_s=self.comm_bytes_per_s, comm_latency_s=self.comm_latency_s)
        return out


def device_kind(device: torch.device) -> str:
    """A name for "this kind of device": GPU model, or CPU model and thread count; with torch's version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model_name() + f" x{torch.get_num_threads()} threads"
    return f"{device.type}:{name}|torch {torch.__version__}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_matmul(device: torch.device, dtype: torch.dtype, size: int = 0, min_seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls of `size` (default: 512 on CPU, 4096 on GPU), median over repeats."""
    size = size or (4096 if device.type == "cuda" else 512)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b   # warm-up (kernel selection, allocation)
    _synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        _synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 2.0 * size ** 3 / statistics.median(times)


def _time_all_reduce(device: torch.device, numel: int, group: Any, repeats: int) -> float:
    """Seconds of one all-reduce of `numel` fp32 elements over `group`: the median of `repeats`
    (after a warm-up), the slowest rank's, so every rank returns the same. Collective."""
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)   # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        _synchronize(device)
        samples.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def probe_all_reduce(device: torch.device, group: Any = None, large_bytes: int = 8 << 20,
                     repeats: int = 5) -> Tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of all-reduce over `group`: a 1-element and a large tensor.

    Collective: every rank of `group` must call it. Times are the slowest rank's, so every
    rank returns the same constants.
    """
    n = dist.get_world_size(group)
    latency = _time_all_reduce(device, 1, group, repeats)
    large = _time_all_reduce(device, large_bytes // 4, group, repeats)
    bus_bytes = 2.0 * (n - 1) / n * large_bytes
    return bus_bytes / max(large - latency, 1e-9), latency


def default_cache_path() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atorch", "calibration.json")


def load_cache(path: str) -> Dict[str, Any]:
    """The cache's entries; an unreadable, corrupt or other-version file is ignored with a warning."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"),
                                                                                               dict):
            raise ValueError(f"expected {{'version': {CACHE_VERSION}, 'entries': {{...}}}}")
        return data["entries"]
    except (OSError, ValueError, RecursionError) as e:     # RecursionError: absurdly nested JSON
        logger.warning("calibration cache %s is unusable (%s: %s); measuring again", path, type(e).__name__, e)
        return {}


def _cached_rates(path: str, value: Any, where: str, names: Sequence[str]) -> Optional[Dict[str, Any]]:
    """A cached measurement holding every one of `names` as a finite number (> 0, a latency >= 0); None
    (measure again) when absent, and with a warning naming the file when it is damaged."""
    if value is None:
        return None
    if isinstance(value, dict) and all(
            is_finite_number(value.get(n)) and (value[n] >= 0 if n.endswith("latency_s") else value[n] > 0)
            for n in names):
        return value
    logger.warning("calibration cache %s: entry %s is unusable (expected positive numbers %s); measuring again",
                   path, where, ", ".join(names))
    return None


def _save_cache(path: str, entries: Mapping[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": dict(entries)}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def calibrate_device(device: Optional[torch.device] = None, group: Any = None, *, cache_path: Optional[str] = None,
                     refresh: bool = False) -> DeviceConstants:
    """This device's constants, measured on first use and read from the cache afterwards.

    Collective when a process group is initialized (every rank of `group` must call it): the
    collectives are probed over `group` (default: the world) and the matmul rates averaged
    over its ranks, so every rank gets the same constants. Rank 0 writes the cache.
    """
    device = device or torch.device("cpu")
    path = cache_path or default_cache_path()
    kind = device_kind(device)
    distributed = dist.is_available() and dist.is_initialized()
    comm_key = f"{dist.get_backend(group)}:{dist.get_world_size(group)}" if distributed else None
    entries = load_cache(path)
    cached = _mapping(entries.get(kind))
    if kind in entries and not isinstance(entries[kind], dict):
        logger.warning("calibration cache %s: entry %s is unusable (not an object); measuring again", path, kind)
    compute = _cached_rates(path, cached.get("compute"), f"{kind}/compute", ("flops_fp32", "flops_bf16"))
    comm = _cached_rates(path, _mapping(cached.get("comm")).get(comm_key), f"{kind}/comm/{comm_key}",
                         ("comm_bytes_per_s", "comm_latency_s")) if comm_key else None
    # Every rank must agree on whether to probe (the probe is collective).
    need = [compute is None or refresh, comm_key is not None and int(dist.get_world_size(group)) > 1 and
            (comm is None or refresh)]
    if distributed:
        flags = torch.tensor([int(x) for x in need], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        need = [bool(x) for x in flags.tolist()]
    if need[0]:
        rates = torch.tensor([probe_matmul(device, torch.float32), probe_matmul(device, torch.bfloat16)],
                             dtype=torch.float64)
        if distributed:
            dist.all_reduce(rates, group=group)
            rates /= dist.get_world_size(group)
        compute = {"flops_fp32": float(rates[0]), "flops_bf16": float(rates[1]), "measured": _now()}
    if need[1]:
        bandwidth, latency = probe_all_reduce(device if device.type == "cuda" else torch.device("cpu"), group)
        comm = {"comm_bytes_per_s": bandwidth, "comm_latency_s": latency, "measured": _now()}
    if any(need) and (not distributed or dist.get_rank() == 0):
        entry = dict(cached)
        entry["compute"] = compute
        if comm_key is not None and comm is not None:
            entry["comm"] = {**_mapping(entry.get("comm")), comm_key: comm}
        try:
            _save_cache(path, {**entries, kind: entry})
        except OSError as e:
            logger.warning("could not write the calibration cache %s: %s", path, e)
    compute = cast(Dict[str, Any], compute)      # measured above whenever the cache had none
    return DeviceConstants(kind, compute["flops_fp32"], compute["flops_bf16"], comm_key if comm else None,
                           comm["comm_bytes_per_s"] if comm else None, comm["comm_latency_s"] if comm else None)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- probe at the model's own shapes ------------------------------------------------------------
#
# One large square matmul overstates what a small model reaches (measured: fp32 1.8e11 FLOP/s
# from 512^3 against the ~4e10 the tiny Llama's step implies), and the probe that used it ranked
# worse than the built-in constants. So the rates the predictor divides by are measured on the
# GEMMs the step runs -- tokens x hidden x {hidden, kv, intermediate, vocab}, forward and both
# backward products, per tensor-parallel split and dtype -- and the all-reduce at the sizes the
# strategies move (gradient buckets, tensor-parallel activations).

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRADIENT_BUCKET_BYTES = 25e6    # the cost model's (and DDP's) bucket size


def model_gemms(shape: ModelShape, tokens: int, tensor: int = 1) -> List[Tuple[int, int, int, int]]:
    """(m, k, n, count) of the matmuls of one forward + backward on one rank: each projection of a
    block (split over `tensor` ranks as Megatron splits it) L times, the LM head once; a forward
    (m, k, n) brings the backward products (m, n, k) (input gradient) and (k, m, n) (weight gradient)."""
    if tokens <= 0 or tensor <= 0:
        raise ValueError(f"tokens={tokens} and tensor={tensor} must be > 0")
    h, t = shape.hidden_size, tensor
    kv = shape.kv_dim or h
    ffn = shape.intermediate_size
    forward = [(tokens, h, max(1, h // t)), (tokens, h, max(1, kv // t)), (tokens, h, max(1, kv // t)),
               (tokens, max(1, h // t), h)]
    forward += [(tokens, h, max(1, ffn // t))] * (2 if shape.gated else 1) + [(tokens, max(1, ffn // t), h)]
    counts: Dict[Tuple[int, int, int], int] = {}
    head = [(tokens, h, shape.vocab_size)] if shape.vocab_size else []
    for group, repeat in ((forward, shape.num_layers), (head, 1)):
        for m, k, n in group:
            for mkn in ((m, k, n), (m, n, k), (k, m, n)):
                counts[mkn] = counts.get(mkn, 0) + repeat
    return [(m, k, n, c) for (m, k, n), c in sorted(counts.items())]


def _time_matmul(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, min_seconds: float) -> float:
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b   # warm-up
    _synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_seconds and len(times) < 500):
        t0 = time.perf_counter()
        a @ b
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_model_gemms(device: torch.device, shape: ModelShape, tokens: int, tensor: int, dtype: torch.dtype,
                      min_seconds: float = 0.02) -> float:
    """FLOP/s the step's own matmuls reach: their FLOPs over their summed median times."""
    flops = seconds = 0.0
    for m, k, n, count in model_gemms(shape, tokens, tensor):
        flops += 2.0 * m * k * n * count
        seconds += _time_matmul(device, dtype, m, k, n, min_seconds) * count
    return flops / seconds


class _ProbeBlock(torch.nn.Module):
    """A Llama-style decoder block at `shape`'s widths split over `tensor` ranks (what one rank of a
    Megatron split computes): RMS norms, q/k/v/o, eager or sdpa attention, the (gated) SiLU MLP."""

    def __init__(self, shape: ModelShape, tensor: int) -> None:
        super().__init__()
        h, t = shape.hidden_size, tensor
        self.heads = max(1, shape.num_heads // t) if shape.num_heads else 1
        self.head_dim = max(1, h // max(1, shape.num_heads or 1))
        kv = max(1, (shape.kv_dim or h) // t)
        self.kv_heads = max(1, kv // self.head_dim)
        self.q = torch.nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(self.heads * self.head_dim, h, bias=False)
        ffn = max(1, shape.intermediate_size // t)
        self.gate = torch.nn.Linear(h, ffn, bias=False) if shape.gated else None
        self.up = torch.nn.Linear(h, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)
        self.norm1 = torch.nn.Parameter(torch.ones(h))
        self.norm2 = torch.nn.Parameter(torch.ones(h))
        self.fused = shape.fused_attention

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self._norm(x, self.norm1)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if self.fused:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            a = torch.softmax((scores + mask).float(), dim=-1).to(q.dtype) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self._norm(x, self.norm2)
        hidden = torch.nn.functional.silu(self.gate(y)) * self.up(y) if self.gate is not None \
            else torch.nn.functional.gelu(self.up(y))
        return x + self.down(hidden)


def block_flops(shape: ModelShape, tokens: int, seq_len: int, tensor: int) -> float:
    """The cost model's FLOPs of one block's forward + backward for `tokens` (6 x params + attention)."""
    return tokens * (6.0 * shape.layer_params / tensor + 12.0 * seq_len * shape.hidden_size / tensor)


def _time_block(block: torch.nn.Module, device: torch.device, half: bool, batch: int, seq_len: int,
                hidden: int, min_seconds: float) -> float:
    x = torch.randn(batch, seq_len, hidden, device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            out = block(x)
        out.float().sum().backward()

    step()   # warm-up
    _synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        step()
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_block(device: torch.device, shape: ModelShape, tokens: int, seq_len: int, tensor: int, half: bool,
                min_seconds: float = 0.1) -> Tuple[float, float]:
    """(FLOP/s, per-layer overhead s) of one decoder block's forward + backward as the model runs it
    (autocast to bf16 when `half`, as amp_native does), from its times at `tokens` and a quarter of
    them: time = overhead + FLOPs / rate. What the block does besides its matmuls (norms, softmax,
    activations, autograd) is in the rate; what does not grow with the tokens is the overhead."""
    if tokens < seq_len:
        raise ValueError(f"tokens={tokens} must be >= seq_len={seq_len} (one sequence)")
    torch.manual_seed(0)
    block = _ProbeBlock(shape, tensor).to(device)
    big, small = tokens // seq_len, max(1, tokens // seq_len // 4)
    t_big = _time_block(block, device, half, big, seq_len, shape.hidden_size, min_seconds)
    if small == big:
        return block_flops(shape, tokens, seq_len, tensor) / t_big, 0.0
    t_small = _time_block(block, device, half, small, seq_len, shape.hidden_size, min_seconds)
    f_big = block_flops(shape, big * seq_len, seq_len, tensor)
    f_small = block_flops(shape, small * seq_len, seq_len, tensor)
    per_flop = (t_big - t_small) / (f_big - f_small)
    overhead = t_big - per_flop * f_big
    if per_flop <= 0 or overhead < 0:   # noise: no measurable overhead, the whole time is the rate's
        return f_big / t_big, 0.0
    return 1.0 / per_flop, overhead


def probe_all_reduce_sizes(device: torch.device, sizes: Sequence[int], group: Any = None,
                           repeats: int = 7) -> Dict[int, float]:
    """Seconds of one all-reduce of each byte size in `sizes` over `group` (the slowest rank's median).

    Collective: every rank must pass the same sizes."""
    return {int(size): _time_all_reduce(device, max(1, int(size) // 4), group, repeats) for size in sizes}


def fit_bandwidth(times: Mapping[int, float], ranks: int) -> Tuple[float, float]:
    """(bus bytes/s, latency s) with time = latency + 2(n-1)/n x bytes / bandwidth, least squares over the
    sizes (relative errors, so small and large sizes count alike); latency >= 0."""
    from scipy.optimize import nnls

    if len(times) < 2 or ranks < 2:
        raise ValueError(f"fit_bandwidth needs >= 2 sizes and >= 2 ranks, got {len(times)} sizes, {ranks} ranks")
    sizes = np.array(sorted(times), dtype=float)
    t = np.array([times[int(s)] for s in sizes])
    volume = 2.0 * (ranks - 1) / ranks * sizes
    a = np.stack([np.ones_like(sizes), volume], axis=1) / t[:, None]
    (latency, inverse_bw), _ = nnls(a, np.ones_like(t))
    return 1.0 / max(float(inverse_bw), 1e-30), float(latency)


@dataclass(frozen=True)
class ShapedConstants:
    """Rates measured at one model's shapes: FLOP/s (and, from the block probe, a per-layer overhead)
    per (dtype, tokens per rank, tensor split), and the all-reduce fitted over the sizes the strategies
    move. `cost_model_predictor(profile=...)` picks each strategy's own entry (`profile_for`)."""

    device_kind: str
    shape_key: str
    flops: Mapping[str, float]                  # "fp32:tokens=256:tensor=1" -> FLOP/s
    comm_bytes_per_s: Optional[float] = None
    comm_latency_s: Optional[float] = None
    layer_overhead_s: Mapping[str, float] = field(default_factory=dict)   # same keys; block probe only

    @staticmethod
    def key(dtype: str, tokens: int, tensor: int) -> str:
        return f"{dtype}:tokens={tokens}:tensor={tensor}"

    def _nearest(self, dtype: str, tokens: int, tensor: int) -> str:
        exact = self.key(dtype, tokens, tensor)
        if exact in self.flops:
            return exact
        # Not probed: the nearest probed point of that dtype (log distance in tokens and in tensor).
        candidates = []
        for k in self.flops:
            d, tok, ten = k.split(":")
            if d == dtype:
                candidates.append((abs(math.log(int(tok[7:]) / tokens)) + abs(math.log(int(ten[7:]) / tensor)), k))
        if not candidates:
            raise KeyError(f"no {dtype} rate was probed for {self.shape_key} (probed: {sorted(self.flops)})")
        return min(candidates)[1]

    def profile_for(self, tokens: int, tensor: int, half: bool = False) -> Dict[str, float]:
        """The `cost_model.estimate(profile=...)` overrides for a step of `tokens` per rank split over `tensor`
        (`half`: the strategy computes in bf16, whose probed per-layer overhead then applies)."""
        fp32, bf16 = self._nearest("fp32", tokens, tensor), self._nearest("bf16", tokens, tensor)
        out = {"flops_fp32": self.flops[fp32], "flops_bf16": self.flops[bf16]}
        overhead = self.layer_overhead_s.get(bf16 if half else fp32)
        if overhead is not None:
            out["layer_overhead_s"] = overhead
        if self.comm_bytes_per_s is not None and self.comm_latency_s is not None:
            out.update(comm_bytes_per_s=self.comm_bytes_per_s, comm_latency_s=self.comm_latency_s)
        return out


def shape_key(shape: ModelShape) -> str:
    """What the GEMM rates depend on, as a cache key."""
    return (f"h={shape.hidden_size},kv={shape.kv_dim or shape.hidden_size},ffn={shape.intermediate_size},"
            f"vocab={shape.vocab_size},layers={shape.num_layers},gated={int(shape.gated)}")


def strategy_workload(shape: ModelShape, strategy: StrategyLike, batch_size: int, seq_len: int,
                      world_size: int) -> Tuple[int, int, List[int], bool]:
    """(tokens per rank per micro-step, tensor split, all-reduce byte sizes, computes in half) of a
    strategy: where to probe, and which probed rates it gets."""
    s = Strategy.from_any(strategy)
    ga = s.get("gradient_accumulation")
    steps = _steps(ga.config) if ga is not None else 1
    base = Strategy(i for i in s if i.name != "gradient_accumulation")
    traits = StrategyTraits.from_strategy(base, world_size, shape)
    tokens = max(1, max(1, batch_size // steps) // traits.data) * seq_len
    sizes: List[int] = []
    if traits.data > 1:
        grad_bytes = shape.num_params / traits.tensor * traits.trainable_fraction * 4
        sizes.append(int(min(grad_bytes, GRADIENT_BUCKET_BYTES)))
    if traits.tensor > 1:
        sizes.append(int(tokens * shape.hidden_size * traits.compute_dtype_bytes))
    return tokens, traits.tensor, sizes, traits.compute_dtype_bytes == 2


def _mapping(value: Any) -> Dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _cached_numbers(path: str, entry: Mapping[str, Any], section: str, key: str) -> Dict[str, float]:
    """entry[section][key] as {name: number > 0} (an overhead may be 0: rates and times are divided by);
    anything else is ignored with a warning naming the file."""
    value = _mapping(entry.get(section)).get(key)
    if value is None:
        return {}
    if isinstance(value, dict) and all(is_finite_number(v) and (v > 0 or (v == 0 and str(k).endswith(":overhead")))
                                       for k, v in value.items()):
        return {str(k): float(v) for k, v in value.items()}
    logger.warning("calibration cache %s: entry %s/%s is unusable (expected {name: number > 0}); "
                   "measuring again", path, section, key)
    return {}


def calibrate_model(shape: ModelShape, workloads: Sequence[Tuple[int, int]], comm_sizes: Sequence[int] = (),
                    device: Optional[torch.device] = None, group: Any = None, *, seq_len: int = 0,
                    method: str = "block", cache_path: Optional[str] = None, refresh: bool = False) -> ShapedConstants:
    """Rates at `shape` for each (tokens per rank, tensor split) of `workloads` and both dtypes, and the
    all-reduce fitted over `comm_sizes` (bytes); measured once per device kind and shape, cached.

    `method`: "block" (`probe_block`: one decoder block's forward + backward at `seq_len`, giving
    a rate and a per-layer overhead) or "gemm" (`probe_model_gemms`: the block's matmuls alone).

    Collective when a process group is initialized (every rank of `group` must call it with the same
    arguments): the ranks probe their matmuls at the same time, as they compute during a step, and
    average the rates; rank 0 writes the cache. Only points missing from the cache are measured.
    """
    device = device or torch.device("cpu")
    path = cache_path or default_cache_path()
    kind = device_kind(device)
    if method not in ("block", "gemm"):
        raise ValueError(f"method={method!r} must be 'block' or 'gemm'")
    if method == "block" and seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be > 0 for the block probe")
    skey = shape_key(shape) + (f",seq={seq_len}" if method == "block" else "")
    distributed = dist.is_available() and dist.is_initialized()
    ranks = int(dist.get_world_size(group)) if distributed else 1
    comm_key = f"{dist.get_backend(group)}:{ranks}" if distributed else None
    entries = load_cache(path)
    entry = entries.get(kind, {}) if isinstance(entries.get(kind), dict) else {}
    gemm = {} if refresh else _cached_numbers(path, entry, method, skey)
    wanted = sorted({ShapedConstants.key(d, int(tok), int(ten)) for tok, ten in workloads for d in DTYPES})
    missing = [k for k in wanted if k not in gemm]
    sizes = sorted({int(x) for x in comm_sizes if x > 0} | ({4, 1 << 20} if comm_sizes else set()))
    comm_times = {} if refresh or comm_key is None else _cached_numbers(path, entry, "allreduce", comm_key)
    missing_sizes = [x for x in sizes if str(x) not in comm_times] if ranks > 1 else []
    flags = [int(bool(missing)), int(bool(missing_sizes))]
    if distributed:    # every rank must agree on what to probe (the probe is collective)
        agreed = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        flags = [int(x) for x in agreed.tolist()]
        # Ranks may hold different caches: when any rank misses a point, all measure every point,
        # so the collectives below see tensors of one length on every rank.
        if flags[0]:
            missing = wanted
        if flags[1]:
            missing_sizes = sizes
    if flags[0]:
        values: List[float] = []
        for k in missing:
            d, tok, ten = k.split(":")
            if method == "block":
                rate, overhead = probe_block(device, shape, int(tok[7:]), seq_len, int(ten[7:]), d == "bf16")
                values += [rate, overhead]
            else:
                values += [probe_model_gemms(device, shape, int(tok[7:]), int(ten[7:]), DTYPES[d]), 0.0]
        measured = torch.tensor(values, dtype=torch.float64)
        if distributed:
            dist.all_reduce(measured, group=group)
            measured /= ranks
        for i, k in enumerate(missing):
            gemm[k] = float(measured[2 * i])
            if method == "block":
                gemm[k + ":overhead"] = float(measured[2 * i + 1])
    if flags[1]:
        probed = probe_all_reduce_sizes(device if device.type == "cuda" else torch.device("cpu"), missing_sizes, group)
        comm_times.update({str(k): v for k, v in probed.items()})
    bandwidth = latency = None
    if ranks > 1 and len([x for x in sizes if str(x) in comm_times]) >= 2:
        bandwidth, latency = fit_bandwidth({x: comm_times[str(x)] for x in sizes if str(x) in comm_times}, ranks)
    if any(flags) and (not distributed or dist.get_rank() == 0):
        new_entry = dict(entry)
        new_entry[method] = {**_mapping(entry.get(method)), skey: gemm}
        if comm_key is not None and comm_times:
            new_entry["allreduce"] = {**_mapping(entry.get("allreduce")), comm_key: comm_times}
        new_entry["measured"] = _now()
        try:
            _save_cache(path, {**entries, kind: new_entry})
        except OSError as e:
            logger.warning("could not write the calibration cache %s: %s", path, e)
    overheads = {k: gemm[k + ":overhead"] for k in wanted if k + ":overhead" in gemm}
    return ShapedConstants(kind, skey, {k: gemm[k] for k in wanted}, bandwidth, latency, overheads)


# -- the cost model as a predictor ------------------------------------------------------------

def cost_model_predictor(model_or_shape: Any, batch_size: int, seq_len: int, world_size: int,
                         device: Any = "cpu",
                         profile: Union[None, Mapping[str, float], ShapedConstants] = None) -> Predictor:
    """`strategy -> Estimate` from the cost model, with `gradient_accumulation` accounted for.

    A strategy accumulating over k micro-batches is estimated as one micro-step at the global
    batch / k (its activation memory), then the step's time: compute and per-layer overhead
    k times, gradient reductions once (they are skipped on the other micro-steps), parameter
    gathers of FSDP2 k times. `profile`: rate overrides for every strategy, or `ShapedConstants`,
    from which each strategy gets the rates probed at its own tokens per rank and tensor split.
    """
    # Block activations measured by the activation probe, as `estimate` does (`shape_of`).
    shape = shape_of(model_or_shape, seq_len)

    def predict(strategy: StrategyLike) -> Estimate:
        s = Strategy.from_any(strategy)
        rates: Optional[Mapping[str, float]]
        if isinstance(profile, ShapedConstants):
            tokens, tensor, _, half = strategy_workload(shape, s, batch_size, seq_len, world_size)
            rates = profile.profile_for(tokens, tensor, half)
        else:
            rates = profile
        ga = s.get("gradient_accumulation")
        steps = _steps(ga.config) if ga is not None else 1
        if steps == 1:
            return estimate(shape, s, batch_size, seq_len, world_size, device, profile=rates)
        base = Strategy(i for i in s if i.name != "gradient_accumulation")
        micro = estimate(shape, base, max(1, batch_size // steps), seq_len, world_size, device, profile=rates)
        traits = StrategyTraits.from_strategy(base, world_size, shape)
        comm_repeats = steps if traits.param_shard > 1 else 1
        b = dict(micro.breakdown)
        b["time_compute"] *= steps
        b["time_overhead"] *= steps
        b["time_communication"] *= comm_repeats
        return Estimate(micro.peak_memory_bytes, sum(b[k] for k in COMPONENTS), b)

    return predict


def _steps(config: Any) -> int:
    if isinstance(config, int):
        return config
    if isinstance(config, Mapping):
        return int(config.get("steps", 1))
    return int(getattr(config, "steps", 1))


# -- refit --------------------------------------------------------------------------------------

def _features(est: Estimate) -> np.ndarray:
    return np.array([float(est.breakdown.get(k, 0.0)) for k in COMPONENTS])


def fit_weights(features: np.ndarray, measured: np.ndarray, prior_strength: float = 0.1) -> np.ndarray:
    """Non-negative weights w (one per component) with features @ w ~ measured.

    Minimizes sum_i (features_i . w / measured_i - 1)^2 + prior_strength * sum_j (w_j / s - 1)^2,
    s = the median of measured / (features . 1): relative errors, so fast and slow candidates
    count alike, and a prior that keeps the base model's proportions (rescaled by s) until the
    observations say otherwise. `prior_strength` is in units of one observation's squared
    relative error: at 0.1 a handful of consistent observations outweigh it, while one or two
    only rescale (the data then cannot tell the components apart).
    """
    from scipy.optimize import nnls

    features = np.asarray(features, dtype=float)
    measured = np.asarray(measured, dtype=float)
    if features.ndim != 2 or features.shape[0] != measured.shape[0] or features.shape[0] == 0:
        raise ValueError(f"fit_weights needs one row of features per measurement, got {features.shape} and "
                         f"{measured.shape}")
    totals = features.sum(axis=1)
    scale = float(np.median(measured / np.maximum(totals, 1e-30)))
    k = features.shape[1]
    rows = features / measured[:, None]
    prior = math.sqrt(prior_strength) * np.eye(k) / scale
    a = np.vstack([rows, prior])
    b = np.concatenate([np.ones(len(measured)), np.full(k, math.sqrt(prior_strength))])
    weights, _ = nnls(a, b)
    return weights


def option_keys(strategy: StrategyLike) -> Tuple[str, ...]:
    """The options a strategy is made of, as keys a per-option correction can be learned for.

    One key per item (its name, with its config when it has one: `amp_native:{"dtype": ...}`),
    and one per parallel dimension of size > 1 (`parallel_mode:tensor=2`) instead of the layout
    as a whole, so that what is learned about tensor=2 applies to every candidate using it.
    """
    keys: List[str] = []
    for item in Strategy.from_any(strategy):
        if item.name == "parallel_mode":
            dims = _layout(item.config)
            if dims is not None:
                keys.extend(f"parallel_mode:{k}={v}" for k, v in sorted(dims.items()) if v > 1)
                continue
        if item.config is None:
            keys.append(item.name)
        else:
            keys.append(f"{item.name}:{json.dumps(item.config, sort_keys=True, default=repr)}")
    return tuple(sorted(set(keys)))


def _layout(config: Any) -> Optional[Dict[str, int]]:
    """{dim: size} of a parallel_mode config ({} for none), or None when it has another form."""
    if config is None:
        return {}
    dims = getattr(config, "dims", None)
    if dims is None and isinstance(config, (tuple, list)) and config and isinstance(config[0], (tuple, list)):
        dims = config[0]
    if dims is None:
        return None
    try:
        return {str(name): int(size) for name, size in dims}
    except (TypeError, ValueError):
        return None


def fit_option_effects(keys: Sequence[Sequence[str]], residuals: Sequence[float], ridge: float = 2.0,
                       huber_delta: float = 0.1, iterations: int = 10) -> Tuple[float, Dict[str, float]]:
    """(bias, effect per option) with residual_i ~ bias + sum of the effects of row i's options.

    `residuals` are log(measured / predicted). The bias is free (it rescales every candidate
    alike, so it never reorders them); the effects are ridge-shrunk towards 0 with strength
    `ridge` in units of one observation, so an option seen in one or two trials gets a fraction
    of its apparent effect and one trial (whose residual the bias absorbs) changes no ranking.
    A Huber loss (quadratic within max(`huber_delta`, 1.345 x the residuals' robust sigma) in
    log units, linear beyond), by iterated reweighting, keeps one wild measurement from dragging
    the effects of its options.
    """
    if ridge <= 0:
        raise ValueError(f"ridge={ridge!r} must be > 0 (0 would let one trial set an option's effect)")
    y = np.asarray(residuals, dtype=float)
    if len(keys) != len(y) or len(y) == 0:
        raise ValueError(f"fit_option_effects needs one key list per residual, got {len(keys)} and {len(y)}")
    names = sorted({k for row in keys for k in row})
    index = {k: j for j, k in enumerate(names)}
    x = np.zeros((len(y), len(names) + 1))
    x[:, 0] = 1.0
    for i, row in enumerate(keys):
        for k in row:
            x[i, 1 + index[k]] = 1.0
    penalty = np.full(len(names) + 1, float(ridge))
    penalty[0] = 0.0   # the bias is free: it rescales all candidates alike
    weights = np.ones(len(y))
    for _ in range(iterations):
        xtw = x.T * weights
        coef = np.linalg.solve(xtw @ x + np.diag(penalty), xtw @ y)
        r = np.abs(y - x @ coef)
        # The threshold follows the residuals' own spread (1.345 sigma, sigma from the median
        # absolute residual), floored at huber_delta: a fit whose residuals are all alike (a
        # shrunk but consistent fit) keeps every point at full weight; one point far beyond
        # the others is downweighted.
        delta = max(huber_delta, 1.345 * 1.4826 * float(np.median(r)))
        new = np.where(r <= delta, 1.0, delta / np.maximum(r, 1e-12))
        if np.allclose(new, weights):
            break
        weights = new
    return float(coef[0]), {k: float(coef[1 + j]) for k, j in index.items()}


class LearningPredictor:
    """A predictor (`strategy -> Estimate`) whose step times are refitted on every observed dry run.

    `base` must return estimates with the cost model's breakdown (time_compute, time_overhead,
    time_communication), e.g. `cost_model_predictor(...)` with probed constants. Two refits,
    one after the other, on every observation:

    1. (`fit_components`) one non-negative weight per part (`fit_weights`): rescales compute
       against overhead against communication;
    2. (`option_ridge`, None: off) per-option corrections (`fit_option_effects`): the log of
       measured / predicted explained as a bias plus one effect per option (`option_keys`),
       ridge-shrunk towards 0. The prediction of a candidate not yet run is multiplied by
       exp(bias + the effects of its options): what the cost model misjudges about an option
       (autocast's casts on a CPU, a sharder's per-step bookkeeping) is learned from the
       candidates that used it and applied to those that have not run. Options never observed
       get no correction.

    Before any observation it predicts exactly what `base` does. A search uses it by calling
    `observe(strategy, global_batch / throughput)` after each successful dry run and predicting
    the remaining candidates again (base estimates are cached).
    """

    def __init__(self, base: Predictor, prior_strength: float = 0.1, option_ridge: Optional[float] = 2.0,
                 fit_components: bool = True, huber_delta: float = 0.1) -> None:
        if prior_strength <= 0:
            raise ValueError(f"prior_strength={prior_strength!r} must be > 0")
        if option_ridge is not None and option_ridge <= 0:
            raise ValueError(f"option_ridge={option_ridge!r} must be > 0 (or None: no per-option corrections)")
        if huber_delta <= 0:
            raise ValueError(f"huber_delta={huber_delta!r} must be > 0")
        self.base = base
        self.prior_strength = prior_strength
        self.option_ridge = option_ridge
        self.fit_components = fit_components
        self.huber_delta = huber_delta
        self.weights = np.ones(len(COMPONENTS))
        self.bias = 0.0
        self.effects: Dict[str, float] = {}
        self._observed: Dict[str, Tuple[np.ndarray, float, Tuple[str, ...]]] = {}
        self._cache: Dict[str, Tuple[Estimate, Tuple[str, ...]]] = {}

    def _base(self, strategy: StrategyLike) -> Tuple[Estimate, Tuple[str, ...]]:
        s = Strategy.from_any(strategy)
        key = repr(s)
        if key not in self._cache:
            self._cache[key] = (self.base(s), option_keys(s))
        return self._cache[key]

    def correction(self, strategy: StrategyLike) -> float:
        """The factor the per-option refit multiplies `strategy`'s step time by (1.0 before any trial)."""
        _, keys = self._base(strategy)
        return math.exp(self.bias + sum(self.effects.get(k, 0.0) for k in keys))

    def __call__(self, strategy: StrategyLike) -> Estimate:
        est, keys = self._base(strategy)
        x = _features(est)
        if not x.any():
            return est
        factor = math.exp(self.bias + sum(self.effects.get(k, 0.0) for k in keys))
        step = float(x @ self.weights) * factor
        weighted = {k: float(est.breakdown.get(k, 0.0)) * float(w) * factor
                    for k, w in zip(COMPONENTS, self.weights)}
        return Estimate(est.peak_memory_bytes, step, {**est.breakdown, **weighted})

    def observe(self, strategy: StrategyLike, measured_step_time_s: float) -> None:
        """Record a measured step time (seconds per optimizer step) and refit. A repeated strategy
        keeps its latest measurement; failed trials are not observations (pass nothing)."""
        if not (isinstance(measured_step_time_s, (int, float)) and measured_step_time_s > 0
                and math.isfinite(measured_step_time_s)):
            raise ValueError(f"measured_step_time_s={measured_step_time_s!r} must be a finite number > 0")
        s = Strategy.from_any(strategy)
        est, keys = self._base(s)
        x = _features(est)
        if not x.any():
            return
        self._observed[repr(s)] = (x, float(measured_step_time_s), keys)
        xs = np.stack([v[0] for v in self._observed.values()])
        ys = np.array([v[1] for v in self._observed.values()])
        if self.fit_components:
            self.weights = fit_weights(xs, ys, self.prior_strength)
        if self.option_ridge is not None:
            residuals = np.log(ys / np.maximum(xs @ self.weights, 1e-30))
            self.bias, self.effects = fit_option_effects([v[2] for v in self._observed.values()], residuals,
                                                         self.option_ridge, self.huber_delta)

    @property
    def observations(self) -> int:
        return len(self._observed)

    def describe(self) -> Dict[str, float]:
        """The fitted weights per component, the bias and the per-option effects (log units)."""
        return {**dict(zip(COMPONENTS, (float(w) for w in self.weights))), "bias": self.bias,
                **{f"effect {k}": v for k, v in sorted(self.effects.items())}}


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b between two score lists (ties counted as neither concordant nor discordant)."""
    from scipy.stats import kendalltau

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"kendall_tau needs two lists of equal length >= 2, got {len(a)} and {len(b)}")
    return float(kendalltau(a, b).statistic)


__all__ = ["COMPONENTS", "DeviceConstants", "LearningPredictor", "ShapedConstants", "calibrate_device",
           "calibrate_model", "cost_model_predictor", "default_cache_path", "device_kind", "fit_bandwidth",
           "fit_option_effects", "fit_weights", "kendall_tau", "load_cache", "model_gemms", "option_keys",
           "probe_all_reduce", "probe_all_reduce_sizes", "probe_block", "probe_matmul", "probe_model_gemms",
           "shape_key", "strategy_workload"]
