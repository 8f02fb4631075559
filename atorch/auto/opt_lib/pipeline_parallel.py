"""`pipeline_parallel`: split a Hugging Face decoder into balanced stages run by a torch pipelining schedule.

Needs a "pipeline" dimension in `parallel_mode` (and optionally "data"): e.g.
`("parallel_mode", ([("data", 2), ("pipeline", 2)], None))`, `("pipeline_parallel", {"chunks": 4})`.
Each rank keeps its stage (pieces under their original state-dict keys), the per-rank batch is
cut into `chunks` micro-batches, and `atorch.auto.train_step(result, batch)` runs one
schedule step, averages gradients over "data" and steps the optimizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.distributed.parallel_layout import ParallelLayout
from atorch.distributed.process_group import default_group_timeout
from atorch.distributed.replicas import check_replicas_agree
from atorch.auto.opt_lib.base import (
    CostContext,
    DataSetup,
    Optimization,
    Order,
    ValidationContext,
    WrapperOrder,
    register,
)
from atorch.auto.opt_lib.lora import LoraConfig, resolve_target_modules, target_layer_names
from atorch.modules.pipeline.batches import check_dataset_sample, check_no_router_aux_loss
from atorch.modules.pipeline.native import (
    SCHEDULES,
    NativePipeline,
    StageBuild,
    build_stage_module,
    check_schedule_chunks,
    pipeline_train_step,
)
from atorch.modules.pipeline.partition import PARTITION_METHODS, StagePlan, plan_stages, stage_parameter_counts
from atorch.modules.pipeline.patchers import CustomPatcher, expand_patcher, pieces_take_position_ids, resolve_patcher
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED, is_meta_module

logger = logging.getLogger(__name__)

# What a native pipeline combines with: everything in the layout must be one of these.
_SUPPORTED_DIMS = ("data", "pipeline")


@dataclass(frozen=True)
class PipelineParallelConfig:
    chunks: Optional[int] = None
    """Micro-batches per step (the per-rank batch must divide into them); None: one per stage. "1f1b" needs
    at least one per stage (torch's Schedule1F1B refuses fewer); "gpipe" takes any number."""

    schedule: str = "gpipe"
    """"gpipe" (all forwards, then all backwards) or "1f1b" (at most `stages` micro-batches of activations;
    chunks >= stages)."""

    partition_method: str = "parameters"
    """"parameters": blocks balanced by parameter count; "uniform": equal block counts."""

    custom_patcher: Optional[CustomPatcher] = None
    """{module path: patch_fn} (see atorch.modules.pipeline.patchers); None: the preset of the model type."""

    base_seed: int = DEFAULT_BASE_SEED
    """A meta model is materialized with the weights of `torch.manual_seed(base_seed); Model(config)`
    (the default is tensor_parallel's too)."""

    tie_first: bool = True
    """Keep a tied embedding/LM-head pair one weight when it is split over the first and last stage."""


@register
class PipelineParallelOptimization(Optimization):
    name = "pipeline_parallel"
    splits_over = frozenset({"pipeline"})
    order = Order.PIPELINE
    wrapper_order = WrapperOrder.ENGINE
    requires = frozenset({"parallel_mode"})
    # The schedule runs forward and backward and averages gradients over "data" itself; these
    # are the optimizations tested per stage (tests/distributed/test_pipeline_parity.py;
    # accumulation: tests/distributed/test_train_step.py).
    allowed_partners = frozenset({"parallel_mode", "amp_native", "half", "checkpoint", "module_replace", "lora",
                                  "fp8", "gradient_accumulation"})
    distributed_only = True
    Config = PipelineParallelConfig
    search_dimension = "parallel"

    @classmethod
    def config_conflicts(cls, config: PipelineParallelConfig) -> Dict[str, str]:
        """Partners outside `allowed_partners` a user is likely to try, with what to use instead."""
        return {"tensor_parallel": "the native pipeline does not split layers inside its stages; use "
                                   "deepspeed_3d_parallel for tensor x data x pipeline"}

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """The layouts of `search_layouts`, each with its chunks (the default, one per stage, when the
        batch is unknown); nothing when the training data is known and `apply` would refuse it
        (`_check_dataset_batches`: a batch key the stages cannot pass, tuple batches). Validation drops
        models without a pipeline patcher."""
        refused = _data_refusal(context)
        if refused is not None:
            logger.info("the search offers no pipeline for this data: %s", refused)
            return []
        return [[("parallel_mode", ([("data", data), ("pipeline", stages)], None)),
                 cls.name if chunks is None else (cls.name, {"chunks": chunks})]
                for data, stages, chunks in search_layouts(context)]

    def __init__(self) -> None:
        self._build: Optional[StageBuild] = None   # the stage built in apply, wrapped into a schedule in apply_wrapper
        self._chunks = 1

    @classmethod
    def syncs_gradients(cls, config: PipelineParallelConfig) -> bool:
        return True

    @classmethod
    def describe_step(cls, config: PipelineParallelConfig) -> str:
        return f"{cls.name}({config.schedule})"

    @classmethod
    def cost_traits(cls, config: PipelineParallelConfig, context: CostContext) -> Dict[str, Any]:
        # Stage-local model states; the schedule averages gradients itself (no DDP buckets).
        stages = context.dims.get("pipeline", 1)
        return {"pipeline_engine": "native", "pipeline_chunks": config.chunks or stages,
                "pipeline_schedule": config.schedule, "ddp_wrap": False}

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
        chunks = config.chunks or sizes["pipeline"]
        check_schedule_chunks(config.schedule, chunks, sizes["pipeline"])
        if config.partition_method not in PARTITION_METHODS:
            raise ValueError(f"pipeline_parallel: partition_method={config.partition_method!r}; valid methods are "
                             f"{list(PARTITION_METHODS)}")
        if not isinstance(config.base_seed, int) or isinstance(config.base_seed, bool):
            raise ValueError(f"pipeline_parallel: base_seed={config.base_seed!r} must be an int")
        if not isinstance(config.tie_first, bool):
            raise ValueError(f"pipeline_parallel: tie_first={config.tie_first!r} must be True or False")
        if context.loss_func_given:
            # The user's loss_func(batch, model_output) needs the model's whole output on one rank;
            # a pipeline never has it (the last stage sees logits and labels only).
            raise ValueError("pipeline_parallel computes the causal-LM loss from the logits on its last stage, so "
                             "auto_accelerate's loss_func cannot be applied (it takes the model's whole output); drop "
                             "loss_func to train on the model's own causal-LM loss, or use deepspeed_3d_parallel, "
                             "which calls loss_func(logits, labels) on the last stage")
        amp = context.configs.get("amp_native")
        if amp is not None and getattr(amp, "dtype", None) is torch.float16:
            raise ValueError("pipeline_parallel with amp_native fp16 is not supported: the pipeline schedule runs "
                             "backward itself, so the fp16 loss scaling of amp_native would never be applied; use "
                             "amp_native with torch.bfloat16")
        check_no_router_aux_loss(self.name, context.any_model_config)
        if context.data is not None:     # what apply checks of the data, known here in a search
            accumulation = context.configs.get("gradient_accumulation")
            _check_last_batch_divides(context.data, sizes.get("data", 1), chunks, getattr(accumulation, "steps", 1))
        if context.model is None:
            return
        pieces = expand_patcher(context.model, resolve_patcher(context.model, config.custom_patcher))
        if context.data is not None:
            _check_dataset_batches(context.data, pieces_take_position_ids(pieces))
        plan = plan_stages(context.model, pieces, sizes["pipeline"], config.partition_method)
        lora = context.configs.get("lora")
        if lora is None:
            _check_every_stage_trains(context.model, plan)
        else:        # only the adapters train: each stage adapts the lora targets it holds
            _check_every_stage_adapts(context.model, plan, lora, context.model_config)

    def apply(self, ctx: ModelContext, config: PipelineParallelConfig) -> None:
        parallel = ctx.require_parallel(self.name)
        num_stages = parallel.size("pipeline")
        stage_index = parallel.rank("pipeline")
        chunks = config.chunks or num_stages
        # Where a fixed strategy's dataset is first seen (validation sees it only in a search), before this
        # optimization's collectives.
        pieces = expand_patcher(ctx.model, resolve_patcher(ctx.model, config.custom_patcher))
        data = DataSetup.of(ctx)
        _check_dataset_batches(data, pieces_take_position_ids(pieces))
        _check_batch_divides(ctx, chunks)
        # gradient_accumulation applies first, so its steps are set by now.
        _check_last_batch_divides(data, ctx.data_parallel_size(), chunks, ctx.gradient_accumulation_steps)
        if not is_meta_module(ctx.model):
            # Stages are cut from each rank's own model and a stage's data replicas are never
            # broadcast: ranks that built different models would train replicas that never agree.
            check_replicas_agree(ctx.model, None, None, "pipeline_parallel",
                                 "each stage is cut from its own rank's model, so every rank must build the same one: "
                                 "set the same seed before building it on every rank, or build it under "
                                 "record_module_init() so the stages are materialized from base_seed")
        build = build_stage_module(ctx.model, stage_index, num_stages, config.custom_patcher,
                                   config.partition_method, config.base_seed, config.tie_first)
        ctx.model = build.module.to(ctx.device)
        # This optimization averages gradients over "data" itself (see NativePipeline); the
        # stage is placed above.
        ctx.is_sharded = True
        self._build, self._chunks = build, chunks

    def apply_wrapper(self, ctx: ModelContext, config: PipelineParallelConfig) -> None:
        build, parallel = self._build, ctx.require_parallel(self.name)
        if build is None:
            raise RuntimeError("pipeline_parallel: apply_wrapper ran before apply built the stage")
        # The tied pair's paths are the stage's own: resolved on the stage built in apply, not on ctx.model,
        # which later optimizations may have wrapped (lora's PeftModel forwards `.model` to the stage itself,
        # so "model.embed_tokens" would not resolve on it).
        tied_group, tied_param = _tied_pair(build, build.module, parallel.layout)
        data_group = parallel.group("data") if parallel.size_or_one("data") > 1 else None
        ctx.pipeline = NativePipeline(ctx.model, build.stage_index, build.plan.num_stages, parallel.group("pipeline"),
                                      ctx.device, self._chunks, config.schedule, data_group=data_group,
                                      tied_group=tied_group, tied_param=tied_param,
                                      takes_position_ids=build.takes_position_ids)
        ctx.custom_train_step = pipeline_train_step
        ctx.pipeline_stage = build.stage_index


def search_layouts(context: ValidationContext) -> List[Tuple[int, int, Optional[int]]]:
    """(data size, stages, chunks) of the pipelines the search offers: every number of stages that
    divides the world and that the model has layers for, the rest data-parallel, with the chunk
    counts of `search_chunks` for its per-rank batch (None, one per stage, when the batch is unknown).
    A layout whose per-rank batch has no chunk count (or does not exist) is not offered."""
    world, batch = context.world_size, context.global_batch_size
    layers = _num_layers(context.model_config)
    out: List[Tuple[int, int, Optional[int]]] = []
    for stages in range(2, world + 1):
        if world % stages or (layers is not None and stages > layers):
            continue
        data = world // stages
        if not batch:
            out.append((data, stages, None))
        elif batch % data == 0:
            out.extend((data, stages, chunks) for chunks in search_chunks(batch // data, stages))
    return out


def search_chunks(per_rank_batch: int, stages: int) -> List[int]:
    """The chunk counts the search tries for `stages` stages over `per_rank_batch` rows (divisors of it).

    The fewest that keep every stage busy in the steady state, the smallest divisor >= stages (1F1B
    refuses fewer, `check_schedule_chunks`, and fewer leaves GPipe idle more than half the step), and
    the smallest divisor >= 2 x stages: GPipe's bubble, (stages - 1) / (chunks + stages - 1) of the
    step, falls from about 1/2 to about 1/3 at micro-batches half as large. More chunks shrink the
    bubble ever more slowly while the micro-batches shrink (less efficient kernels, a send per chunk
    and stage), and gradient_accumulation offers the finer splits that save memory, so two are offered.
    """
    divisors = [c for c in range(stages, per_rank_batch + 1) if per_rank_batch % c == 0]
    if not divisors:
        return []
    larger = next((c for c in divisors if c >= 2 * stages), None)
    return [divisors[0]] + ([larger] if larger is not None and larger != divisors[0] else [])


def _data_refusal(context: ValidationContext) -> Optional[str]:
    """Why `apply` would refuse the context's training data (`_check_dataset_batches`); None where it
    takes it or the data is unknown. The model's default patcher decides whether position_ids pass
    (a model without one: they are let through here, and validation refuses the model)."""
    if context.data is None:
        return None
    takes_position_ids = True
    if context.model is not None:
        try:
            takes_position_ids = pieces_take_position_ids(expand_patcher(context.model,
                                                                         resolve_patcher(context.model, None)))
        except ValueError:
            pass
    try:
        _check_dataset_batches(context.data, takes_position_ids)
    except ValueError as e:
        return str(e)
    return None


def _check_dataset_batches(data: DataSetup, takes_position_ids: bool) -> None:
    """The dataset gives batches the pipeline can take: dicts whose every key it passes on (see
    `check_pipeline_batch`), checked on dataset[0] where no collate_fn or prepare_input may reshape it;
    each batch is checked again before its step."""
    if data.model_input_format == "unpack_sequence":
        raise ValueError("pipeline_parallel needs dict batches with 'input_ids' and 'labels' (it feeds input_ids "
                         "to the first stage and labels to the loss on the last), but model_input_format="
                         "'unpack_sequence' passes tuples; return a dict such as {'input_ids': ..., 'labels': ...} "
                         "from the dataset and use model_input_format='unpack_dict'")
    if not data.reshapes_samples:
        check_dataset_sample(data.dataset, takes_position_ids)


def _check_every_stage_trains(model: nn.Module, plan: StagePlan) -> None:
    """A stage whose parameters the user froze (requires_grad=False) has nothing for its optimizer: refused here,
    naming the stage and its layers, rather than failing after the model was split."""
    counts = stage_parameter_counts(model, plan, include_embeddings=True)
    for stage, count in enumerate(counts):
        if count == 0:
            paths = [piece.path for piece in plan.stage_pieces(stage)]
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} pieces)" if len(paths) > 4 else "")
            raise ValueError(f"pipeline_parallel: stage {stage} of {plan.num_stages} ({shown}) has no trainable "
                             "parameter: the model's parameters there have requires_grad=False, so that stage has "
                             "nothing for the optimizer; use fewer pipeline stages, unfreeze a layer of that stage, "
                             "or add 'lora'")


def _check_every_stage_adapts(model: nn.Module, plan: StagePlan, lora: LoraConfig, model_config: Any) -> None:
    """Under lora each stage adapts the targets it holds (one on another stage is adapted there); a stage that
    holds none has nothing for its optimizer: refused here, naming the stage and the layers the targets name."""
    try:
        targets = resolve_target_modules(model, lora, model_config)
    except ValueError:
        return       # lora's own validation names what is wrong with the targets
    layers = target_layer_names(model, targets)
    for stage in range(plan.num_stages):
        paths = [piece.path for piece in plan.stage_pieces(stage)]
        if not any(name == path or name.startswith(f"{path}.") for name in layers for path in paths):
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} pieces)" if len(paths) > 4 else "")
            named = ", ".join(layers[:3]) + (f", ... ({len(layers)} layers)" if len(layers) > 3 else "")
            raise ValueError(f"pipeline_parallel: stage {stage} of {plan.num_stages} ({shown}) holds none of lora's "
                             f"target_modules {list(targets)} (they name {named}), so that stage has nothing to "
                             "train; add a target the stage holds (e.g. its attention projections), or use fewer "
                             "pipeline stages")


