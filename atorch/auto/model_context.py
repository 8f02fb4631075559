"""`ModelContext`: the user's training objects, transformed in order by each optimization.

Optimizations read and replace typed fields here (the model, the optimizer factory, the
parallel groups, the autocast dtype, ...); the engine (`atorch.auto.engine`) builds the
optimizer, the dataloader and the result from it. One context per strategy application:
nothing is global.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn
from torch.utils.data import Sampler

from atorch.distributed.mesh import ParallelMesh

logger = logging.getLogger(__name__)


def default_prepare_input(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: default_prepare_input(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(default_prepare_input(v, device) for v in batch)
    return batch


# The format chosen for model_input_format=None, per model, decided on its first batch.
_INFERRED_FORMATS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def call_model(model: Callable, batch: Any, model_input_format: Optional[str]) -> Any:
    """Call the model the way `model_input_format` says; None is inferred once per model (`infer_input_format`)."""
    if model_input_format is None:
        model_input_format = _inferred_format(model, batch)
    if model_input_format == "whole":
        return model(batch)
    if model_input_format == "unpack_sequence":
        if batch is None or isinstance(batch, (Mapping, torch.Tensor, str, bytes)):
            # Unpacking a dict passes its keys, a tensor its rows: wrong inputs without an error.
            raise TypeError(f"model_input_format='unpack_sequence' calls model(*batch), but the batch is a "
                            f"{type(batch).__name__}; batches must be tuples or lists of model inputs")
        return model(*batch)
    if model_input_format == "unpack_dict":
        if not isinstance(batch, Mapping):
            raise TypeError(f"model_input_format='unpack_dict' calls model(**batch), but the batch is a "
                            f"{type(batch).__name__}; batches must be dicts of model inputs")
        return model(**batch)
    raise ValueError(f"model_input_format={model_input_format!r}; valid values are None, 'unpack_sequence', "
                     "'unpack_dict'")


def _inferred_format(model: Any, batch: Any) -> str:
    try:
        return _INFERRED_FORMATS[model]
    except (KeyError, TypeError):
        pass
    chosen = infer_input_format(model, batch)
    if isinstance(batch, Mapping):
        logger.info("model_input_format=None: the first batch is a dict of %s, so every batch is passed as %s",
                    sorted(batch), "keyword arguments (model(**batch))" if chosen == "unpack_dict" else
                    "one argument (model(batch))")
    try:
        _INFERRED_FORMATS[model] = chosen
    except TypeError:   # an object without weak references: decided again next time, same answer
        pass
    return chosen


def users_module(model: Any) -> Any:
    """The user's model under atorch's wrappers: DDP and DeepSpeed engines keep the module as `.module`, and
    `lora`'s peft `PeftModel` forwards `(*args, **kwargs)` to the model `get_base_model()` returns."""
    inner = model
    for _ in range(6):
        wrapped = getattr(inner, "module", None)
        if not isinstance(wrapped, nn.Module):
            base = getattr(inner, "get_base_model", None)
            wrapped = base() if callable(base) else None
        if not isinstance(wrapped, nn.Module) or wrapped is inner:
            break
        inner = wrapped
    return inner


def _forward_of(model: Any) -> Callable:
    """The user's forward under atorch's wrappers (`users_module`): peft's own signature names nothing, so a
    Hugging Face batch looked like keys the forward does not take."""
    inner = users_module(model)
    return getattr(inner, "forward", inner)


