"""`GradScalingOptimizer`: fp16 gradient scaling that keeps the loss value true.

Used by `amp_native` with fp16; lives here, below `atorch.auto`, because the checkpoint code
must recognise it too (it shares its inner optimizer's state).
"""

from __future__ import annotations

from typing import Any, Callable, DefaultDict, Dict, List, Optional, Tuple, cast

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


class _ConstructionTarget:
    """Receives what `Optimizer.__init__` assigns to a `GradScalingOptimizer` before its inner optimizer is set."""

    param_groups: List[Dict[str, Any]]
    state: DefaultDict[torch.Tensor, Any]
    defaults: Dict[str, Any]


class GradScalingOptimizer(torch.optim.Optimizer):
    """An optimizer whose `step()` is `scaler.step(optimizer); scaler.update()`.

    `scale_loss` is the matching loss transform (installed behind `result.loss_func`): the
    loss value stays the true one, for logging, while its gradient is multiplied by the
    current scale. Returning `scaler.scale(loss)` instead would show users a loss 65536 times
    too large. `step()` refuses to run when no loss went through `scale_loss` since the last
    step: it would divide unscaled gradients by the scale and silently stall training.

    Its `param_groups`, `state` and `defaults` are properties that always return the wrapped
    optimizer's current objects (and assignments go there too), so LR schedulers, `zero_grad`
    and checkpoints act on the real optimizer even after `Optimizer.load_state_dict` replaced
    those objects: a copy of the references taken once would leave a scheduler changing an lr
    that no step reads. It is an `Optimizer` subclass because torch LR schedulers refuse
    anything else. The scaler's own state is `result.grad_scaler`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
        # Optimizer.__init__ sets up the hook tables and step profiling, and assigns fresh groups
        # and state through the properties below: they land on a throwaway until the wrapped
        # optimizer is attached. The groups are copied so the wrapped optimizer's stay untouched.
        self.optimizer = cast(torch.optim.Optimizer, _ConstructionTarget())
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.optimizer = optimizer
        self.scaler = scaler
        self._loss_scaled = False

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> DefaultDict[torch.Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, value: DefaultDict[torch.Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.optimizer.defaults = value

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
