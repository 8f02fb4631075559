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

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._ds_config import (
    complete_batch_sizes,
    load_ds_config,
    merge_ds_config,
    user_bucket_elements,
    with_derived_buckets,
    zero_stage_of,
)
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, WrapperOrder, register
from atorch.modules.pipeline.batches import batch_rows, hf_batch_fn, split_micro_batches
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
from atorch.utils.tp_presets import gpt2_tpinfo, llama_tpinfo, tpinfo_for_model

__all__ = ["DeepSpeed3DParallelConfig", "DeepSpeed3DParallelOptimization", "get_custom_patcher",
           "get_gpt2_custom_patcher", "get_gpt2_tpinfo", "get_llama_custom_patcher", "get_llama_tpinfo",
           "get_tpinfo", "resolve_ds_config"]

# atorch's dims for DeepSpeed 3D, fastest first: DeepSpeed's (model, data, pipe) order.
SUPPORTED_ORDER = ("tensor", "data", "pipeline")


@dataclass
class DeepSpeed3DParallelConfig:
    """Options of `deepspeed_3d_parallel`; every field may be left at its default for Llama and GPT2."""

    base_seed: int = 1234
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
    """DeepSpeed config dict or JSON path. Batch keys may be partial (DeepSpeed's rule fills the rest);
    `gradient_clipping` defaults to 0 (no clipping, as in plain training) when absent, unlike DeepSpeed's 1.0."""

    batch_fn: Optional[Callable[[Any], Any]] = None
    """Turns a dataloader item into `((inputs...), labels)`; None: Hugging Face dicts (input_ids, labels,
    optional attention_mask) are accepted."""


WHO = "deepspeed_3d_parallel"


