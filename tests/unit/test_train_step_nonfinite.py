"""A step whose gradient norm is nan or inf: refused with max_grad_norm (the optimizer never sees it), left to
fp16 amp_native's loss scaler, which skips it itself. Before, `optim.step()` made every parameter nan in silence.
The 2-rank case (every rank refuses alike; a micro-batch without label tokens named as a nan loss's cause) is in
tests/distributed/test_train_step.py."""

import logging

import pytest
import torch

from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def _result(strategy, loss_func):
    status, result, _ = auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                                        dataset=TokenDataset(n=8), dataloader_args={"batch_size": 4},
                                        loss_func=loss_func, load_strategy=strategy)
    assert status
    return result


def _divided_by_zero(batch, output):
    return output.loss / (batch["labels"] * 0).sum()      # a user's normalization by a count that is 0


def test_a_nonfinite_norm_is_refused_before_the_optimizer_and_the_next_batch_trains():
    result = _result(["parallel_mode"], _divided_by_zero)
    batch = next(iter(result.dataloader))
    before = [p.detach().clone() for p in result.model.parameters()]
    with pytest.raises(FloatingPointError, match=r"the global gradient norm is (nan|inf) \(rank 0's loss: inf\), so "
                                                  r"the step was not taken"):
        train_step(result, batch, max_grad_norm=1.0)
    assert all(torch.equal(a, p) for a, p in zip(before, result.model.parameters()))
    assert all(p.grad is None for p in result.model.parameters())
    result.loss_func = lambda batch, output: output.loss     # the cause fixed: the same result trains on
    assert torch.isfinite(train_step(result, batch, max_grad_norm=1.0))
    assert not all(torch.equal(a, p) for a, p in zip(before, result.model.parameters()))


def test_without_clipping_the_rank_warns(caplog):
    result = _result(["parallel_mode"], _divided_by_zero)
    with caplog.at_level(logging.WARNING, logger="atorch.auto.train_step"):
        train_step(result, next(iter(result.dataloader)))
    assert any(r.getMessage().startswith("train_step: rank 0's loss is inf at this step. Without max_grad_norm")
               for r in caplog.records), caplog.text
    assert any(p.isnan().any() for p in result.model.parameters())   # what the warning is about


def test_fp16_loss_scaling_skips_the_step_itself():
    result = _result(["parallel_mode", ("amp_native", {"dtype": torch.float16})], _divided_by_zero)
    scaler = result.optim.scaler
    scale = scaler.get_scale()
    before = [p.detach().clone() for p in result.model.parameters()]
    train_step(result, next(iter(result.dataloader)), max_grad_norm=1.0)       # no FloatingPointError
    assert scaler.get_scale() < scale
    assert all(torch.equal(a, p) for a, p in zip(before, result.model.parameters()))
