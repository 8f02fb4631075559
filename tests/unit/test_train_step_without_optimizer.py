"""train_step refuses, before the optimizer is touched, a result without one and a loss backward cannot use.

Without an optimizer it failed at `optim.step()` with "'NoneType' object has no attribute 'step'", after the
forward and backward had left this step's gradients in every `.grad`; a detached loss failed inside autograd
("element 0 of tensors does not require grad and does not have a grad_fn"), naming neither loss_func nor a fix.
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


def test_a_detached_loss_is_refused_naming_loss_func():
    status, result, _ = auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(n=8),
                                        loss_func=lambda batch, output: output.loss.detach(),
                                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    assert status
    with pytest.raises(ValueError, match=r"train_step: loss_func returned a loss that does not require grad "
                                         r"\(detached, computed under torch.no_grad"):
        train_step(result, next(iter(result.dataloader)))
