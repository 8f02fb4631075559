"""`deepspeed_3d_parallel` (alias `ds_3d_parallel`): tensor x data x pipeline training with a DeepSpeed PipelineEngine.

The model (best built under `record_module_init`, so nothing is allocated before the split)
becomes a `PipeModuleFromRecordedMeta`: balanced stages of the HF model, tensor-parallel
inside each stage with the TPInfo of the model type, driven by DeepSpeed's pipeline engine::

    strategy = [("parallel_mode", ([("tensor", t), ("data", d), ("pipeline", p)], None)),
                ("deepspeed_3d_parallel", DeepSpeed3DParallelConfig(ds_config=ds_config))]
    status, result, _ = auto_accelerate(meta_model, optim_func=..., dataset=..., load_strategy=strategy)
    engine = result.model                       # deepspeed PipelineEngine
    loss = engine.train_batch(iter(result.dataloader))   # one global batch

The only supported layout is ("tensor", "data", "pipeline") with tensor varying fastest: it
is DeepSpeed's own rank order (model fastest, then data, then pipe), so atorch's "tensor"
group, used by the tensor-parallel layers, holds exactly DeepSpeed's model-parallel ranks.
DeepSpeed is imported only when the optimization is applied.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._ds_config import (
    BATCH_KEYS,
    check_one_scheduler,
    check_switches,
    complete_batch_sizes,
    half_dtype,
    load_ds_config,
    merge_ds_config,
    user_bucket_elements,
    with_derived_buckets,
    zero_stage_of,
)
from atorch.auto.opt_lib._flat_partitions import check_flat_partition_optimizer
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, WrapperOrder, register
from atorch.modules.pipeline.batches import (
    check_dataset_sample,
    check_no_router_aux_loss,
    find_batch_rows,
    hf_batch_fn,
    split_micro_batches,
)
from atorch.modules.pipeline.partition import plan_stages
from atorch.modules.pipeline.patchers import (
    CustomPatcher,
    expand_patcher,
    get_gpt2_custom_patcher,
    get_llama_custom_patcher,
    model_config_of,
    resolve_patcher,
)
from atorch.modules.pipeline.patchers import get_custom_patcher as _preset_patcher
from atorch.utils.manual_tp_utils import TPInfo, resolve_tp_plan
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED
from atorch.utils.tp_presets import gpt2_tpinfo, llama_tpinfo, tpinfo_for_model

__all__ = ["DeepSpeed3DParallelConfig", "DeepSpeed3DParallelOptimization", "get_custom_patcher",
           "get_gpt2_custom_patcher", "get_gpt2_tpinfo", "get_llama_custom_patcher", "get_llama_tpinfo",
           "get_tpinfo", "resolve_ds_config"]

logger = logging.getLogger(__name__)

# atorch's dims for DeepSpeed 3D, fastest first: DeepSpeed's (model, data, pipe) order.
SUPPORTED_ORDER = ("tensor", "data", "pipeline")


@dataclass
class DeepSpeed3DParallelConfig:
    """Options of `deepspeed_3d_parallel`; every field may be left at its default for Llama and GPT2."""

    base_seed: int = DEFAULT_BASE_SEED
    """Seed of the materialized weights (equal to `torch.manual_seed(base_seed); Model(config)`) and of the
    tensor-parallel dropout streams."""

    tpinfo: Optional[TPInfo] = None
    """Tensor-parallel plan inside each stage; None: the preset of the model type (`get_tpinfo`)."""

    custom_patcher: Optional[CustomPatcher] = None
    """{module path: patch_fn} in forward order (atorch.modules.pipeline.patchers); None: `get_custom_patcher`."""

    tie_first: bool = True
    """Keep an LM head tied to the input embedding one weight across the first and last stage."""

    logit_helper: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """`fn(logits) -> logits` on the last stage, before the loss (e.g. gather or scale logits)."""

    ds_config: Union[None, str, os.PathLike, Dict[str, Any]] = None
    """DeepSpeed config dict or JSON path. Its batch keys may be left out: the global batch is then
    `dataloader_args["batch_size"]`, split into micro-batches as `resolve_ds_config` says; given, they may
    be partial (DeepSpeed's rule fills the rest, the dataloader's batch size standing for train_batch_size)
    but must agree with the dataloader's batch size. `gradient_clipping` defaults to 0 (no clipping, as in
    plain training) when absent, unlike DeepSpeed's 1.0. A value given is kept (ATorch's loops call
    `engine.train_batch` themselves and clip through it); `train_step(..., max_grad_norm=)` overrides it for
    that one step only."""

    batch_fn: Optional[Callable[[Any], Any]] = None
    """Turns a dataloader item into `((inputs...), labels)`; None: Hugging Face dicts (input_ids, labels,
    optional attention_mask) are accepted."""


WHO = "deepspeed_3d_parallel"


def resolve_ds_config(raw: Any, data_size: int, pipeline_size: int,
                      global_batch: Optional[int] = None) -> Dict[str, Any]:
    """The DeepSpeed config to run with: batch sizes completed and checked, strategy contradictions refused.

    `global_batch` is the dataloader's global batch (`dataloader_args["batch_size"]`), None when not given;
    the batch keys are completed from it and the user's ones as `_complete_batch` says.
    Pure. Raises ValueError naming the values when the config contradicts the parallel layout or the
    dataloader's batch size.
    Reading, batch completion and merging are shared with the ZeRO engines (`_ds_config`).
    """
    cfg = load_ds_config(WHO, raw)
    check_switches(WHO, cfg, "ds_config's bf16 or fp16 section here (e.g. {'bf16': {'enabled': true}})")
    stage = zero_stage_of(cfg)
    if not isinstance(stage, int) or stage >= 2:
        raise ValueError(f"{WHO}: ds_config zero_optimization.stage={stage!r} contradicts pipeline "
                         "parallelism (DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only)")
    stages = (cfg.get("pipeline") or {}).get("stages", "auto")
    if stages not in ("auto", pipeline_size):
        raise ValueError(f"{WHO}: ds_config pipeline.stages={stages!r} but parallel_mode has "
                         f"pipeline={pipeline_size}")
    _complete_batch(cfg, data_size, pipeline_size, global_batch)
    user_bucket_elements(cfg)     # a bucket size that is not a count of elements raises here
    # DeepSpeed clips at 1.0 by default; atorch's contract is the training of the plain loop.
    return merge_ds_config({"gradient_clipping": 0.0}, cfg)


# The batch when neither the dataloader (dataloader_args["batch_size"]) nor ds_config's batch keys give one:
# one row per data rank, in one micro-batch. DeepSpeed itself refuses a config without batch keys, but this
# is not refused: validation cannot tell a run from `atorch.auto.plan(strategy)`, which validates a strategy
# knowing no batch, and the rest of atorch takes the dataloader's default too (torch's DataLoader: batch_size
# 1) for a missing batch size. It is the smallest batch every layout can run (what DeepSpeed's rule gives
# for train_micro_batch_size_per_gpu=1) and what this optimization always did; `apply` logs a warning.
DEFAULT_ROWS_PER_DATA_RANK = 1


def _user_batch_keys(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The batch keys the user's (loaded) ds_config sets."""
    return {k: cfg[k] for k in BATCH_KEYS if cfg.get(k) is not None}


