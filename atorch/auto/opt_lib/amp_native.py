"""`amp_native`: torch automatic mixed precision (bf16 or fp16) on CPU and GPU.

How it composes, so that a plain `loss.backward(); optim.step()` loop stays correct:
- apply: records `ctx.autocast_dtype`, so sharding wrappers ordered later (fsdp, zero2,
  DeepSpeed) can turn it into their own mixed precision (FSDP `MixedPrecisionPolicy`,
  DeepSpeed `bf16`/`fp16`) instead of autocast;
- apply_wrapper, when no wrapper took that over: the model's forward runs under
  `torch.autocast` (patched on the instance: state-dict keys do not change);
- fp16 (unless DeepSpeed scales): a `GradScaler` whose overflow check is agreed by all ranks.
  The result's loss_func returns the true loss whose *backward* is multiplied by the current
  scale, and `result.optim` is a `GradScalingOptimizer` whose `step()` unscales, skips the
  step on inf/nan and updates the scale. bf16 needs no scaling (it has fp32's exponent range).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._precision import add_autocast_to_forward, dtype_name, parse_half_dtype
from atorch.auto.opt_lib.base import ConfigAlias, Optimization, Order, is_true, register

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmpNativeConfig:
    """Autocast settings."""

    dtype: Any = torch.bfloat16
    """torch.bfloat16 (default: no loss scaling needed) or torch.float16 (adds a GradScaler); names
    such as "bf16" / "fp16" are accepted too."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_half_dtype(self.dtype, "amp_native"))


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
    state is in `result.args["grad_scaler"]`.
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

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
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


@register
class AmpNativeOptimization(Optimization):
    name = "amp_native"
    order = Order.AMP
    Config = AmpNativeConfig
    config_aliases = {
        "enabled": ConfigAlias(accepts=is_true, instead="to train without autocast, leave amp_native out of the "
                               "strategy"),
    }

    @classmethod
    def parse_config(cls, raw: Any) -> AmpNativeConfig:
        # Also accept a bare dtype: ("amp_native", torch.float16).
        if isinstance(raw, (torch.dtype, str)):
            return AmpNativeConfig(raw)
        return super().parse_config(raw)

    def apply(self, ctx: ModelContext, config: AmpNativeConfig) -> None:
        ctx.autocast_dtype = config.dtype

    def apply_wrapper(self, ctx: ModelContext, config: AmpNativeConfig) -> None:
        if ctx.autocast_by_wrapper:
            logger.info("amp_native(%s): the sharding wrapper computes in this dtype itself; no autocast added",
                        dtype_name(config.dtype))
        elif ctx.half_dtype == config.dtype:
            logger.info("amp_native(%s): the model is already cast to %s by `half`; autocast would change "
                        "nothing and is not added", dtype_name(config.dtype), dtype_name(config.dtype))
        else:
            add_autocast_to_forward(ctx.model, ctx.device.type, config.dtype)
        if config.dtype is torch.float16 and not ctx.loss_scaling_by_wrapper and ctx.optim is not None:
            self._add_grad_scaling(ctx)

    @staticmethod
    def _add_grad_scaling(ctx: ModelContext) -> None:
        # The overflow check is all-reduced over every rank: with sharded gradients (fsdp,
        # zero2) or tensor/pipeline parallel, ranks see different gradients, and one rank
        # skipping a step the others take would silently desynchronize the model.
        # ShardedGradScaler also accepts fp16 gradients (a model cast by `half`).
        if dist.is_initialized():
            scaler: torch.amp.GradScaler = ShardedGradScaler(device=ctx.device.type, process_group=dist.group.WORLD)
        else:
            scaler = torch.amp.GradScaler(ctx.device.type)
        ctx.grad_scaler = scaler
        ctx.optim = GradScalingOptimizer(ctx.optim, scaler)
        ctx.loss_transforms.append(ctx.optim.scale_loss)
