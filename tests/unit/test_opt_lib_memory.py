"""memory_breakdown in one process: exact byte counts for a plain model, tied weights once, wrappers unwrapped."""

import torch
from torch import nn

from atorch.auto.opt_lib.amp_native import GradScalingOptimizer
from atorch.testing import tiny_gpt2
from atorch.utils.memory import MemoryBreakdown, innermost_optimizer, memory_breakdown


def _step(model, optim):
    model(torch.randn(3, 16)).sum().backward()
    optim.step()


def test_exact_bytes_for_adamw():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    n = sum(p.numel() for p in model.parameters())  # 16*32+32 + 32*4+4 = 676
    optim = torch.optim.AdamW(model.parameters())
    assert memory_breakdown(model, optim) == MemoryBreakdown(4 * n, 0, 0)
    _step(model, optim)
    # exp_avg + exp_avg_sq per element, plus one fp32 `step` scalar per parameter tensor.
    got = memory_breakdown(model, optim)
    assert got == MemoryBreakdown(param_bytes=4 * n, grad_bytes=4 * n, optim_state_bytes=8 * n + 4 * 4)
    assert got.total_bytes == 16 * n + 16 and got.as_dict()["total_bytes"] == got.total_bytes
    optim.zero_grad(set_to_none=True)
    assert memory_breakdown(model, optim).grad_bytes == 0
    assert "optimizer state" in got.describe()


def test_tied_weights_count_once_and_half_dtype_halves():
    model = tiny_gpt2()  # lm_head shares wte's weight
    n = sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert memory_breakdown(model).param_bytes == 4 * n
    assert memory_breakdown(model.to(torch.bfloat16)).param_bytes == 2 * n


def test_wrappers_are_unwrapped_to_the_optimizer_holding_state():
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = GradScalingOptimizer(inner, torch.amp.GradScaler("cpu"))
    assert innermost_optimizer(wrapped) is inner
    _step(nn.Sequential(nn.Linear(16, 4), model), inner)
    assert memory_breakdown(model, wrapped).optim_state_bytes == 4 * (16 + 4)  # momentum buffers