def infer_input_format(model: Any, batch: Any) -> str:
    """What `model_input_format=None` means for this model and batch.

    The system we follow defines None as `model(batch)`, and scripts written for it keep that:
    a batch that is not a dict, or a dict for a forward that takes one positional argument not
    named by the dict's keys (its only required one, or its only one), is passed whole. A dict
    whose keys are all parameters of the model's forward (every Hugging Face batch: input_ids,
    attention_mask, labels, ...) is passed as keyword arguments. Anything else is a ValueError
    naming both, e.g. a dict of other keys for a Hugging Face forward (several optional
    parameters, no required one), which would otherwise get the whole dict as its `input_ids`.
    """
    if not isinstance(batch, Mapping):
        return "whole"
    try:
        params = list(inspect.signature(_forward_of(model)).parameters.values())
    except (TypeError, ValueError):
        return "whole"
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    keys = {str(k) for k in batch}
    if keys and (keys <= named or (takes_kwargs and keys & named)):
        return "unpack_dict"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    takes_one = len(required) == 1 or (not required and len(positional) == 1)
    if positional and takes_one and positional[0].name not in keys:
        return "whole"
    raise ValueError(f"model_input_format=None: the batch is a dict with keys {sorted(keys)}, which are not all "
                     f"parameters of {type(model).__name__}.forward ({[p.name for p in params]}), and the forward "
                     "does not take the batch as one argument; pass model_input_format='unpack_dict' or "
                     "'unpack_sequence', or a prepare_input that returns what the forward takes")


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
    """The user's objects and what the optimizations made of them: the one channel between optimizations.

    Every field below "Set by optimizations" says which optimization writes it; any other
    optimization may read it. Nothing is passed through globals or string-keyed dicts.
    """

    model: nn.Module
    optim_func: Optional[Callable[..., torch.optim.Optimizer]] = None
    optim_args: Dict[str, Any] = field(default_factory=dict)
    optim_param_func: Optional[Callable[[nn.Module], Iterable]] = None
    dataset: Any = None
    loss_func: Optional[Callable[[Any, Any], Any]] = None
    prepare_input: Optional[Callable[[Any, torch.device], Any]] = None
    model_input_format: Optional[str] = None
    dataloader_args: Dict[str, Any] = field(default_factory=dict)
    distributed_sampler_cls: Optional[Callable[..., Sampler]] = None
    lr_scheduler_cls: Optional[Callable[..., Any]] = None
    lr_scheduler_args: Dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    model_config: Any = None
    """The user's model's config (e.g. transformers'; default: `model.config`), kept when an
    optimization replaces `model` by a part of it: a pipeline stage has no config of its own."""

    def __post_init__(self) -> None:
        if self.model_config is None:
            self.model_config = getattr(self.model, "config", None)

    # -- Set by optimizations (the writer in brackets) ---------------------------------------
    parallel: Optional[ParallelMesh] = None
    """[parallel_mode] the named parallel groups of this strategy."""
    optim: Optional[torch.optim.Optimizer] = None
    """[engine, after the apply phase; replaced by wrappers: amp_native fp16, DeepSpeed]"""
    lr_scheduler: Any = None
    dataloader: Optional[Iterable] = None
    """[engine; deepspeed_3d_parallel builds its own micro-batch loader]"""
    sampler: Optional[Sampler] = None
    autocast_dtype: Optional[torch.dtype] = None
    """[amp_native] the compute dtype that sharding wrappers turn into their own mixed precision."""
    grad_scaler: Optional[torch.amp.GradScaler] = None
    """[amp_native with fp16]"""
    half_dtype: Optional[torch.dtype] = None
    """[half]"""
    is_sharded: bool = False
    """[fsdp, zero2, DeepSpeed, pipelines] a wrapper places the model itself (the engine does not move it)."""
    autocast_by_wrapper: bool = False
    """[fsdp/zero2 FSDP2 mixed precision, DeepSpeed bf16/fp16] amp_native then adds no autocast."""
    loss_scaling_by_wrapper: bool = False
    """[DeepSpeed] fp16 loss scaling is the engine's own; amp_native then adds no GradScaler."""
    engine: Any = None
    """[zero1/zero2/fsdp with use_ds_zero, deepspeed_3d_parallel] the DeepSpeed engine that drives training."""
    deepspeed_config: Optional[Dict[str, Any]] = None
    """[the DeepSpeed optimizations] the config the engine was built with."""
    custom_train_step: Optional[Callable[[Any, Any], torch.Tensor]] = None
    """[pipeline_parallel, deepspeed_3d_parallel] what `train_step(result, batch)` runs instead of the default."""
    pipeline: Any = None
    """[pipeline_parallel] the NativePipeline that runs the schedule."""
    pipeline_stage: Optional[int] = None
    """[pipeline_parallel] this rank's stage index."""
    gradient_accumulation_steps: int = 1
    """[gradient_accumulation, deepspeed_3d_parallel] micro-batches per optimizer step."""
    sync_each_micro_step: Optional[bool] = None
    """[gradient_accumulation] reduce gradients in every micro-step; None: per wrapper (`train_step`)."""
    micro_batch_size: Optional[int] = None
    """[deepspeed_3d_parallel] rows per micro-batch on one data rank."""
    randomizer: Any = None
    """[tensor_parallel] the per-group random streams (dropout) of the sharded model."""
    loss_transforms: List[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    """[amp_native fp16] applied, in order, to the loss the result's loss_func returns."""
    summaries: Dict[str, Any] = field(default_factory=dict)
    """[each optimization, under its own name] what it did, for the user (never read by another optimization)."""
    applied: List[str] = field(default_factory=list)
    """[engine] names, in application order."""

    # -- data-parallel view, from this strategy's parallel groups ------------------------------
    def data_parallel_size(self) -> int:
        return self.parallel.size_or_one("data") if self.parallel is not None else 1

    def data_parallel_rank(self) -> int:
        return self.parallel.rank_or_zero("data") if self.parallel is not None else 0

    def require_parallel(self, who: str) -> ParallelMesh:
        """The parallel groups, which `parallel_mode` (always applied first) has created."""
        if self.parallel is None:
            raise RuntimeError(f"{who}: no parallel groups on the model context; parallel_mode must be applied first")
        return self.parallel

    def optim_params(self) -> Iterable:
        """Parameter groups for the optimizer: the user's function, else trainable parameters."""
        if self.optim_param_func is not None:
            return self.optim_param_func(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            total = sum(1 for _ in self.model.parameters())
            raise ValueError(f"model {type(self.model).__name__} has no trainable parameter (all {total} parameter "
                             "tensors have requires_grad=False after the strategy applied), so there is nothing for "
                             "optim_func to train: unfreeze some, add adapters (the 'lora' optimization), or pass "
                             "optim_param_func")
        return trainable