def default_accumulation_steps(rows_per_data_rank: int, pipeline_size: int) -> int:
    """Micro-batches per step when the user's ds_config has no batch keys: the largest number, at most
    the pipeline size, that divides this data rank's share of the global batch.

    DeepSpeed's own rule (no gradient_accumulation_steps: 1) would run a pipeline of p stages on one
    micro-batch, each stage idle while the others work: no faster than one device. One micro-batch per
    stage is the least that keeps every stage busy at once (and `pipeline_parallel`'s `chunks` default);
    more would shrink the pipeline bubble further but also each stage's matmuls. Taking the largest
    divisor rather than refusing a batch that does not split into p keeps every valid batch size
    trainable; a step is the same mean over the global batch either way.
    """
    return max(k for k in range(1, min(pipeline_size, rows_per_data_rank) + 1) if rows_per_data_rank % k == 0)


def _complete_batch(cfg: Dict[str, Any], data_size: int, pipeline_size: int, global_batch: Optional[int]) -> None:
    """Set the three batch keys of `cfg` from the user's batch keys and the dataloader's global batch.

    - Only the dataloader gives it: train_batch_size = global_batch, split over the data ranks into
      `default_accumulation_steps` micro-batches.
    - Only ds_config gives it: DeepSpeed's rule (`complete_batch_sizes`).
    - Both: the dataloader's batch stands for a missing train_batch_size; a contradiction raises.
    - Neither: `DEFAULT_ROWS_PER_DATA_RANK` (see there; `apply` warns that it is used).
    """
    given = _user_batch_keys(cfg)
    if global_batch is None:
        if given:
            complete_batch_sizes(WHO, cfg, data_size)
            return
        global_batch = DEFAULT_ROWS_PER_DATA_RANK * data_size
    if global_batch % data_size != 0:
        raise ValueError(f"{WHO}: dataloader_args batch_size={global_batch} (global) is not divisible by the data "
                         f"size {data_size}")
    if not given:
        rows = global_batch // data_size
        gas = default_accumulation_steps(rows, pipeline_size)
        cfg.update(train_batch_size=global_batch, train_micro_batch_size_per_gpu=rows // gas,
                   gradient_accumulation_steps=gas)
        return
    # The user's keys alone: their types and, when they fix the global batch, their consistency.
    total, micro, gas = complete_batch_sizes(WHO, dict(given), data_size)
    if "train_batch_size" in given or len(given) == 2:
        if total != global_batch:
            said = (f"ds_config train_batch_size={total}" if "train_batch_size" in given else
                    f"ds_config train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x data "
                    f"size {data_size} = {total} (global)")
            raise ValueError(f"{WHO}: dataloader_args batch_size={global_batch} (global) differs from {said}; drop "
                             "the batch keys from ds_config (the dataloader's batch size is then split into "
                             "micro-batches) or make them agree")
        cfg.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        return
    (key, value), = given.items()   # one of micro / accumulation: the dataloader's batch completes it
    if global_batch % (value * data_size) != 0:
        raise ValueError(f"{WHO}: dataloader_args batch_size={global_batch} (global) is not divisible by ds_config "
                         f"{key}={value} x data size {data_size}")
    cfg["train_batch_size"] = global_batch
    complete_batch_sizes(WHO, cfg, data_size)


