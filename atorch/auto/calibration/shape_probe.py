"""Rates probed at the model's own shapes: its GEMMs per token count, tensor split and dtype, one
transformer block, and the all-reduce at the sizes the strategies move (cached per shape).

One large square matmul overstates what a small model reaches (measured: fp32 1.8e11 FLOP/s from
512^3 against the ~4e10 the tiny Llama's step implies), and the probe that used it ranked worse than
the built-in constants. So the rates the predictor divides by are measured on the GEMMs the step
runs -- tokens x hidden x {hidden, kv, intermediate, vocab}, forward and both backward products, per
tensor-parallel split and dtype -- and the all-reduce at the sizes the strategies move (gradient
buckets, tensor-parallel activations).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from atorch.auto.calibration.cache import Measurement, default_cache_path, measure_cached, probe_device
from atorch.auto.calibration.device_probe import device_kind, synchronize, time_all_reduce
from atorch.auto.cost_model import ModelShape, StrategyTraits, micro_batch_size
from atorch.auto.cost_model.step_time import block_params, forward_backward_flops
from atorch.auto.strategy import StrategyLike

logger = logging.getLogger(__name__)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_OVERHEAD = ":overhead"     # a probed point's per-layer overhead, cached next to its rate (block probe)
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
    synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_seconds and len(times) < 500):
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
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
    """The cost model's FLOPs of one block's forward + backward for `tokens`, counted as `time_breakdown`
    counts them (the parameters a token multiplies, so a mixture of experts' top-k only, as
    `_ProbeBlock` computes them), so the rate probed here is the rate the cost model divides by."""
    return forward_backward_flops(tokens, seq_len, block_params(shape), 1, shape.q_dim, tensor)


def _time_block(block: torch.nn.Module, device: torch.device, half: bool, batch: int, seq_len: int,
                hidden: int, min_seconds: float) -> float:
    x = torch.randn(batch, seq_len, hidden, device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            out = block(x)
        out.float().sum().backward()

    step()   # warm-up
    synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        step()
        synchronize(device)
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
    return {int(size): time_all_reduce(device, max(1, int(size) // 4), group, repeats) for size in sizes}


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
    """(tokens per rank per forward/backward pass, tensor split, all-reduce byte sizes, computes in half)
    of a strategy: where to probe, and which probed rates it gets."""
    traits = StrategyTraits.from_strategy(strategy, world_size, shape)
    tokens = micro_batch_size(traits, batch_size) * seq_len      # one pass: accumulation's and a pipeline's
    sizes: List[int] = []
    if traits.data > 1:
        grad_bytes = shape.num_params / traits.tensor * traits.trainable_fraction * 4
        sizes.append(int(min(grad_bytes, GRADIENT_BUCKET_BYTES)))
    if traits.tensor > 1:
        sizes.append(int(tokens * shape.hidden_size * traits.compute_dtype_bytes))
    return tokens, traits.tensor, sizes, traits.compute_dtype_bytes == 2


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
    if method not in ("block", "gemm"):
        raise ValueError(f"method={method!r} must be 'block' or 'gemm'")
    if method == "block" and seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be > 0 for the block probe")
    skey = shape_key(shape) + (f",seq={seq_len}" if method == "block" else "")
    distributed = dist.is_available() and dist.is_initialized()
    ranks = int(dist.get_world_size(group)) if distributed else 1
    wanted = sorted({ShapedConstants.key(d, int(tok), int(ten)) for tok, ten in workloads for d in DTYPES})
    sizes = sorted({int(x) for x in comm_sizes if x > 0} | ({4, 1 << 20} if comm_sizes else set()))

    def measure_rates(names: List[str]) -> Dict[str, float]:
        measured: Dict[str, float] = {}
        for point in sorted({name[:-len(_OVERHEAD)] if name.endswith(_OVERHEAD) else name for name in names}):
            d, tok, ten = point.split(":")
            if method == "block":
                rate, overhead = probe_block(device, shape, int(tok[7:]), seq_len, int(ten[7:]), d == "bf16")
                measured.update({point: rate, point + _OVERHEAD: overhead})
            else:
                measured[point] = probe_model_gemms(device, shape, int(tok[7:]), int(ten[7:]), DTYPES[d])
        return measured

    def measure_comm(names: List[str]) -> Dict[str, float]:
        probed = probe_all_reduce_sizes(probe_device(group, device), [int(n) for n in names], group)
        return {str(k): v for k, v in probed.items()}

    rate_names = [k + suffix for k in wanted for suffix in (("", _OVERHEAD) if method == "block" else ("",))]
    measurements = [Measurement((method, skey), rate_names, measure_rates)]
    if ranks > 1 and sizes:
        comm_key = f"{dist.get_backend(group)}:{ranks}"
        measurements.append(Measurement(("allreduce", comm_key), [str(x) for x in sizes], measure_comm,
                                        per_rank=False))
    kind = device_kind(device)
    rates, *comm = measure_cached(cache_path or default_cache_path(), kind, measurements, group, refresh)
    bandwidth = latency = None
    if comm:    # at least two sizes, 4 bytes and 1 MiB among them
        bandwidth, latency = fit_bandwidth({x: comm[0][str(x)] for x in sizes}, ranks)
    overheads = {k: rates[k + _OVERHEAD] for k in wanted if k + _OVERHEAD in rates}
    return ShapedConstants(kind, skey, {k: rates[k] for k in wanted}, bandwidth, latency, overheads)
