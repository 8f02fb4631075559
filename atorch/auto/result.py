"""`AutoAccelerateResult`: what `auto_accelerate` hands back, as named, typed fields.

It still unpacks like the 7-tuple of earlier versions and of the system we follow
(`model, optim, dataloader, loss_func, prepare_input, lr_scheduler, args = result`), and
`result.args` is a read-only view with the old keys, for scripts that read them. New code
reads the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import Sampler

from atorch.auto.strategy import Strategy
from atorch.distributed.mesh import ParallelMesh

if TYPE_CHECKING:   # for the annotations only: importing these here would pull in DeepSpeed and the planner
    from deepspeed import DeepSpeedEngine

    from atorch.auto.search.results import SearchResult
    from atorch.checkpoint.state import DataPosition
    from atorch.modules.pipeline.native import NativePipeline
    from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer


@dataclass
class AutoAccelerateResult:
    """The accelerated training objects and how they were made."""

    model: nn.Module
    """The model to call: the wrapped module, or the DeepSpeed engine when one drives training."""
    optim: Optional[torch.optim.Optimizer]
    dataloader: Optional[Iterable]
    """Yields this data rank's share of each global batch (`dataloader_args["batch_size"]` is global)."""
    loss_func: Callable[[Any, Any], torch.Tensor]
    """loss_func(batch, output) -> the loss to call backward on (fp16 loss scaling included)."""
    prepare_input: Callable[..., Any]
    """prepare_input(batch, device=None) -> the batch on the model's device."""
    user_loss_func: bool = False
    """Whether auto_accelerate was given a loss_func (False: `loss_func` returns the model output's own loss)."""
    lr_scheduler: Any = None
    strategy: Strategy = field(default_factory=Strategy)
    """The strategy applied, in application order, with what `auto_accelerate` added (parallel_mode, ddp)."""
    device: torch.device = torch.device("cpu")
    model_input_format: Optional[str] = None
    parallel: Optional[ParallelMesh] = None
    """The named parallel groups of the strategy."""
    data_parallel_size: int = 1
    global_batch_size: Optional[int] = None
    sampler: Optional[Sampler] = None
    engine: Optional["DeepSpeedEngine"] = None
    """The DeepSpeed engine, when one drives training (then also `model`)."""
    deepspeed_config: Optional[Dict[str, Any]] = None
    autocast_dtype: Optional[torch.dtype] = None
    grad_scaler: Optional[torch.amp.GradScaler] = None
    custom_train_step: Optional[Callable[["AutoAccelerateResult", Any], torch.Tensor]] = None
    """Set by pipelines, whose schedule runs forward, backward and the step itself (`train_step` calls it)."""
    gradient_accumulation_steps: int = 1
    sync_each_micro_step: Optional[bool] = None
    """Whether `train_step` reduces gradients in every micro-step (gradient_accumulation's option);
    None: under torch FSDP2 yes (sharded gradients), elsewhere only in the last."""
    micro_batch_size: Optional[int] = None
    pipeline: Optional["NativePipeline"] = None
    """The native pipeline's schedule runner (pipeline_parallel)."""
    pipeline_stage: Optional[int] = None
    randomizer: Optional["MultiDimParallelRandomizer"] = None
    """The tensor-parallel random streams (dropout) of the sharded model (tensor_parallel)."""
    summaries: Dict[str, Any] = field(default_factory=dict)
    """What each optimization did, under its name (e.g. summaries["fsdp"]["backend"])."""
    applied: List[str] = field(default_factory=list)
    search: Optional["SearchResult"] = None
    """The `SearchResult` of the automatic search (rank 0), when the strategy was searched."""
    search_report: Optional[Dict[str, str]] = None
    """Paths of the search's trial table, plot and chosen strategy (rank 0)."""
    search_reason: Optional[str] = None
    """One line: why the searched strategy won."""
    data_origin: Optional[Tuple[Optional[int], "DataPosition"]] = None
    """(step, DataPosition) the data stream resumed at, set by `load_checkpoint`: `save_checkpoint(step=)`
    counts later steps from it, in this run's global batches (they may differ from the saved run's)."""

    # -- the tuple of earlier versions -----------------------------------------------------------
    def _as_tuple(self) -> tuple:
        return (self.model, self.optim, self.dataloader, self.loss_func, self.prepare_input, self.lr_scheduler,
                self.args)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._as_tuple())

    def __len__(self) -> int:
        return 7

    def __getitem__(self, index: int) -> Any:
        return self._as_tuple()[index]

    @property
    def args(self) -> Mapping[str, Any]:
        """Read-only view with the keys of the old `result.args` dict (compatibility; read the fields instead)."""
        tensor_size = self.parallel.size_or_one("tensor") if self.parallel is not None else 1
        view: Dict[str, Any] = {
            "strategy": list(self.applied), "device": self.device, "model_input_format": self.model_input_format,
            "data_parallel_size": self.data_parallel_size, "global_batch_size": self.global_batch_size,
            "autocast_dtype": self.autocast_dtype, "grad_scaler": self.grad_scaler, "engine": self.engine,
            "sampler": self.sampler,
        }
        optional = {
            "train_step": self.custom_train_step, "pipeline": self.pipeline, "pipeline_stage": self.pipeline_stage,
            "randomizer": self.randomizer, "ds_config": self.deepspeed_config,
            "gradient_accumulation_steps": self.gradient_accumulation_steps if self.custom_train_step else None,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "tensor_parallel_size": tensor_size if self.randomizer is not None else None,
            "search_report": self.search_report, "search_result": self.search, "search_reason": self.search_reason,
        }
        view.update({k: v for k, v in optional.items() if v is not None})
        view.update(self.summaries)
        return MappingProxyType(view)