def _batch_for_cost(raw: Any, data_size: int, pipeline_size: int) -> Optional[int]:
    """The global batch the cost model assumes, as it does not know the dataloader's: None when the user's
    ds_config has batch keys (DeepSpeed's rule completes them), else one that splits into one micro-batch of
    one row per stage on each data rank (what `default_accumulation_steps` chooses for batches that split)."""
    if _user_batch_keys(load_ds_config(WHO, raw)):
        return None
    return data_size * pipeline_size


def _layout_sizes(context_sizes: Mapping[str, int], world_size: int) -> Tuple[int, int, int]:
    """(tensor, data, pipeline) sizes, after checking the dims are the supported order."""
    names = list(context_sizes)
    unknown = [n for n in names if n not in SUPPORTED_ORDER]
    order = [n for n in SUPPORTED_ORDER if n in names]
    if unknown or names != order:
        raise ValueError(f"deepspeed_3d_parallel supports the parallel order {list(SUPPORTED_ORDER)} (tensor varies "
                         f"fastest, as in DeepSpeed's topology), optionally without some of them; got {names}")
    t, d, p = (context_sizes.get(n, 1) for n in SUPPORTED_ORDER)
    if t * d * p != world_size:
        raise ValueError(f"deepspeed_3d_parallel: tensor={t} x data={d} x pipeline={p} = {t * d * p} does not equal "
                         f"the world size {world_size}")
    return t, d, p


