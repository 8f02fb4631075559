"""`ModelContext`: the user's training objects, transformed in order by each optimization.

Optimizations read and replace fields here (the model, the optimizer factory, the autocast
dtype, ...); `auto_accelerate` builds the optimizer, the dataloader and the result from it.
One context per `auto_accelerate` call: nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from atorch.distributed import parallel_rank_or_zero, parallel_size_or_one


def default_prepare_input(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: default_prepare_input(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(default_prepare_input(v, device) for v in batch)
    return batch


def call_model(model: Callable, batch: Any, model_input_format: Optional[str]) -> Any:
    """Call the model the way `model_input_format` says."""
    if model_input_format is None:
        return model(batch)
    if model_input_format == "unpack_sequence":
        return model(*batch)
    if model_input_format == "unpack_dict":
        return model(**batch)
    raise ValueError(f"model_input_format={model_input_format!r}; valid values are None, 'unpack_sequence', "
                     "'unpack_dict'")


def default_loss_func(batch: Any, output: Any) -> torch.Tensor:
    """Hugging Face models compute their own loss when labels are given."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        raise ValueError("loss_func is None and the model output has no .loss: pass loss_func(batch, output), or "
                         "include labels in the batch of a Hugging Face model")
    return loss


def first_loss(value: Any) -> torch.Tensor:
    """A loss function may return the loss or a sequence whose first item is the loss."""
    if isinstance(value, (tuple, list)):
        return value[0]
    return value


@dataclass
class ModelContext:
    model: nn.Module
    optim_func: Optional[Callable] = None
    optim_args: Dict[str, Any] = field(default_factory=dict)
    optim_param_func: Optional[Callable[[nn.Module], Iterable]] = None
    dataset: Any = None
    loss_func: Optional[Callable] = None
    prepare_input: Optional[Callable] = None
    model_input_format: Optional[str] = None
    dataloader_args: Dict[str, Any] = field(default_factory=dict)
    lr_scheduler_cls: Optional[Callable] = None
    lr_scheduler_args: Dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")

    # Set by optimizations.
    optim: Optional[torch.optim.Optimizer] = None
    lr_scheduler: Any = None
    dataloader: Any = None
    sampler: Any = None
    autocast_dtype: Optional[torch.dtype] = None      # amp_native
    grad_scaler: Any = None                            # amp_native with fp16
    half_dtype: Optional[torch.dtype] = None           # half
    is_sharded: bool = False                           # fsdp / zero / deepspeed own gradient sync
    # Set in the apply phase by a sharding wrapper that turns autocast_dtype into its own mixed
    # precision (FSDP MixedPrecisionPolicy, DeepSpeed bf16/fp16): amp_native then skips autocast,
    # and also its GradScaler when the wrapper scales fp16 losses itself (DeepSpeed).
    autocast_by_wrapper: bool = False
    loss_scaling_by_wrapper: bool = False
    engine: Any = None                                 # a DeepSpeed engine, when one drives training
    gradient_accumulation_steps: int = 1               # gradient_accumulation: micro-batches per optimizer step
    # Applied to the loss the result's loss_func returns (e.g. gradient scaling for fp16).
    loss_transforms: List[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    applied: List[str] = field(default_factory=list)   # names, in application order
    extra: Dict[str, Any] = field(default_factory=dict)  # per-optimization notes for the result args

    # -- data-parallel view, from the parallel groups -------------------------
    @staticmethod
    def data_parallel_size() -> int:
        return parallel_size_or_one("data")

    @staticmethod
    def data_parallel_rank() -> int:
        return parallel_rank_or_zero("data")

    def optim_params(self) -> Iterable:
        """Parameter groups for the optimizer: the user's function, else trainable parameters."""
        if self.optim_param_func is not None:
            return self.optim_param_func(self.model)
        return [p for p in self.model.parameters() if p.requires_grad]
