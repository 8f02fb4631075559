"""Rates of one device kind: one large matmul per dtype, the all-reduce bandwidth and latency (cached)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from atorch.auto.calibration.cache import Measurement, default_cache_path, measure_cached, probe_device
from atorch.auto.devices import cpu_model_name

logger = logging.getLogger(__name__)


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_matmul(device: torch.device, dtype: torch.dtype, size: int = 0, min_seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls of `size` (default: 512 on CPU, 4096 on GPU), median over repeats."""
    size = size or (4096 if device.type == "cuda" else 512)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b   # warm-up (kernel selection, allocation)
    synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 2.0 * size ** 3 / statistics.median(times)


def time_all_reduce(device: torch.device, numel: int, group: Any, repeats: int) -> float:
    """Seconds of one all-reduce of `numel` fp32 elements over `group`: the median of `repeats`
    (after a warm-up), the slowest rank's, so every rank returns the same. Collective."""
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)   # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        synchronize(device)
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
    latency = time_all_reduce(device, 1, group, repeats)
    large = time_all_reduce(device, large_bytes // 4, group, repeats)
    bus_bytes = 2.0 * (n - 1) / n * large_bytes
    return bus_bytes / max(large - latency, 1e-9), latency


def calibrate_device(device: Optional[torch.device] = None, group: Any = None, *, cache_path: Optional[str] = None,
                     refresh: bool = False) -> DeviceConstants:
    """This device's constants, measured on first use and read from the cache afterwards.

    Collective when a process group is initialized (every rank of `group` must call it): the
    collectives are probed over `group` (default: the world) and the matmul rates averaged
    over its ranks, so every rank gets the same constants. Rank 0 writes the cache.
    """
    device = device or torch.device("cpu")
    kind = device_kind(device)
    distributed = dist.is_available() and dist.is_initialized()
    comm_key = f"{dist.get_backend(group)}:{dist.get_world_size(group)}" if distributed else None

    def measure_compute(names: List[str]) -> Dict[str, float]:
        dtypes = {"flops_fp32": torch.float32, "flops_bf16": torch.bfloat16}
        return {name: probe_matmul(device, dtypes[name]) for name in names}

    def measure_comm(names: List[str]) -> Dict[str, float]:
        bandwidth, latency = probe_all_reduce(probe_device(group, device), group)
        return {"comm_bytes_per_s": bandwidth, "comm_latency_s": latency}

    measurements = [Measurement(("compute",), ("flops_fp32", "flops_bf16"), measure_compute, whole=True)]
    if comm_key is not None and dist.get_world_size(group) > 1:
        measurements.append(Measurement(("comm", comm_key), ("comm_bytes_per_s", "comm_latency_s"), measure_comm,
                                        per_rank=False, whole=True))
    compute, *comm = measure_cached(cache_path or default_cache_path(), kind, measurements, group, refresh)
    if not comm:
        return DeviceConstants(kind, compute["flops_fp32"], compute["flops_bf16"])
    return DeviceConstants(kind, compute["flops_fp32"], compute["flops_bf16"], comm_key, comm[0]["comm_bytes_per_s"],
                           comm[0]["comm_latency_s"])
