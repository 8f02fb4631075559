"""Training throughput metrics: FLOPs per token, achieved TFLOPs, MFU/HFU, device peaks, peak memory.

One parseable `key=value` line per log step (`format`/`parse_metrics_line`), so scripts, tests
and dashboards read the same numbers.

Conventions (per token, one training step = forward + backward):
- N = *matmul parameters*: every parameter except embedding lookup tables (`nn.Embedding`
  weights, token and position). A lookup does no multiply; the LM head does, so it counts, and a
  weight tied to both counts once. Norm weights are included (negligible).
- Model FLOPs = 2N (forward) + 2N (backward, gradient w.r.t. activations)
  + 2 N_trainable (backward, gradient w.r.t. weights) + attention. With every weight trained this
  is the usual 6N; frozen weights (LoRA) skip their weight-gradient matmuls.
- Attention = 12 * layers * hidden * seq_len: QK^T and AV cost 2 * seq_len * hidden each
  forward, backward twice the forward. The full seq_len x seq_len square is counted (no causal
  halving), the PaLM / Megatron-LM convention, so figures compare with published MFU.
- Hardware FLOPs add what activation checkpointing recomputes: a second forward of the
  checkpointed blocks, 2 * N_recomputed + 4 * recomputed_layers * hidden * seq_len.
- MFU = achieved model FLOPs/s per device / peak; HFU = hardware FLOPs/s per device / peak.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import resource
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

# -- FLOPs per token -------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerFlops:
    """What the FLOPs count needs to know about a decoder-only transformer and its training run."""

    matmul_params: int
    """N: parameters that take part in matrix multiplies (see the module docstring)."""
    num_layers: int
    hidden_size: int
    seq_len: int
    """Tokens per sample (the attention span)."""
    trainable_matmul_params: Optional[int] = None
    """Matmul parameters that receive gradients; None means all of them (full training)."""
    recomputed_params: int = 0
    """Matmul parameters whose forward activation checkpointing runs a second time; 0 without it."""
    recomputed_layers: int = 0
    """Attention layers whose forward is recomputed; 0 without activation checkpointing."""

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 0:
                raise ValueError(f"TransformerFlops.{f.name}={value} must be >= 0")
        for name in ("num_layers", "hidden_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerFlops.{name}={getattr(self, name)} must be >= 1")
        if self.trainable_matmul_params is not None and self.trainable_matmul_params > self.matmul_params:
            raise ValueError(f"trainable_matmul_params={self.trainable_matmul_params} exceeds matmul_params="
                             f"{self.matmul_params}")
        if self.recomputed_params > self.matmul_params:
            raise ValueError(f"recomputed_params={self.recomputed_params} exceeds matmul_params={self.matmul_params}")
        if self.recomputed_layers > self.num_layers:
            raise ValueError(f"recomputed_layers={self.recomputed_layers} exceeds num_layers={self.num_layers}")

    @property
    def attention_flops_per_token(self) -> float:
        """Forward + backward of QK^T and AV over the full seq_len square."""
        return 12.0 * self.num_layers * self.hidden_size * self.seq_len

    @property
    def model_flops_per_token(self) -> float:
        """Training FLOPs the model needs per token: 6N (4N + 2N_trainable) + attention."""
        trainable = self.matmul_params if self.trainable_matmul_params is None else self.trainable_matmul_params
        return 4.0 * self.matmul_params + 2.0 * trainable + self.attention_flops_per_token

    @property
    def hardware_flops_per_token(self) -> float:
        """Model FLOPs plus the forward that activation checkpointing recomputes."""
        recompute = 2.0 * self.recomputed_params + 4.0 * self.recomputed_layers * self.hidden_size * self.seq_len
        return self.model_flops_per_token + recompute

    @classmethod
    def from_model(cls, model: nn.Module, seq_len: int, checkpointing_enabled: bool = False,
                   block_classes: Optional[Tuple[type, ...]] = None) -> "TransformerFlops":
        """Count from an *unwrapped* model (before FSDP, tensor parallel or DeepSpeed shard it).

        `checkpointing_enabled`: every transformer block (`block_classes`, auto-detected when
        None) is recomputed once in the backward pass, as the `checkpoint` optimization does.
        """
        config = getattr(model, "config", None)
        hidden = _config_value(config, ("hidden_size", "n_embd", "d_model"))
        layers = _config_value(config, ("num_hidden_layers", "n_layer", "num_layers"))
        recomputed_params = recomputed_layers = 0
        if checkpointing_enabled:
            if block_classes is None:
                from atorch.utils.module_utils import find_transformer_block_classes

                block_classes = tuple(find_transformer_block_classes(model))
            blocks = [m for m in model.modules() if block_classes and isinstance(m, block_classes)]
            if not blocks:
                raise ValueError(f"checkpointing_enabled=True but no transformer block of {type(model).__name__} was "
                                 "found; pass block_classes")
            recomputed_params = sum(matmul_parameter_count(b) for b in blocks)
            recomputed_layers = len(blocks)
        flops = cls(matmul_params=matmul_parameter_count(model), num_layers=layers, hidden_size=hidden,
                    seq_len=seq_len, trainable_matmul_params=matmul_parameter_count(model, trainable_only=True),
                    recomputed_params=recomputed_params, recomputed_layers=recomputed_layers)
        flops.validate()
        return flops


def _config_value(config: object, names: Tuple[str, ...]) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"the model config {type(config).__name__} has none of {list(names)}; build TransformerFlops "
                     "by hand")


def matmul_parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters of `model` that take part in matrix multiplies: all but embedding lookup tables.

    A parameter shared by an `nn.Embedding` and another module (a tied LM head) is multiplied
    there, so it counts, once.
    """
    in_embedding: set = set()
    in_other: set = set()
    for module in model.modules():
        target = in_embedding if isinstance(module, nn.Embedding) else in_other
        target.update(id(p) for p in module.parameters(recurse=False))
    seen: set = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        if id(p) in in_other or id(p) not in in_embedding:
            total += p.numel()
    return total


