"""`GradScalingOptimizer`: fp16 gradient scaling that keeps the loss value true.

Used by `amp_native` with fp16; lives here, below `atorch.auto`, because the checkpoint code
must recognise it too (it shares its inner optimizer's state).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.dtype), None


class GradScalingOptimizer(torch.optim.Optimizer):
    """An optimizer whose `step()` is `scaler.step(optimizer); scaler.update()`.

    `scale_loss` is the matching loss transform (installed behind `result.loss_func`): the
    loss value stays the true one, for logging, while its gradient is multiplied by the
    current scale. Returning `scaler.scale(loss)` instead would show users a loss 65536 times
    too large. `step()` refuses to run when no loss went through `scale_loss` since the last
    step: it would divide unscaled gradients by the scale and silently stall training.

    It shares (does not copy) the wrapped optimizer's `param_groups`, `state` and `defaults`,
    so LR schedulers, `zero_grad` and checkpoints act on the real optimizer. It is an
    `Optimizer` subclass because torch LR schedulers refuse anything else. The scaler's own
    state is `result.grad_scaler`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
        # Optimizer.__init__ sets up the hook tables; the groups it builds are then replaced by
        # the wrapped optimizer's own objects.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.scaler = scaler
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._loss_scaled = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._loss_scaled = True
        # scaler.scale(ones) is the public way to get the current scale as a tensor on the
        # loss's device without a host sync.
        scale = self.scaler.scale(torch.ones((), dtype=torch.float32, device=loss.device))
        return _ScaleGradient.apply(loss, scale)

    # torch declares Optimizer.step as overloads on the closure; this forwards either form.
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        if closure is not None:
            raise ValueError("amp_native fp16: step(closure) is not supported by GradScaler; call backward on the "
                             "loss returned by result.loss_func, then step()")
        if not self._loss_scaled:
            raise RuntimeError("amp_native fp16: no loss was computed with result.loss_func since the last step, so "
                               "the gradients were not scaled; compute the loss with result.loss_func(batch, output) "
                               "(or use atorch.auto.train_step) before calling backward")
        self._loss_scaled = False
        out = self.scaler.step(self.optimizer)
        self.scaler.update()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks (e.g. ZeroRedundancyOptimizer's
        # consolidate_state_dict); "optimizer" itself must not recurse before __init__ sets it.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)
