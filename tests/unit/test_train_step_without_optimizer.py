"""train_step on a result built without optim_func fails before the forward, saying what to pass.

It failed at `optim.step()` with "'NoneType' object has no attribute 'step'", after the forward and backward
had left this step's gradients in every `.grad`.
"""

import pytest
import torch

from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def test_train_step_without_an_optimizer_refuses_before_the_forward():
    status, result, _ = auto_accelerate(tiny_llama(seed=0), dataset=TokenDataset(n=8),
                                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    assert status and result.optim is None
    batch = next(iter(result.dataloader))
    with pytest.raises(ValueError, match=r"train_step needs an optimizer, and auto_accelerate was called without "
                                         r"optim_func: pass optim_func \(e.g. torch.optim.AdamW\)"):
        train_step(result, batch)
    assert all(p.grad is None for p in result.model.parameters()), "the forward and backward must not have run"
    assert isinstance(result.model(**batch).loss, torch.Tensor)     # the model itself still runs
