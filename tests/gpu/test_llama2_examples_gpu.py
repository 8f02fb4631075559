"""GPU paths of the Llama 2 examples and their metrics (skipped without CUDA by tests/conftest.py).

On CUDA the peak comes from the datasheet table (or is reported unknown, never probed), peak
memory from the caching allocator, and the FSDP example runs on nccl with bf16 compute.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from atorch.utils.metrics import device_peak, gpu_peak_tflops, peak_memory_mb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from test_llama2_examples import check_learns, fields, line_with, metrics_lines, ok, run  # noqa: E402

DEVICE = torch.device("cuda", 0)


def test_gpu_peak_is_the_datasheet_value_or_reported_unknown():
    name = torch.cuda.get_device_name(DEVICE)
    peak = device_peak(DEVICE, "bf16")
    assert peak.tflops == gpu_peak_tflops(name, "bf16")
    if peak.tflops is None:
        assert "unknown peak" in peak.source and name in peak.source
    else:
        assert peak.source == f"datasheet dense bf16 peak of {name}" and peak.tflops > 50


def test_gpu_peak_memory_is_the_allocator_high_water_mark():
    torch.cuda.reset_peak_memory_stats(DEVICE)
    block = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=DEVICE)
    mb, what = peak_memory_mb(DEVICE)
    assert what == "GPU allocator max_memory_allocated" and mb >= 256
    del block


def test_fsdp_example_on_gpus_learns_with_table_peak_and_allocator_memory(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    out = run("fsdp_llama2_entry.sh", OUTPUT_DIR=tmp_path, MAX_STEPS=20, SAVE_STEPS=0, BLOCK_SIZE=64,
              PER_DEVICE_TRAIN_BATCH_SIZE=4, LOG_STEPS=1, NPROC_PER_NODE=nproc)
    stdout = ok(out)
    launch = fields(line_with(stdout, "launch:"))
    assert launch["backend"] == "nccl" and launch["device"].startswith("cuda")
    header = line_with(stdout, "metrics:")
    assert "GPU allocator max_memory_allocated" in header and "measured CPU matmul peak" not in header
    metrics = metrics_lines(stdout)
    if gpu_peak_tflops(torch.cuda.get_device_name(DEVICE), "bf16") is None:
        # An unknown GPU reports nan utilization rather than a made-up peak.
        assert all(math.isnan(m["mfu"]) for m in metrics)
        for m in metrics:
            m["mfu"], m["hfu"] = 1e-9, 2e-9   # the rest of the checks still apply
    check_learns(metrics, steps=20, world_size=nproc)
