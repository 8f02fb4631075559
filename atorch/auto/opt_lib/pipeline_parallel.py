"""`pipeline_parallel`: split a Hugging Face decoder into balanced stages run by a torch pipelining schedule.

Needs a "pipeline" dimension in `parallel_mode` (and optionally "data"): e.g.
`("parallel_mode", ([("data", 2), ("pipeline", 2)], None))`, `("pipeline_parallel", {"chunks": 4})`.
Each rank keeps its stage (pieces under their original state-dict keys), the per-rank batch is
cut into `chunks` micro-batches, and `atorch.auto.train_step(result, batch)` runs one
schedule step, averages gradients over "data" and steps the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import Optimization, Order, ValidationContext, register
from atorch.modules.pipeline.native import SCHEDULES, NativePipeline, build_stage_module, pipeline_train_step
from atorch.modules.pipeline.partition import PARTITION_METHODS, plan_stages
from atorch.modules.pipeline.patchers import CustomPatcher, expand_patcher, resolve_patcher

# What a native pipeline combines with: everything in the layout must be one of these.
_SUPPORTED_DIMS = ("data", "pipeline")


@dataclass(frozen=True)
class PipelineParallelConfig:
    chunks: Optional[int] = None
    """Micro-batches per step (the per-rank batch must divide into them); None: one per stage."""

    schedule: str = "gpipe"
    """"gpipe" (all forwards, then all backwards) or "1f1b" (at most `stages` micro-batches of activations)."""

    partition_method: str = "parameters"
    """"parameters": blocks balanced by parameter count; "uniform": equal block counts."""

    custom_patcher: Optional[CustomPatcher] = None
    """{module path: patch_fn} (see atorch.modules.pipeline.patchers); None: the preset of the model type."""

    base_seed: int = 1234
    """A meta model is materialized with the weights of `torch.manual_seed(base_seed); Model(config)`."""

    tie_first: bool = True
    """Keep a tied embedding/LM-head pair one weight when it is split over the first and last stage."""


@register
class PipelineParallelOptimization(Optimization):
    name = "pipeline_parallel"
    order = Order.PIPELINE
    requires = frozenset({"parallel_mode"})
    conflicts = frozenset({"deepspeed_3d_parallel", "tensor_parallel", "fsdp", "zero1", "zero2", "ddp"})
    distributed_only = True
    Config = PipelineParallelConfig
    search_dimension = "parallel"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """Pipelines of every size dividing the world that the model has layers for (one chunk
        per stage, so per-rank batches that do not split into them are not offered); the rest
        data-parallel. Validation drops models without a pipeline patcher."""
        w = context.world_size
        layers = _num_layers(context.model_config)
        out: List[Any] = []
        for p in range(2, w + 1):
            if w % p or (layers is not None and p > layers):
                continue
            batch = context.global_batch_size
            if batch and (batch % (w // p) or (batch // (w // p)) % p):
                continue
            out.append([("parallel_mode", ([("data", w // p), ("pipeline", p)], None)), cls.name])
        return out

    def validate(self, config: PipelineParallelConfig, context: ValidationContext) -> None:
        sizes = context.parallel_sizes()
        if "pipeline" not in sizes:
            raise ValueError(f"pipeline_parallel needs a 'pipeline' dimension in parallel_mode (dims are {sizes}); "
                             "e.g. ('parallel_mode', ([('data', world_size // 2), ('pipeline', 2)], None))")
        others = {n: s for n, s in sizes.items() if n not in _SUPPORTED_DIMS and s > 1}
        if others:
            raise ValueError(f"pipeline_parallel combines with data parallelism only, but parallel_mode has {others}; "
                             "use deepspeed_3d_parallel for tensor x data x pipeline")
        if config.chunks is not None and (not isinstance(config.chunks, int) or isinstance(config.chunks, bool)
                                          or config.chunks < 1):
            raise ValueError(f"pipeline_parallel: chunks={config.chunks!r} must be an integer >= 1")
        if config.schedule not in SCHEDULES:
            raise ValueError(f"pipeline_parallel: schedule={config.schedule!r}; valid schedules are {list(SCHEDULES)}")
        if config.partition_method not in PARTITION_METHODS:
            raise ValueError(f"pipeline_parallel: partition_method={config.partition_method!r}; valid methods are "
                             f"{list(PARTITION_METHODS)}")
        if not isinstance(config.base_seed, int) or isinstance(config.base_seed, bool):
            raise ValueError(f"pipeline_parallel: base_seed={config.base_seed!r} must be an int")
        amp = context.configs.get("amp_native")
        if amp is not None and getattr(amp, "dtype", None) is torch.float16:
            raise ValueError("pipeline_parallel with amp_native fp16 is not supported: the pipeline schedule runs "
                             "backward itself, so the fp16 loss scaling of amp_native would never be applied; use "
                             "amp_native with torch.bfloat16")
        if context.model is None:
            return
        pieces = expand_patcher(context.model, resolve_patcher(context.model, config.custom_patcher))
        plan_stages(context.model, pieces, sizes["pipeline"], config.partition_method)

    def apply(self, ctx: ModelContext, config: PipelineParallelConfig) -> None:
        num_stages = adist.parallel_group_size("pipeline")
        stage_index = adist.parallel_rank("pipeline")
        chunks = config.chunks or num_stages
        _check_batch_divides(ctx, chunks)
        build = build_stage_module(ctx.model, stage_index, num_stages, config.custom_patcher,
                                   config.partition_method, config.base_seed, config.tie_first)
        ctx.model = build.module.to(ctx.device)
        # This optimization averages gradients over "data" itself (see NativePipeline), so
        # parallel_mode must not wrap the stage in DDP; the stage is placed above.
        ctx.is_sharded = True
        ctx.extra["pipeline_build"] = build
        ctx.extra["pipeline_chunks"] = chunks

    def apply_wrapper(self, ctx: ModelContext, config: PipelineParallelConfig) -> None:
        build = ctx.extra.pop("pipeline_build")
        tied_group, tied_param = _tied_pair(build, ctx.model)
        data_group = adist.parallel_group("data") if adist.parallel_size_or_one("data") > 1 else None
        pipeline = NativePipeline(ctx.model, build.stage_index, build.plan.num_stages,
                                  adist.parallel_group("pipeline"), ctx.device, ctx.extra["pipeline_chunks"],
                                  config.schedule, data_group=data_group, tied_group=tied_group,
                                  tied_param=tied_param)
        ctx.extra["pipeline"] = pipeline
        ctx.extra["train_step"] = pipeline_train_step
        ctx.extra["pipeline_stage"] = build.stage_index


def _check_batch_divides(ctx: ModelContext, chunks: int) -> None:
    global_batch = ctx.dataloader_args.get("batch_size")
    if global_batch is None:
        return
    dp = ctx.data_parallel_size()
    if global_batch % dp != 0 or (global_batch // dp) % chunks != 0:
        raise ValueError(f"pipeline_parallel: global batch size {global_batch} over data-parallel size {dp} gives "
                         f"{global_batch / dp:g} rows per rank, which does not split into chunks={chunks} "
                         "micro-batches; use a global batch size that is a multiple of chunks x data size")


def _tied_pair(build: Any, stage: torch.nn.Module) -> Tuple[Optional[dist.ProcessGroup], Optional[torch.nn.Parameter]]:
    """(group, this stage's tied parameter) for the first/last stages of a split tied embedding/head.

    Every rank creates every group (torch requires it), in the same order: one group per
    data coordinate, holding that replica's first and last stage.
    """
    if build.tied_paths is None:
        return None, None
    layout = adist.parallel_layout()
    last = build.plan.num_stages - 1
    mine = None
    for ranks in _first_last_pairs(layout, last):
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    if build.stage_index == 0:
        return mine, stage.get_submodule(build.tied_paths[0]).weight
    if build.stage_index == last:
        return mine, stage.get_submodule(build.tied_paths[1]).weight
    return None, None


def _first_last_pairs(layout: Any, last: int) -> List[List[int]]:
    pairs = []
    for group in layout.groups("pipeline"):  # each pipeline group is one data replica, in stage order
        pairs.append([group[0], group[last]])
    return pairs


def _num_layers(model_config: Any) -> Optional[int]:
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(model_config, name, None)
        if isinstance(value, int):
            return value
    return None