# -- Device peaks ----------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peaks in TFLOPs from the vendors' datasheets, per GPU.
# Patterns are matched against torch.cuda.get_device_name() in order, with word boundaries,
# so "H100 PCIe" is tried before "H100" and "A10" does not match "A100" or "A10G".
GPU_PEAK_TFLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H800 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H800", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H20", {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: Optional[torch.dtype], tf32_enabled: bool = False) -> str:
    """The peak-table key for a training compute dtype (None = fp32, or tf32 when enabled)."""
    name = _DTYPE_NAMES.get(dtype if dtype is not None else torch.float32)
    if name is None:
        raise ValueError(f"no peak-table entry for dtype {dtype}; expected one of {list(_DTYPE_NAMES)}")
    return "tf32" if name == "fp32" and tf32_enabled else name


def gpu_peak_tflops(device_name: str, dtype: str = "bf16") -> Optional[float]:
    """Dense peak TFLOPs of a known GPU in `dtype` ("bf16", "fp16", "tf32", "fp32"); None if unknown."""
    for pattern, peaks in GPU_PEAK_TFLOPS:
        if re.search(r"(?<![A-Za-z0-9])" + re.escape(pattern) + r"(?![A-Za-z0-9])", device_name):
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class DevicePeak:
    """The peak a device is measured against, and where the number comes from."""

    tflops: Optional[float]
    """None when unknown: MFU and HFU are then reported as nan."""
    source: str


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_tflops(size: int = 1024, dtype: torch.dtype = torch.float32, rounds: int = 5,
                              threads: Optional[int] = None) -> float:
    """Best achieved TFLOPs of a `size` x `size` matmul on this CPU, with torch's current threads.

    Measured once per process (cached): `rounds` rounds of repeated matmuls, the fastest kept,
    since the slower ones measure interference, not the hardware.
    """
    del threads  # part of the cache key only: a different thread count is a different peak
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        repeats = 0
        while True:
            torch.mm(a, b)
            repeats += 1
            elapsed = time.perf_counter() - start
            if elapsed >= 0.05:
                break
        best = min(best, elapsed / repeats)
    return 2.0 * size ** 3 / best / 1e12


def device_peak(device: torch.device, dtype: str = "bf16", override_tflops: Optional[float] = None) -> DevicePeak:
    """The peak for MFU/HFU: a user value, the GPU table, or on CPU a measured matmul probe."""
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"peak TFLOPs override must be > 0, got {override_tflops}")
        return DevicePeak(float(override_tflops), f"user-given peak ({dtype})")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, dtype)
        if peak is None:
            return DevicePeak(None, f"unknown peak for {name!r} in {dtype}: MFU/HFU not computed (pass a peak)")
        return DevicePeak(peak, f"datasheet dense {dtype} peak of {name}")
    if device.type == "cpu":
        torch_dtype = {v: k for k, v in _DTYPE_NAMES.items()}.get(dtype, torch.float32)
        threads = torch.get_num_threads()
        peak = measure_cpu_matmul_tflops(dtype=torch_dtype, threads=threads)
        return DevicePeak(peak, f"measured CPU matmul peak ({_DTYPE_NAMES[torch_dtype]}, {threads} threads, "
                                "1024x1024)")
    return DevicePeak(None, f"no peak known for device type {device.type!r}")


# -- Peak memory ------------------------------------------------------------------------------


