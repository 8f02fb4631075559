"""Accelerators the planner knows by name: memory and the rates its step-time model divides by.

Peak FLOP/s are the vendors' dense datasheet figures (no sparsity) scaled by `MATMUL_EFFICIENCY`,
the fraction large transformer matmuls reach in practice; bandwidths are per device, intra-node
(NVLink) and inter-node (one InfiniBand/RoCE NIC per GPU, the common HPC layout). They feed
`cost_model.estimate(..., profile=...)`, so only their ratios matter for ranking strategies; a
calibration on the real machine (`atorch.auto.calibration`) replaces them where one exists.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Dict

# Achieved / datasheet for large bf16 GEMMs (typical of MFU-oriented training stacks).
MATMUL_EFFICIENCY = 0.6


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind."""

    name: str
    memory_bytes: int
    bf16_flops: float            # dense datasheet peak
    fp32_flops: float            # dense datasheet peak (TF32 tensor cores where the device has them)
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float = 1e-5
    host_bytes_per_s: float = 0.0  # host <-> device copies (CPU offload): the PCIe link; 0: host memory is the device's

    def profile(self, multi_node: bool, ranks_per_node: int = 0) -> Dict[str, float]:
        """The rates `cost_model.estimate` takes as `profile`. On several nodes a collective uses the
        inter-node link unless its group fits in one node of `ranks_per_node` devices (0: unknown)."""
        bandwidth = self.inter_node_bytes_per_s if multi_node else self.intra_node_bytes_per_s
        rates = {"flops_bf16": self.bf16_flops * MATMUL_EFFICIENCY, "flops_fp32": self.fp32_flops * MATMUL_EFFICIENCY,
                 "comm_bytes_per_s": bandwidth, "comm_latency_s": self.latency_s * (4 if multi_node else 1),
                 "layer_overhead_s": 2e-4, "step_overhead_s": 2e-3}
        if multi_node and ranks_per_node > 0:
            rates.update(ranks_per_node=float(ranks_per_node), intra_node_bytes_per_s=self.intra_node_bytes_per_s)
        if self.host_bytes_per_s:
            # DeepSpeed's CPU Adam steps about 1e9 parameters/s per rank (its paper's order of magnitude).
            rates.update(host_bytes_per_s=self.host_bytes_per_s, host_optimizer_params_per_s=1e9)
        return rates


# Host links: PCIe 5.0 x16 (H100/H200 SXM, ~50 GB/s), 4.0 x16 (A100, L40S, ~25 GB/s), 3.0 x16 (V100, ~12 GB/s).
DEVICES: Dict[str, DeviceSpec] = {
    "h100": DeviceSpec("NVIDIA H100 80GB SXM", 80 * 10**9, 989e12, 495e12, 450e9, 50e9, host_bytes_per_s=50e9),
    "h200": DeviceSpec("NVIDIA H200 141GB", 141 * 10**9, 989e12, 495e12, 450e9, 50e9, host_bytes_per_s=50e9),
    "a100": DeviceSpec("NVIDIA A100 80GB SXM", 80 * 10**9, 312e12, 156e12, 300e9, 25e9, host_bytes_per_s=25e9),
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB SXM", 40 * 10**9, 312e12, 156e12, 300e9, 25e9, host_bytes_per_s=25e9),
    "v100": DeviceSpec("NVIDIA V100 32GB", 32 * 10**9, 125e12, 15.7e12, 150e9, 12.5e9, host_bytes_per_s=12e9),
    "l40s": DeviceSpec("NVIDIA L40S 48GB", 48 * 10**9, 362e12, 183e12, 32e9, 25e9, host_bytes_per_s=25e9),
    # The planner's CPU entry: host memory per process is the caller's business (--device-memory).
    "cpu": DeviceSpec("CPU", 16 * 10**9, 6.65e10 / MATMUL_EFFICIENCY, 3.91e10 / MATMUL_EFFICIENCY, 1.0e9, 1.0e9,
                      1.43e-3),
}


def device_spec(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known devices are {sorted(DEVICES)}")
    return DEVICES[key]


def cpu_model_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one): part of a device kind's identity."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
