"""`train_step(result, batch)`: one optimizer step for any strategy.

Forward, loss, backward, step, zero_grad -- through the DeepSpeed engine when one drives
training, and through the pipeline schedule when a pipeline optimization set its own step.
"""

from __future__ import annotations

from typing import Any

import torch

from atorch.auto.model_context import call_model
from atorch.auto.result import AutoAccelerateResult


def train_step(result: AutoAccelerateResult, batch: Any) -> torch.Tensor:
    """One optimizer step on `batch` for any strategy: forward, loss, backward, step, zero_grad.

    Plain loops (`loss.backward(); optim.step()`) work too; this helper also drives
    DeepSpeed engines, which need `engine.backward` / `engine.step`.
    """
    if result.custom_train_step is not None:  # pipeline schedules/engines step themselves
        return result.custom_train_step(result, batch)
    batch = result.prepare_input(batch)
    output = call_model(result.model, batch, result.model_input_format)
    loss = result.loss_func(batch, output)
    engine = result.engine
    if engine is not None:
        engine.backward(loss)
        engine.step()
    else:
        loss.backward()
        result.optim.step()
        result.optim.zero_grad(set_to_none=True)
        if result.lr_scheduler is not None:
            result.lr_scheduler.step()
    return loss.detach()
