"""The planner's GPU paths: the allocator-based peak tracker, its simulated limit, the cuda device profile.

Skipped without CUDA (tests/conftest.py); the CPU paths are tested in tests/unit and tests/distributed.
"""

import pytest
import torch

from atorch.auto.cost_model import estimate
from atorch.auto.search.auto_search import device_memory_bytes
from atorch.testing import tiny_llama
from atorch.utils.peak_memory import PeakMemoryTracker, is_out_of_memory

pytestmark = pytest.mark.gpu


def test_cuda_peak_tracker_and_simulated_limit():
    device = torch.device("cuda", 0)
    with PeakMemoryTracker(device) as tracker:
        a = torch.empty(2**20, device=device)      # 4 MiB
        b = torch.empty(2**20, device=device)
        del a, b
    assert tracker.peak_bytes >= 2 * 4 * 2**20
    with pytest.raises(torch.OutOfMemoryError) as info:
        with PeakMemoryTracker(device, memory_limit_bytes=64 * 2**20):
            torch.empty(256 * 2**20, device=device)   # 1 GiB > the 64 MiB limit
    assert is_out_of_memory(info.value)
    # The limit is lifted on exit.
    torch.empty(256 * 2**20, device=device)


def test_cuda_device_memory_and_profile():
    device = torch.device("cuda", 0)
    assert device_memory_bytes(device) == torch.cuda.get_device_properties(device).total_memory
    model = tiny_llama()
    cpu, gpu = (estimate(model, ["parallel_mode"], 8, 64, 1, d) for d in ("cpu", device))
    assert gpu.step_time_s < cpu.step_time_s and gpu.peak_memory_bytes == cpu.peak_memory_bytes