@register
class DeepSpeed3DParallelOptimization(Optimization):
    name = "deepspeed_3d_parallel"
    splits_over = frozenset({"tensor", "pipeline"})
    aliases = ("ds_3d_parallel",)
    order = Order.DEEPSPEED_3D
    wrapper_order = WrapperOrder.ENGINE
    requires = frozenset({"parallel_mode"})
    # It shards (tensor parallel), syncs gradients (pipeline engine) and sets precision (ds_config)
    # itself; these are the optimizations that apply before it to the recorded model. Not lora
    # (`config_conflicts`).
    allowed_partners = frozenset({"parallel_mode", "checkpoint", "module_replace"})
    distributed_only = False  # one process is a valid (1, 1, 1) layout, handy for debugging
    Config = DeepSpeed3DParallelConfig
    search_dimension = None   # driven by the user's ds_config (batch split, precision, ZeRO stage)
    # Without dataloader_args["batch_size"] the global batch is ds_config's (`resolve_ds_config`), not
    # torch's default of 1: auto_accelerate leaves the batch size absent for it (`default_batch_size`).
    global_batch_from_config = True

    def __init__(self) -> None:
        self._ds_config: Dict[str, Any] = {}   # resolved in apply, used to build the engine in apply_wrapper

    @classmethod
    def config_conflicts(cls, config: DeepSpeed3DParallelConfig) -> Dict[str, str]:
        """Partners a user is likely to try that it does not take, with what to use instead."""
        # lora applies first and wraps the model in peft's PeftModel, whose module paths (base_model.model....)
        # the stage patchers do not know: it failed while applying ("LlamaForCausalLM has no attribute
        # `embed_tokens`"). The native pipeline adds the adapters to each stage and is tested for parity.
        return {"lora": "DeepSpeed's pipeline stages cannot be built from a peft model; use the native pipeline, "
                        "pipeline_parallel, with lora instead (e.g. [('parallel_mode', ([('pipeline', 2)], None)), "
                        "'pipeline_parallel', 'lora'])"}

    @classmethod
    def syncs_gradients(cls, config: DeepSpeed3DParallelConfig) -> bool:
        return True

    @classmethod
    def cost_traits(cls, config: DeepSpeed3DParallelConfig, context: CostContext) -> Dict[str, Any]:
        # DeepSpeed's pipeline engine (ZeRO 0 or 1 over "data"), tensor parallel inside each stage,
        # the micro-batch and accumulation steps of the resolved ds_config.
        d, p = context.dims.get("data", 1), context.dims.get("pipeline", 1)
        ds = resolve_ds_config(config.ds_config, d, p, _batch_for_cost(config.ds_config, d, p))
        half = half_dtype(ds)
        gas = ds["gradient_accumulation_steps"]
        stage = zero_stage_of(ds)
        out: Dict[str, Any] = {"sharding": "deepspeed", "zero_stage": stage,
                               "pipeline_engine": "deepspeed", "tensor_parallel": True, "ddp_wrap": False,
                               "accumulation_steps": gas, "pipeline_chunks": gas, "pipeline_schedule": "1f1b",
                               "ds_bucket_elements": user_bucket_elements(ds) or 0}
        if half is not None:
            out["compute_dtype_bytes"] = 2
            out["bf16"] = half is torch.bfloat16
        return out

    def validate(self, config: DeepSpeed3DParallelConfig, context: ValidationContext) -> None:
        _check_fields(config)
        pm = context.configs.get("parallel_mode")
        if pm is not None and pm.rank_order is not None:
            raise ValueError(f"deepspeed_3d_parallel needs rank_order None (DeepSpeed derives ranks from the layout), "
                             f"got {list(pm.rank_order)}")
        t, d, p = _layout_sizes(context.parallel_sizes(), context.world_size)
        ds_config = resolve_ds_config(config.ds_config, d, p, context.global_batch_size)
        check_precision_on_device(ds_config, context.device_type)
        check_no_router_aux_loss(WHO, context.any_model_config)
        if context.model is None:
            return
        pieces = expand_patcher(context.model, resolve_patcher(context.model, config.custom_patcher))
        plan_stages(context.model, pieces, p)
        if t > 1:
            tpinfo = config.tpinfo if config.tpinfo is not None else tpinfo_for_model(context.model)
            resolve_tp_plan(context.model, tpinfo, t, world_size=context.world_size)

    def apply(self, ctx: ModelContext, config: DeepSpeed3DParallelConfig) -> None:
        from atorch.modules.pipeline.ds_pipe import (
            PipeModuleFromRecordedMeta,
            build_topology,
            check_topology_matches_atorch,
        )

        parallel = ctx.require_parallel(self.name)
        t, d, p = (parallel.size_or_one(n) for n in SUPPORTED_ORDER)
        # Validation checked the same values (the dataloader's batch against ds_config's batch keys).
        global_batch = ctx.dataloader_args.get("batch_size")
        ds_config = resolve_ds_config(config.ds_config, d, p, global_batch)
        if global_batch is None and not _user_batch_keys(load_ds_config(WHO, config.ds_config)):
            logger.warning("%s: neither dataloader_args['batch_size'] nor ds_config's batch keys give a batch size; "
                           "training on the default global batch of %d (%d row(s) per data rank); pass "
                           "dataloader_args={'batch_size': ...} to choose it", WHO, ds_config["train_batch_size"],
                           DEFAULT_ROWS_PER_DATA_RANK)
        if ctx.dataset is not None and ctx.dataloader is None:   # atorch builds the loader (apply_wrapper)
            check_dataset_fills_a_step(ctx.dataset, bool(ctx.dataloader_args.get("drop_last", True)), ds_config, d)
        if ctx.optim_func is not None and "optimizer" in ds_config:
            raise ValueError("deepspeed_3d_parallel: both optim_func and ds_config['optimizer'] are given; pass one")
        check_one_scheduler(WHO, ds_config, ctx.lr_scheduler_cls)
        topology = build_topology(p, t, d)
        check_topology_matches_atorch(topology, parallel.layout)
        tensor_group = parallel.group("tensor") if t > 1 else None
        # auto_accelerate's loss_func is the pipeline's loss, called on the last stage as
        # loss_func(outputs, labels) (ATorch's contract); None: the causal-LM loss.
        loss_kwargs: Dict[str, Any] = {"loss_fn": ctx.loss_func} if ctx.loss_func is not None else {}
        ctx.model = PipeModuleFromRecordedMeta(ctx.model, custom_patcher=config.custom_patcher,
                                               tie_first=config.tie_first, logit_helper=config.logit_helper,
                                               tpinfo=config.tpinfo, tensor_group=tensor_group, topology=topology,
                                               base_seed=config.base_seed,
                                               randomizer_coords=parallel.layout.coords(torch.distributed.get_rank()),
                                               **loss_kwargs)
        _mark_tensor_parallel_params(ctx.model, topology.get_coord(torch.distributed.get_rank()).model)
        # The pipeline engine places the stages and reduces gradients: no DDP, no _place_model.
        ctx.is_sharded = True
        ctx.dataloader_args["batch_size"] = ds_config["train_batch_size"]
        self._ds_config = ds_config

    def apply_wrapper(self, ctx: ModelContext, config: DeepSpeed3DParallelConfig) -> None:
        import deepspeed

        from atorch.modules.pipeline.ds_pipe import refresh_partition_meta_per_instruction

        # ZeRO-1 over "data": its buckets sized from this stage's trainable elements (the user's
        # sizes win), as for the ZeRO engines; DeepSpeed's default is 5e8 elements whatever the model.
        ds_config = with_derived_buckets(self._ds_config, sum(q.numel() for q in ctx.model.parameters()
                                                                  if q.requires_grad))
        if ctx.optim is None and "optimizer" not in ds_config:
            raise ValueError("deepspeed_3d_parallel needs an optimizer: pass optim_func or ds_config['optimizer']")
        if ctx.lr_scheduler is None and ctx.lr_scheduler_cls is not None and ctx.optim is not None:
            # Built here so the engine steps it at each optimizer step.
            ctx.lr_scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
        if ctx.optim is not None and (half_dtype(ds_config) is not None or zero_stage_of(ds_config)):
            # ZeRO-1 and DeepSpeed's half-precision optimizers step flat partitions of the parameters.
            check_flat_partition_optimizer(WHO, ctx.optim)
        params = [q for q in ctx.model.parameters() if q.requires_grad] if ctx.optim is None else None
        engine, optim, _, scheduler = deepspeed.initialize(model=ctx.model, optimizer=ctx.optim,
                                                           model_parameters=params, lr_scheduler=ctx.lr_scheduler,
                                                           config=ds_config, dist_init_required=False)
        if config.batch_fn is None and ctx.prepare_input is None and ctx.dataloader_args.get("collate_fn") is None:
            # hf_batch_fn gives the stages input_ids and attention_mask, the loss labels: any other key is dropped.
            check_dataset_sample(ctx.dataset, takes_position_ids=False, who=WHO, tuples_pass=True)
        engine.set_batch_fn(config.batch_fn or hf_batch_fn)
        agree_on_the_end_of_data(engine, ds_config["gradient_accumulation_steps"])
        refresh_partition_meta_per_instruction(engine)   # sequence lengths may vary under tensor parallelism too
        ctx.engine, ctx.optim, ctx.lr_scheduler = engine, optim, scheduler
        if ctx.dataset is not None and ctx.dataloader is None:
            ctx.dataloader, ctx.sampler = _micro_batch_loader(ctx, ds_config["gradient_accumulation_steps"])
        ctx.deepspeed_config = ds_config
        ctx.custom_train_step = ds3d_train_step
        ctx.gradient_accumulation_steps = ds_config["gradient_accumulation_steps"]
        ctx.micro_batch_size = ds_config["train_micro_batch_size_per_gpu"]


