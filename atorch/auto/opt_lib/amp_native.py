"""`amp_native`: torch automatic mixed precision (bf16 or fp16) on CPU and GPU.

How it composes, so that a plain `loss.backward(); optim.step()` loop stays correct:
- apply: records `ctx.autocast_dtype`, so sharding wrappers ordered later (fsdp, zero2,
  DeepSpeed) can turn it into their own mixed precision (FSDP `MixedPrecisionPolicy`,
  DeepSpeed `bf16`/`fp16`) instead of autocast;
- apply_wrapper, when no wrapper took that over: the model's forward runs under
  `torch.autocast` (patched on the instance: state-dict keys do not change);
- fp16 (unless DeepSpeed scales): a `GradScaler` whose overflow check is agreed by all ranks
  (`result.grad_scaler`). With `optim_func`, the result's loss_func returns the true loss whose
  *backward* is multiplied by the current scale, and `result.optim` is a `GradScalingOptimizer`
  whose `step()` unscales, skips the step on inf/nan and updates the scale. Without `optim_func`
  (the user's own optimizer) nothing can be wrapped: the scaler is still made and a warning says to
  use it torch's way (`scaler.scale(loss).backward(); scaler.step(optim); scaler.update()`).
  bf16 needs no scaling (it has fp32's exponent range).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._precision import DescribedByDtype, add_autocast_to_forward, dtype_name, parse_half_dtype
from atorch.modules.grad_scaling import GradScalingOptimizer
from atorch.auto.opt_lib.base import ConfigAlias, CostContext, Optimization, Order, WrapperOrder, is_true, register

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmpNativeConfig:
    """Autocast settings."""

    dtype: Any = torch.bfloat16
    """torch.bfloat16 (default: no loss scaling needed) or torch.float16 (adds a GradScaler); names
    such as "bf16" / "fp16" are accepted too."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_half_dtype(self.dtype, "amp_native"))


@register
class AmpNativeOptimization(DescribedByDtype, Optimization):
    name = "amp_native"
    order = Order.AMP
    wrapper_order = WrapperOrder.PRECISION
    Config = AmpNativeConfig
    search_dimension = "amp"   # offered: off, or bf16 (the default config; fp16 needs loss scaling)

    @classmethod
    def cost_traits(cls, config: AmpNativeConfig, context: CostContext) -> Dict[str, Any]:
        # Half-precision compute; autocast keeps half copies of the fp32 weights unless a sharding
        # wrapper (FSDP2 mixed precision, DeepSpeed bf16/fp16) takes the dtype over.
        return {"compute_dtype_bytes": 2, "autocast": True}

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
        if config.dtype is torch.float16 and not ctx.loss_scaling_by_wrapper:
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
        if ctx.optim is None:
            # fp16 gradients underflow without loss scaling; the user's loop must apply the scaler itself.
            logger.warning("amp_native(float16) without optim_func: no optimizer to wrap, so the loss is not scaled "
                           "for you; scale it with result.grad_scaler in your loop: grad_scaler.scale(loss)."
                           "backward(); grad_scaler.step(optimizer); grad_scaler.update() (or pass optim_func, and "
                           "train_step / result.optim do it)")
            return
        ctx.optim = GradScalingOptimizer(ctx.optim, scaler)
        ctx.loss_transforms.append(ctx.optim.scale_loss)