def peak_memory_mb(device: torch.device) -> Tuple[float, str]:
    """(peak MiB, what was measured): the GPU allocator's high-water mark, or the process RSS one.

    On CPU this is deliberately not `atorch.utils.peak_memory.PeakMemoryTracker`: its exact count
    sees every op through a dispatch mode, which made a tiny Llama training step about 2x slower
    (benchmarks/llama2_examples.py), too costly next to the throughput this line reports. The RSS
    mark includes the runtime and libraries and never goes down.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20, "GPU allocator max_memory_allocated"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return maxrss * scale / 2 ** 20, "process RSS high-water mark"


# -- The metrics line ----------------------------------------------------------------------------

METRIC_KEYS = ("step", "loss", "step_s", "samples_s", "tokens_s_per_device", "tflops_model", "tflops_hw", "mfu",
               "hfu", "peak_mem_mb")


@dataclass(frozen=True)
class StepMetrics:
    """Throughput of one logging window, per the conventions of this module."""

    step: int
    loss: float
    step_s: float
    """Wall seconds per optimizer step, averaged over the window."""
    samples_s: float
    """Global samples per second (all devices)."""
    tokens_s_per_device: float
    tflops_model: float
    """Achieved model TFLOPs per device."""
    tflops_hw: float
    """Achieved hardware TFLOPs per device (recomputation included)."""
    mfu: float
    hfu: float
    peak_mem_mb: float

    def format(self) -> str:
        """`step=20 loss=3.1234 step_s=0.2100 ...`: one line, every value a plain number."""
        values = (f"{self.step:d}", f"{self.loss:.4f}", f"{self.step_s:.4f}", f"{self.samples_s:.2f}",
                  f"{self.tokens_s_per_device:.1f}", f"{self.tflops_model:.6g}", f"{self.tflops_hw:.6g}",
                  f"{self.mfu:.6g}", f"{self.hfu:.6g}", f"{self.peak_mem_mb:.1f}")
        return " ".join(f"{k}={v}" for k, v in zip(METRIC_KEYS, values))


def parse_metrics_line(line: str) -> Optional[Dict[str, float]]:
    """The metrics of a line written by `StepMetrics.format` (anywhere in `line`), else None."""
    found = dict(re.findall(r"(?:^|\s)([a-z_]+)=(\S+)", line))
    if not all(k in found for k in METRIC_KEYS):
        return None
    try:
        return {k: float(found[k]) for k in METRIC_KEYS}
    except ValueError:
        return None


def compute_step_metrics(step: int, loss: float, seconds: float, steps: int, global_batch_size: int, seq_len: int,
                         num_devices: int, flops: TransformerFlops, peak: DevicePeak,
                         peak_mem_mb: float) -> StepMetrics:
    """Metrics of a window of `steps` optimizer steps that took `seconds` in all."""
    if steps < 1 or seconds <= 0 or num_devices < 1:
        raise ValueError(f"need steps >= 1, seconds > 0, num_devices >= 1; got steps={steps}, seconds={seconds}, "
                         f"num_devices={num_devices}")
    step_s = seconds / steps
    samples_s = global_batch_size / step_s
    tokens_s_per_device = samples_s * seq_len / num_devices
    tflops_model = tokens_s_per_device * flops.model_flops_per_token / 1e12
    tflops_hw = tokens_s_per_device * flops.hardware_flops_per_token / 1e12
    if peak.tflops:
        mfu, hfu = tflops_model / peak.tflops, tflops_hw / peak.tflops
    else:
        mfu = hfu = math.nan
    return StepMetrics(step, loss, step_s, samples_s, tokens_s_per_device, tflops_model, tflops_hw, mfu, hfu,
                       peak_mem_mb)


class ThroughputMeter:
    """Times windows of optimizer steps and turns each into `StepMetrics`.

    Call `start()` before the first step, `step()` after each, and `report(step, loss)` at a log
    step; the window restarts after each report. Work that is not training (saving a checkpoint)
    runs inside `with meter.paused():` and is left out. On CUDA the clock waits for queued kernels.
    """

    def __init__(self, flops: TransformerFlops, global_batch_size: int, seq_len: int, num_devices: int,
                 peak: DevicePeak, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        flops.validate()
        self.flops = flops
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.num_devices = num_devices
        self.peak = peak
        self.device = device
        self._clock = clock
        self._window_start: Optional[float] = None
        self._window_steps = 0
        self._paused_s = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._clock()

    def start(self) -> None:
        self._window_start = self._now()
        self._window_steps = 0
        self._paused_s = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of the current window."""
        begin = self._now()
        try:
            yield
        finally:
            self._paused_s += self._now() - begin

    def step(self) -> None:
        self._window_steps += 1

    def report(self, step: int, loss: float) -> StepMetrics:
        if self._window_start is None or self._window_steps == 0:
            raise RuntimeError("ThroughputMeter.report() needs start() and at least one step()")
        now = self._now()
        seconds = now - self._window_start - self._paused_s
        metrics = compute_step_metrics(step, loss, seconds, self._window_steps, self.global_batch_size, self.seq_len,
                                       self.num_devices, self.flops, self.peak, peak_memory_mb(self.device)[0])
        self._window_start, self._window_steps, self._paused_s = now, 0, 0.0
        return metrics