def _check_last_batch_divides(data: DataSetup, dp: int, chunks: int, steps: int) -> None:
    """With dataloader_args['drop_last']=False the epoch's last, smaller batch must split into the chunks
    (times the gradient-accumulation `steps`) too, over `dp` data ranks: the schedule's micro-batch count is
    fixed. Refused before training rather than at the end of the first epoch."""
    global_batch = data.global_batch_size
    if global_batch is None or data.drop_last or data.sampler_given or not hasattr(data.dataset, "__len__") \
            or global_batch % dp:       # a batch that does not split over the data ranks is refused on its own
        return
    per_rank = -(-len(data.dataset) // dp)        # DistributedSampler(drop_last=False) pads every rank to this
    last = per_rank % (global_batch // dp)
    steps = max(1, steps)
    if last and last % (chunks * steps):
        into = f"chunks={chunks}" + (f" x gradient_accumulation steps={steps}" if steps > 1 else "")
        raise ValueError(f"pipeline_parallel: with dataloader_args['drop_last']=False the last batch of each epoch "
                         f"has {last} rows per data-parallel rank ({len(data.dataset)} samples in global batches of "
                         f"{global_batch}), which does not split into {into} micro-batches; set drop_last=True, or "
                         "use a dataset length whose remainder splits")


def _check_batch_divides(ctx: ModelContext, chunks: int) -> None:
    global_batch = ctx.dataloader_args.get("batch_size")
    if global_batch is None:
        return
    dp = ctx.data_parallel_size()
    if global_batch % dp != 0 or (global_batch // dp) % chunks != 0:
        raise ValueError(f"pipeline_parallel: global batch size {global_batch} over data-parallel size {dp} gives "
                         f"{global_batch / dp:g} rows per rank, which does not split into chunks={chunks} "
                         "micro-batches; use a global batch size that is a multiple of chunks x data size")


def _tied_pair(build: StageBuild, stage: torch.nn.Module, layout: ParallelLayout
               ) -> Tuple[Optional[dist.ProcessGroup], Optional[torch.nn.Parameter]]:
    """(group, this stage's tied parameter) for the first/last stages of a split tied embedding/head.

    `stage`: the unwrapped `PipelineStageModule`, whose submodules sit under the model's own paths. A layer an
    optimization adapted in place (lora's layer around the embedding) still gives its base weight as `.weight`.
    Every rank creates every group (torch requires it), in the same order: one group per
    data coordinate, holding that replica's first and last stage.
    """
    if build.tied_paths is None:
        return None, None
    last = build.plan.num_stages - 1
    mine = None
    for ranks in _first_last_pairs(layout, last):
        group = dist.new_group(ranks=ranks, timeout=default_group_timeout())
        if dist.get_rank() in ranks:
            mine = group
    if build.stage_index == 0:
        return mine, cast(torch.nn.Parameter, stage.get_submodule(build.tied_paths[0]).weight)
    if build.stage_index == last:
        return mine, cast(torch.nn.Parameter, stage.get_submodule(build.tied_paths[1]).weight)
    return None, None


def _first_last_pairs(layout: ParallelLayout, last: int) -> List[List[int]]:
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