def agree_on_the_end_of_data(engine: Any, gas: int) -> None:
    """Make `engine.train_batch(data_iter)` raise StopIteration on every rank when any rank's iterator
    cannot give a whole step.

    DeepSpeed's pipeline schedule reads a micro-batch on the first stage before anything is sent, and on the
    last stage only after receiving the first activations: at the end of the data the first stage raised
    StopIteration at once while the last waited for activations that never came (a loop calling train_batch
    until StopIteration hung there). Each rank now takes the step's `gas` micro-batches from its iterator
    first, and the ranks agree with one all-reduce of one number per step (every data replica too: a replica
    that stopped alone would leave the others in the gradient all-reduce). A rank with fewer than `gas` left
    drops them, with a warning. Without an iterator (DeepSpeed then uses the one set before, or a middle stage
    that reads nothing) the rank counts as having a whole step. `ds3d_train_step` calls the class's method.
    """
    import torch.distributed as dist

    train_batch = engine.train_batch

    def agreed_train_batch(data_iter: Any = None) -> Any:
        if data_iter is None:
            return train_batch()
        step = []
        for _ in range(gas):
            try:
                step.append(next(data_iter))
            except StopIteration:
                break
        have = torch.tensor([len(step)], dtype=torch.int64, device=engine.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if int(have.item()) < gas:
            if step:
                logger.warning("%s: the data ran out in the middle of a step (%d of gradient_accumulation_steps=%d "
                               "micro-batches on this rank); those are left out and every rank stops with "
                               "StopIteration", WHO, len(step), gas)
            raise StopIteration
        return train_batch(iter(step))

    engine.train_batch = agreed_train_batch


def check_precision_on_device(ds_config: Mapping[str, Any], device_type: str) -> None:
    """ValueError for a resolved ds_config whose precision DeepSpeed cannot run on `device_type`: fp16 on CPU.

    DeepSpeed's CPU accelerator has no fp16: its pipeline engine builds anyway and trains wrong (about
    two thirds of fp32's progress per step, no step skipped). The ZeRO engines refuse amp_native fp16 on
    CPU alike (`validate_deepspeed`)."""
    if device_type == "cpu" and (ds_config.get("fp16") or {}).get("enabled") is True:
        raise ValueError(f"{WHO}: ds_config fp16.enabled=true is not supported on CPU: DeepSpeed's CPU accelerator "
                         "has no fp16; use {'bf16': {'enabled': true}} or drop fp16 to train in fp32")


def _check_fields(config: DeepSpeed3DParallelConfig) -> None:
    if not isinstance(config.base_seed, int) or isinstance(config.base_seed, bool):
        raise ValueError(f"deepspeed_3d_parallel: base_seed={config.base_seed!r} must be an int")
    if config.tpinfo is not None and not isinstance(config.tpinfo, TPInfo):
        raise ValueError(f"deepspeed_3d_parallel: tpinfo must be a TPInfo or None, got {type(config.tpinfo).__name__}")
    if not isinstance(config.tie_first, bool):
        raise ValueError(f"deepspeed_3d_parallel: tie_first={config.tie_first!r} must be a bool")
    for key in ("logit_helper", "batch_fn"):
        value = getattr(config, key)
        if value is not None and not callable(value):
            raise ValueError(f"deepspeed_3d_parallel: {key}={value!r} must be callable or None")
    if config.custom_patcher is not None and not isinstance(config.custom_patcher, Mapping):
        raise ValueError(f"deepspeed_3d_parallel: custom_patcher must be a {{module path: patch_fn}} mapping, got "
                         f"{type(config.custom_patcher).__name__}")


def _mark_tensor_parallel_params(module: nn.Module, tensor_rank: int) -> None:
    """Tag the parameters DeepSpeed is to count in its gradient norm (clipping) on this rank.

    DeepSpeed counts a parameter tagged `tensor_model_parallel` on every rank of its model-parallel group and any
    other only on that group's rank 0, then sums over the group. Its pipeline grid's model-parallel group is the
    whole data replica (every stage x tensor rank), so untagged, only stage 0's parameters counted: the norm
    clipped with was stage 0's. Tagged here: a tensor-parallel shard (summed over the tensor ranks) and, on tensor
    rank 0 of every stage, a replicated parameter (counted once), as Megatron counts; not the last stage's copy of
    a tied weight (`ds_pipe_replicated`: the first stage counts it). DeepSpeed's bf16 and ZeRO norms apply the same
    rule by the tensor rank themselves, and skip `ds_pipe_replicated`; the plain fp32 step needs the tags.
    """
    from atorch.modules.distributed_modules.layers import TensorParallelModule

    shards: Set[int] = set()
    for sub in module.modules():
        if isinstance(sub, TensorParallelModule) and sub.tp_size > 1:
            shards.update(id(getattr(sub, name)) for name in sub.shard_specs())
    for param in module.parameters():
        counted = (id(param) in shards or tensor_rank == 0) and not getattr(param, "ds_pipe_replicated", False)
        setattr(param, "tensor_model_parallel", counted)


def _micro_batch_loader(ctx: ModelContext, gas: int) -> Tuple[Any, Any]:
    """The dataloader of `auto_accelerate`, yielding micro-batches (`engine.train_batch` pulls gas of them): the
    global batch (`dataloader_args["batch_size"]`, set to train_batch_size by `apply`) in `gas` items per data rank,
    so that its log counts whole global batches."""
    from atorch.auto.engine import build_dataloader

    return build_dataloader(ctx, micro_batches=gas)


def check_dataset_fills_a_step(dataset: Any, drop_last: bool, ds_config: Mapping[str, Any], data_size: int) -> None:
    """ValueError when `dataset` cannot fill one step of `ds_config`: the dataloader gives each data rank fewer
    than gradient_accumulation_steps micro-batches (with drop_last, the default: fewer samples than one global
    batch), and the engine's first `train_batch` would run out of them on some stages only; or, with
    drop_last=False, when an epoch ends in the middle of a step (its last `train_batch` would run out the same
    way). Pure: every rank raises the same error before training."""
    size = len(dataset) if hasattr(dataset, "__len__") else None
    if size is None:
        return
    total, micro = ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"]
    gas = ds_config["gradient_accumulation_steps"]
    # What DistributedSampler and DataLoader give each data rank: whole micro-batches, or with drop_last=False
    # every sample (the sampler repeating a few) in micro-batches of which the last may be smaller.
    if drop_last:
        items = size // data_size // micro
    else:
        per_rank = -(-size // data_size)          # ceil
        items = -(-per_rank // micro)
    if items >= gas and (drop_last or items % gas == 0):
        return
    if items >= gas:
        # drop_last (the default) leaves the epoch's incomplete last step out (build_dataloader), as the other
        # layouts leave out an incomplete last global batch; False asks to train every sample, which the engine can
        # only do in whole steps (the native pipeline refuses a last batch that does not split the same way).
        raise ValueError(f"{WHO}: with dataloader_args['drop_last']=False the last step of each epoch has "
                         f"{items % gas} micro-batch(es) per data rank ({size} samples, train_batch_size={total} = "
                         f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x data size "
                         f"{data_size}), but the engine takes gradient_accumulation_steps={gas} micro-batches per "
                         f"step; set drop_last=True to leave the last {size % total} samples out of each epoch, or "
                         "use a dataset length that fills whole steps")
    raise ValueError(f"{WHO}: dataset has {size} samples, fewer than one global batch (train_batch_size={total} = "
                     f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x data size "
                     f"{data_size}; dataloader_args['drop_last']={drop_last}): the dataloader would yield no whole "
                     "step; give more samples or a smaller batch")


def ds3d_train_step(result: Any, batch: Any) -> torch.Tensor:
    """`atorch.auto.train_step` for DeepSpeed 3D: one `engine.train_batch` on this data rank's share of a global batch.

    `batch` holds micro x gradient_accumulation_steps rows (or is the list of those micro-batches);
    returns the global-batch loss (averaged over micro-batches and data ranks), on every rank.
    """
    engine = result.model
    gas = result.gradient_accumulation_steps
    micro = result.micro_batch_size
    if isinstance(batch, Sequence) and not isinstance(batch, Mapping) and len(batch) == gas and \
            all(isinstance(b, Mapping) for b in batch):
        micro_batches = list(batch)
    elif isinstance(batch, Mapping):
        rows = find_batch_rows(batch)   # as train_step counts them: the first tensor's, at any depth
        if rows != micro * gas:
            what = f"a batch of {rows} rows" if rows is not None else "a batch without tensors"
            raise ValueError(f"deepspeed_3d_parallel train_step: {what}, but one step takes "
                             f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} = "
                             f"{micro * gas} rows per data rank; or call engine.train_batch(iter(result.dataloader)),"
                             " whose items are micro-batches")
        micro_batches = split_micro_batches(batch, gas)
    else:
        raise ValueError(f"deepspeed_3d_parallel train_step: batch must be a dict or a list of {gas} micro-batch dicts")
    # The class's train_batch, not `agree_on_the_end_of_data`'s: every rank that gets here holds a whole step
    # (checked above), so the agreement's all-reduce and host sync would buy nothing on this per-step path.
    return type(engine).train_batch(engine, iter(micro_batches))


# ---- presets, importable from here as the documented interface ------------------------------

def _meta_model_of(model_or_config: Any) -> nn.Module:
    """A model to inspect: the model itself, or a meta-device instance built from a config."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_or_config)


def get_tpinfo(model_or_config: Any) -> TPInfo:
    """The tensor-parallel preset of a model (or its config), found by `config.model_type`."""
    return tpinfo_for_model(_meta_model_of(model_or_config))


def get_custom_patcher(model_or_config: Any) -> Dict[str, Callable]:
    """The pipeline patcher preset of a model (or its config), found by `config.model_type`."""
    return _preset_patcher(model_config_of(model_or_config))


def get_llama_tpinfo(model_or_config: Any = None) -> TPInfo:
    """Llama's TPInfo (q/k/v/gate/up column-parallel, o/down row-parallel, vocab-parallel embedding)."""
    if model_or_config is None:
        from transformers import LlamaConfig

        model_or_config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    return llama_tpinfo(_meta_model_of(model_or_config))


def get_gpt2_tpinfo(model_or_config: Any = None) -> TPInfo:
    """GPT2's TPInfo (fused c_attn with stride 3, c_fc column-parallel, c_proj row-parallel, vocab-parallel wte)."""
    if model_or_config is None:
        from transformers import GPT2Config

        model_or_config = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128)
    return gpt2_tpinfo(_meta_model_of(model_or_config))