def resolve_ds_config(raw: Any, data_size: int, pipeline_size: int) -> Dict[str, Any]:
    """The DeepSpeed config to run with: batch sizes completed and checked, strategy contradictions refused.

    Pure. Raises ValueError naming the values when the config contradicts the parallel layout.
    Reading, batch completion and merging are shared with the ZeRO engines (`_ds_config`).
    """
    cfg = load_ds_config(WHO, raw)
    stage = zero_stage_of(cfg)
    if not isinstance(stage, int) or stage >= 2:
        raise ValueError(f"{WHO}: ds_config zero_optimization.stage={stage!r} contradicts pipeline "
                         "parallelism (DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only)")
    stages = (cfg.get("pipeline") or {}).get("stages", "auto")
    if stages not in ("auto", pipeline_size):
        raise ValueError(f"{WHO}: ds_config pipeline.stages={stages!r} but parallel_mode has "
                         f"pipeline={pipeline_size}")
    complete_batch_sizes(WHO, cfg, data_size)
    user_bucket_elements(cfg)     # a bucket size that is not a count of elements raises here
    # DeepSpeed clips at 1.0 by default; atorch's contract is the training of the plain loop.
    return merge_ds_config({"gradient_clipping": 0.0}, cfg)


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
    # itself; these are the optimizations that apply before it to the recorded model.
    allowed_partners = frozenset({"parallel_mode", "checkpoint", "module_replace", "lora"})
    distributed_only = False  # one process is a valid (1, 1, 1) layout, handy for debugging
    Config = DeepSpeed3DParallelConfig
    search_dimension = None   # driven by the user's ds_config (batch split, precision, ZeRO stage)

    def __init__(self) -> None:
        self._ds_config: Dict[str, Any] = {}   # resolved in apply, used to build the engine in apply_wrapper

    @classmethod
    def syncs_gradients(cls, config: DeepSpeed3DParallelConfig) -> bool:
        return True

    @classmethod
    def cost_traits(cls, config: DeepSpeed3DParallelConfig, context: CostContext) -> Dict[str, Any]:
        # DeepSpeed's pipeline engine (ZeRO 0 or 1 over "data"), tensor parallel inside each stage,
        # the micro-batch and accumulation steps of the resolved ds_config.
        d, p = context.dims.get("data", 1), context.dims.get("pipeline", 1)
        ds = resolve_ds_config(config.ds_config, d, p)
        half = bool((ds.get("bf16") or {}).get("enabled")) or bool((ds.get("fp16") or {}).get("enabled"))
        gas = ds["gradient_accumulation_steps"]
        stage = (ds.get("zero_optimization") or {}).get("stage", 0)
        out: Dict[str, Any] = {"sharding": "deepspeed", "zero_stage": stage,
                               "pipeline_engine": "deepspeed", "tensor_parallel": True, "ddp_wrap": False,
                               "accumulation_steps": gas, "pipeline_chunks": gas, "pipeline_schedule": "1f1b",
                               "ds_bucket_elements": user_bucket_elements(ds) or 0}
        if half:
            out["compute_dtype_bytes"] = 2
        return out

    def validate(self, config: DeepSpeed3DParallelConfig, context: ValidationContext) -> None:
        _check_fields(config)
        pm = context.configs.get("parallel_mode")
        if pm is not None and pm.rank_order is not None:
            raise ValueError(f"deepspeed_3d_parallel needs rank_order None (DeepSpeed derives ranks from the layout), "
                             f"got {list(pm.rank_order)}")
        t, d, p = _layout_sizes(context.parallel_sizes(), context.world_size)
        resolve_ds_config(config.ds_config, d, p)
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
        ds_config = resolve_ds_config(config.ds_config, d, p)
        global_batch = ctx.dataloader_args.get("batch_size")
        if global_batch is not None and global_batch != ds_config["train_batch_size"]:
            raise ValueError(f"deepspeed_3d_parallel: dataloader_args batch_size={global_batch} (global) differs from "
                             f"ds_config train_batch_size={ds_config['train_batch_size']}; give one of them")
        if ctx.optim_func is not None and "optimizer" in ds_config:
            raise ValueError("deepspeed_3d_parallel: both optim_func and ds_config['optimizer'] are given; pass one")
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
        _mark_tensor_parallel_params(ctx.model)
        # The pipeline engine places the stages and reduces gradients: no DDP, no _place_model.
        ctx.is_sharded = True
        ctx.dataloader_args["batch_size"] = ds_config["train_batch_size"]
        self._ds_config = ds_config

    def apply_wrapper(self, ctx: ModelContext, config: DeepSpeed3DParallelConfig) -> None:
        import deepspeed

        # ZeRO-1 over "data": its buckets sized from this stage's trainable elements (the user's
        # sizes win), as for the ZeRO engines; DeepSpeed's default is 5e8 elements whatever the model.
        ds_config = with_derived_buckets(self._ds_config, sum(q.numel() for q in ctx.model.parameters()
                                                                  if q.requires_grad))
        if ctx.optim is None and "optimizer" not in ds_config:
            raise ValueError("deepspeed_3d_parallel needs an optimizer: pass optim_func or ds_config['optimizer']")
        if ctx.lr_scheduler is None and ctx.lr_scheduler_cls is not None and ctx.optim is not None:
            # Built here so the engine steps it at each optimizer step.
            ctx.lr_scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
        params = [q for q in ctx.model.parameters() if q.requires_grad] if ctx.optim is None else None
        engine, optim, _, scheduler = deepspeed.initialize(model=ctx.model, optimizer=ctx.optim,
                                                           model_parameters=params, lr_scheduler=ctx.lr_scheduler,
                                                           config=ds_config, dist_init_required=False)
        engine.set_batch_fn(config.batch_fn or hf_batch_fn)
        ctx.engine, ctx.optim, ctx.lr_scheduler = engine, optim, scheduler
        if ctx.dataset is not None and ctx.dataloader is None:
            ctx.dataloader, ctx.sampler = _micro_batch_loader(ctx, ds_config["train_micro_batch_size_per_gpu"])
        ctx.deepspeed_config = ds_config
        ctx.custom_train_step = ds3d_train_step
        ctx.gradient_accumulation_steps = ds_config["gradient_accumulation_steps"]
        ctx.micro_batch_size = ds_config["train_micro_batch_size_per_gpu"]


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


def _mark_tensor_parallel_params(module: nn.Module) -> None:
    """Tag tensor-parallel shards the way DeepSpeed recognizes model-parallel parameters.

    DeepSpeed's gradient-norm (clipping) counts a parameter on every model-parallel rank only
    when it carries this attribute, and replicated ones on model-parallel rank 0 only.
    """
    from atorch.modules.distributed_modules.layers import TensorParallelModule

    for sub in module.modules():
        if isinstance(sub, TensorParallelModule) and sub.tp_size > 1:
            for name in sub.shard_specs():
                setattr(getattr(sub, name), "tensor_model_parallel", True)


def _micro_batch_loader(ctx: ModelContext, micro: int) -> Tuple[Any, Any]:
    """The dataloader of `auto_accelerate`, yielding micro-batches (`engine.train_batch` pulls gas of them)."""
    from atorch.auto.engine import build_dataloader

    return build_dataloader(ctx, global_batch=micro * ctx.data_parallel_size())


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
        rows = batch_rows(batch)
        if rows != micro * gas:
            raise ValueError(f"deepspeed_3d_parallel train_step: a batch of {rows} rows, but one step takes "
                             f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} = "
                             f"{micro * gas} rows per data rank; or call engine.train_batch(iter(result.dataloader)),"
                             " whose items are micro-batches")
        micro_batches = split_micro_batches(batch, gas)
    else:
        raise ValueError(f"deepspeed_3d_parallel train_step: batch must be a dict or a list of {gas} micro-batch dicts")
    return engine.train_batch(iter(micro_batches))


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
