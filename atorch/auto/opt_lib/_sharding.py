"""Sharding machinery shared by `fsdp`, `zero1` and `zero2`: torch FSDP2 and DeepSpeed ZeRO engines
(and the `wrap_cls` parser, which `checkpoint` and `compile` use too).

Not an optimization (it registers nothing); the registry imports it like every module here,
so DeepSpeed is imported only inside the functions that build an engine.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._ds_config import (
    DsConfigSpec,
    check_one_scheduler,
    half_dtype,
    load_ds_config,
    normalize_ds_config,
    offload_devices,
    user_bucket_elements,
    user_stage3_elements,
    zero_ds_config,
)
from atorch.auto.opt_lib._flat_partitions import check_flat_partition_optimizer
from atorch.auto.opt_lib._precision import cast_float_inputs, dtype_name
from atorch.distributed.mesh import ParallelMesh
from atorch.distributed.process_group import forget_library_model_parallel
from atorch.distributed.replicas import check_layouts_agree, check_replicas_agree
from atorch.auto.opt_lib.base import (ConfigAlias, CostContext, Optimization, Order, ValidationContext, WrapperOrder,
                                      is_false, is_true, short_value, shown_fields)
from atorch.utils.module_utils import modules_of_classes, resolve_module_classes

logger = logging.getLogger(__name__)

ClassSpec = Union[Type[nn.Module], str]


# -- config checks shared by the sharding configs ------------------------------------------
def check_bool(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} must be True or False")


def normalize_wrap_cls(where: str, value: Any) -> Optional[Tuple[ClassSpec, ...]]:
    """A `wrap_cls` field (fsdp, zero2, checkpoint, compile): None, one class / class name, or a
    non-empty list, tuple or set of them -> a tuple (hashable, JSON-friendly); anything else raises
    ValueError naming `where` and the offending value."""
    if value is None:
        return None
    entries = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(entries, (list, tuple, set, frozenset)) or not entries:
        raise ValueError(f"{where}: wrap_cls={value!r} must be None (auto-detect the transformer block) or a "
                         "non-empty list of nn.Module classes or class names")
    for entry in entries:
        if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
            raise ValueError(f"{where}: wrap_cls entry {entry!r} must be an nn.Module subclass or a class name")
    if isinstance(entries, (set, frozenset)):  # ATorch's configs use sets; a sorted tuple is deterministic
        return tuple(sorted(entries, key=lambda c: c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}"))
    return tuple(entries)


def zero_memory_saving(stage: int, use_ds_zero: bool, cpu_offload: bool = False) -> Dict[str, float]:
    """`Optimization.memory_saving` of the ZeRO stages: deeper stages save more within one backend;
    torch's and DeepSpeed's are not compared (DeepSpeed's bf16 mode keeps no fp32 module, torch's
    amp does), nor is CPU offload with a deeper stage (zero2 offloaded may need less than fsdp)."""
    saving = {"deepspeed_zero_stage" if use_ds_zero else "torch_zero_stage": float(stage)}
    if cpu_offload:
        saving["cpu_offload"] = 1.0
    return saving


def require_data_dim(name: str, what: str, context: ValidationContext) -> None:
    """Refuse, at validation, a torch ZeRO (`name` shards `what`) under a layout without a "data" dimension:
    the shards live on the "data" group, which the apply phase would only find missing after the
    optimizations before it (tensor_parallel, pipeline_parallel) had been applied."""
    sizes = context.parallel_sizes()
    if "data" in sizes:
        return
    layout = list(sizes.items())
    raise ValueError(
        f"{name}: shards {what} over the 'data' parallel dimension, but parallel_mode's layout {layout} has no "
        f"'data' dimension; add one, e.g. {layout + [('data', 1)]} (over one data rank it shards nothing; launch "
        f"more processes for ('data', N) with N > 1), or drop {name} from the strategy")


def over_one_data_rank(context: ValidationContext) -> bool:
    """Whether the strategy's layout has a single data-parallel rank, over which ZeRO shards nothing."""
    return context.parallel_sizes().get("data", 1) == 1


def deepspeed_changes_nothing(stage: int, ds_config: DsConfigSpec, context: ValidationContext) -> Optional[str]:
    """`changes_nothing` of a DeepSpeed ZeRO engine (zero1, zero2, fsdp with use_ds_zero=True).

    Over one data rank it partitions nothing, and without amp_native its fp32 engine steps the
    user's optimizer as the plain loop does (measured: the same losses, 13 ms plain against 16 to
    37 ms per step); it only adds its buffers and hooks. With amp_native it does differ (a bf16/fp16
    module with fp32 master weights), and a user's ds_config may offload or change training, so
    those stay."""
    if ds_config is not None or "amp_native" in context.configs or not over_one_data_rank(context):
        return None
    return f"DeepSpeed ZeRO stage {stage} over a data-parallel group of 1 rank, without mixed precision or a " \
           "ds_config, trains as without it"


# -- torch FSDP2 ----------------------------------------------------------------------------
def broadcast_module_states(model: nn.Module, device: torch.device, parallel: ParallelMesh, who: str) -> None:
    """Make every data-parallel rank hold data-rank 0's parameters and buffers. Models of different
    layouts are refused on every rank first: their broadcasts would not match in size (a hang, or
    gloo aborting the process)."""
    group = parallel.group("data")
    src = parallel.group_ranks("data")[0]
    check_layouts_agree(model, group, None, who)
    if device.type != "cpu":
        model.to(device)  # nccl broadcasts device tensors only
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


FSDP_REMEDY = ("each rank keeps its own shard of its own model, so every rank must build the same one: set the "
               "same seed before building it on every rank, or pass sync_module_states=True to broadcast data-rank "
               "0's weights first")

MAX_DIM0_PADDING = 0.1
"""FSDP2 shards a parameter along another dimension when dim 0 would pad more than this fraction of it."""


def padded_elements(shape: Sequence[int], dim: int, ranks: int) -> int:
    """Elements of padding when a tensor of `shape` is split evenly over `ranks` along `dim` (FSDP2's cut)."""
    rows = shape[dim]
    per_row = 1
    for i, size in enumerate(shape):
        if i != dim:
            per_row *= size
    return (-(-rows // ranks) * ranks - rows) * per_row


def least_padded_placement(ranks: int) -> Callable[[nn.Parameter], Optional[Any]]:
    """FSDP2's `shard_placement_fn`: shard each parameter along the dimension that pads least.

    FSDP2 splits along dim 0 and pads it to a multiple of the data size, on every rank and in
    every all-gather buffer. A mixture of experts keeps its experts as one [experts, ...] tensor
    (and its router as [experts, hidden]): with more data ranks than experts, dim 0 padded to
    the data size held each rank a whole expert (1/experts of the tensor, not 1/ranks) and
    gathered a buffer ranks/experts times the tensor (measured on a fake 64-rank Mixtral:
    per-rank model states 6.6x, peak 5x the even split). Dim 0 (FSDP2's default: None) stays
    unless it pads more than `MAX_DIM0_PADDING` of the tensor and another dimension splits evenly
    (FSDP2 refuses uneven shards on any other dimension): a shard along another dimension costs
    a copy after each all-gather, not worth a vocabulary's few padded rows.
    """
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter) -> Optional[Any]:
        dim = shard_dim(tuple(param.shape), ranks)
        return None if dim == 0 else Shard(dim)

    return placement


def shard_dim(shape: Sequence[int], ranks: int) -> int:
    """The dimension `least_padded_placement` splits a tensor of `shape` along over `ranks`."""
    if len(shape) < 2 or padded_elements(shape, 0, ranks) <= MAX_DIM0_PADDING * math.prod(shape):
        return 0
    # FSDP2 pads dim 0 only: another dimension must split evenly (the widest such one).
    even = [dim for dim in range(1, len(shape)) if shape[dim] % ranks == 0]
    return max(even, key=lambda dim: (shape[dim], -dim)) if even else 0


def shard_elements(shape: Sequence[int], ranks: int) -> int:
    """Elements every rank holds of a tensor of `shape` under `least_padded_placement` (padding included: FSDP2
    pads each shard to ceil(dim / ranks) rows of the dimension it splits)."""
    if not shape:
        return 1
    dim = shard_dim(shape, ranks)
    return (math.prod(shape) + padded_elements(shape, dim, ranks)) // ranks


def check_no_parameter_spans_blocks(model: nn.Module, blocks: Sequence[nn.Module], who: str) -> None:
    """ValueError naming a parameter that two of `blocks` share (ALBERT-style weight sharing across layers),
    neither inside the other: FSDP2 makes each block a unit of its own, and the second `fully_shard` of the
    parameter failed deep in torch ("Cannot concatenate overlapping meshes")."""
    owner: Dict[int, nn.Module] = {}
    for block in blocks:
        for p in block.parameters():
            first = owner.setdefault(id(p), block)
            if first is block or any(m is block for m in first.modules()) or any(m is first for m in block.modules()):
                continue
            # Names only for the message: the first name a shared parameter is reached by.
            names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
            name = next(n for n, q in model.named_parameters(remove_duplicate=False) if q is p)
            raise ValueError(
                f"{who}: parameter {name!r} is shared by {names.get(id(first))!r} and "
                f"{names.get(id(block))!r}; FSDP2 shards each block as a unit of its own and cannot shard one "
                "parameter in two. Use ddp, zero1, or use_ds_zero=True (DeepSpeed ZeRO), or pass wrap_cls naming a "
                "module that holds every block sharing it")
    _check_no_block_shares_with_the_root(model, blocks, who)


def _check_no_block_shares_with_the_root(model: nn.Module, blocks: Sequence[nn.Module], who: str) -> None:
    """ValueError naming a parameter that one of `blocks` shares with a module outside every block (a tied
    embedding and head where the embedding is a block: the root unit holds the head). torch's own error came
    from inside the root's `fully_shard`, after the blocks were sharded ("shared with a parameter already
    managed by another FSDP group")."""
    inside = {id(m) for block in blocks for m in block.modules()}
    outside = {id(p): n for n, m in model.named_modules() if id(m) not in inside
               for p in m.parameters(recurse=False)}
    if not outside:
        return
    for block in blocks:
        for name, p in block.named_parameters():
            if id(p) in outside:
                block_name = next(n for n, m in model.named_modules() if m is block)
                raise ValueError(
                    f"{who}: parameter {block_name + '.' + name!r} of the wrapped block {block_name!r} "
                    f"({type(block).__name__}) is also used by {outside[id(p)] or type(model).__name__!r}, outside "
                    "every wrapped block (a tied embedding and head?); FSDP2 cannot shard one parameter in two units. "
                    f"Pass wrap_cls without {type(block).__name__}, or use ddp, zero1 or use_ds_zero=True")


def shard_with_fsdp2(ctx: ModelContext, who: str, *, wrap_cls: Optional[Sequence[ClassSpec]],
                     reshard_after_forward: bool, cpu_offload: bool, sync_module_states: bool) -> Dict[str, Any]:
    """`fully_shard` each transformer block, then the root, over the "data" mesh.

    One FSDP unit per block bounds the all-gathered (unsharded) parameters to one block at
    a time; the root unit holds the rest (embeddings, final norm, head). An autocast dtype
    set by amp_native becomes `MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32)`:
    compute in half precision, gradients reduced and stored in fp32 next to fp32 shards.
    Returns a summary for `result.summaries`.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = ctx.model
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{who}: the model has parameters on the meta device; materialize it first (e.g. with "
                         "tensor_parallel) or build it on a real device")
    parallel = ctx.require_parallel(who)
    classes = resolve_module_classes(model, wrap_cls, f"{who}: wrap_cls")
    blocks = modules_of_classes(model, classes)
    check_no_parameter_spans_blocks(model, blocks, who)   # the same on every rank, before any collective
    if sync_module_states:
        broadcast_module_states(model, ctx.device, parallel, who)
    else:
        # Each rank keeps its own slice of its own model: replicas built differently would train a model
        # stitched from different ranks' weights (or, of different shapes, hang in the first reduce-scatter).
        check_replicas_agree(model, parallel.group("data"), None, who, FSDP_REMEDY)
    kwargs: Dict[str, Any] = {"mesh": parallel.device_mesh("data")}
    if ctx.autocast_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=ctx.autocast_dtype, reduce_dtype=torch.float32)
        ctx.autocast_by_wrapper = True
    if parallel.size_or_one("tensor") == 1:
        # Under tensor parallelism the slices stay Shard(0) over "data": the checkpoint's 2-D layout reads them so.
        kwargs["shard_placement_fn"] = least_padded_placement(parallel.size_or_one("data"))
    if cpu_offload:
        # Pinned host memory only helps (and only exists) with a GPU on the other side.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    if not blocks:
        logger.warning("%s: no transformer block found (pass wrap_cls); the whole model is one FSDP unit, so its "
                       "parameters are all-gathered at once", who)
    wrapped = sorted({type(b).__name__ for b in blocks})   # before fully_shard renames them (FSDPLlamaDecoderLayer)
    # Children first: a nested block must own its parameters before an enclosing unit is made.
    for block in reversed(blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root stays gathered after forward whatever the blocks do: backward starts with it
    # (the LM head), so resharding it would only add an all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    ctx.is_sharded = True
    return {"backend": "torch_fsdp2", "wrapped_classes": wrapped,
            "units": len(blocks) + 1, "reshard_after_forward": reshard_after_forward,
            "mixed_precision": dtype_name(ctx.autocast_dtype) if ctx.autocast_dtype is not None else None,
            "cpu_offload": cpu_offload}


# -- DeepSpeed ZeRO -------------------------------------------------------------------------
def deepspeed_installed() -> bool:
    """Whether DeepSpeed can be imported (found without importing it: that takes seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


def check_ds_config_field(who: str, ds_config: Any, use_ds_zero: bool) -> DsConfigSpec:
    """A Config's `ds_config` in its kept form; refused without use_ds_zero (torch has no use for it)."""
    spec = normalize_ds_config(who, ds_config)
    if spec is not None and not use_ds_zero:
        raise ValueError(f"{who}: ds_config is DeepSpeed's config and applies with use_ds_zero=True only; add "
                         "'use_ds_zero': True or drop ds_config")
    return spec


def validate_deepspeed(who: str, context: ValidationContext, stage: int, ds_config: DsConfigSpec = None,
                       cpu_offload: bool = False, wrap_cls: Optional[Sequence[ClassSpec]] = None) -> None:
    """What DeepSpeed ZeRO here cannot do, and a `ds_config` that contradicts the strategy,
    raised before any process group work."""
    if wrap_cls is not None:
        raise ValueError(f"{who}: wrap_cls={list(wrap_cls)!r} applies to torch FSDP2 only; with use_ds_zero=True "
                         "DeepSpeed partitions the parameters itself, so leave wrap_cls unset")
    sizes = context.parallel_sizes()
    others = {n: s for n, s in sizes.items() if n != "data" and s > 1}
    if others:
        raise ValueError(f"{who} with use_ds_zero=True needs every rank data-parallel, but parallel_mode has "
                         f"{others}; use the torch implementation (use_ds_zero=False) with other parallel dims")
    if cpu_offload:
        raise ValueError(f"{who}: cpu_offload=True with use_ds_zero=True is not what offloads DeepSpeed; put "
                         "{'zero_optimization': {'offload_optimizer': {'device': 'cpu'}}} in ds_config (and "
                         "'offload_param' for fsdp), or use use_ds_zero=False for torch FSDP2 CPU offload")
    amp = context.configs.get("amp_native")
    amp_dtype = amp.dtype if amp is not None else None
    if amp_dtype is torch.float16 and context.device_type == "cpu":
        raise ValueError(f"amp_native(dtype=float16) with {who} (use_ds_zero=True) is not supported on CPU: "
                         "DeepSpeed's CPU accelerator has no fp16; use dtype=torch.bfloat16")
    accumulation = context.configs.get("gradient_accumulation")
    zero_ds_config(who, ds_config, stage=stage, data_size=sizes.get("data", context.world_size),
                   global_batch=context.global_batch_size,
                   accumulation_steps=accumulation.steps if accumulation is not None else 1, autocast_dtype=amp_dtype)


def deepspeed_cost_traits(stage: int, ds_config: DsConfigSpec) -> Dict[str, Any]:
    """The cost model's view of a ZeRO engine: what its offload options move to the host (the
    optimizer side and the parameter partitions separately), and the user's reduce bucket."""
    user = load_ds_config("cost model", ds_config)
    optimizer_device, param_device = offload_devices(user)
    persistence, prefetch = user_stage3_elements(user)
    return {"sharding": "deepspeed", "zero_stage": stage, "ddp_wrap": False,
            "ds_offload_optimizer": optimizer_device != "none", "ds_offload_params": param_device != "none",
            "ds_bucket_elements": user_bucket_elements(user) or 0,
            "ds_persistence_elements": persistence, "ds_prefetch_elements": prefetch}


def describe_sharding(cls: Any, config: Any, stage: int) -> str:
    """'deepspeed stage N' for a DeepSpeed engine, then the other non-default settings."""
    fields = shown_fields(cls, config)
    parts = [f"deepspeed stage {stage}"] if fields.pop("use_ds_zero", False) else []
    spec = fields.pop("ds_config", None)
    if isinstance(spec, str):
        parts.append(f"ds_config={os.path.basename(spec)}")
    elif spec is not None:   # what the user changed that matters most to a reader: offload
        optimizer_device, param_device = offload_devices(spec)
        parts.append("ds_config")
        parts += [f"offload_{what}={device}" for what, device in (("optimizer", optimizer_device),
                                                                  ("param", param_device)) if device != "none"]
    return ",".join(parts + [f"{k}={short_value(v)}" for k, v in fields.items()])


# Partners a DeepSpeed ZeRO engine (use_ds_zero=True) cannot be combined with, and why.
DEEPSPEED_CONFLICTS: Dict[str, str] = {
    "half": "DeepSpeed keeps fp32 master weights and sets the parameter dtype itself (use_ds_zero=True); use "
            "amp_native instead of half",
    "ddp": "the DeepSpeed engine (use_ds_zero=True) averages gradients itself",
}


def prepare_deepspeed(ctx: ModelContext, who: str, ds_config: DsConfigSpec) -> None:
    """Apply phase: check who builds the optimizer, claim gradient sync and precision before the
    optimizer and wrappers run."""
    user = load_ds_config(who, ds_config)
    check_one_scheduler(who, user, ctx.lr_scheduler_cls)
    if "optimizer" in user:
        if ctx.optim_func is not None:
            raise ValueError(f"{who}: both optim_func and ds_config['optimizer'] are given; pass one (DeepSpeed "
                             "builds the optimizer of ds_config, e.g. its CPU Adam when offloading)")
    elif ctx.optim_func is None:
        raise ValueError(f"{who} with use_ds_zero=True needs optim_func or ds_config['optimizer']: DeepSpeed ZeRO "
                         "shards the optimizer")
    elif offload_devices(user)[0] != "none" and not _is_deepspeed_cpu_adam(ctx.optim_func):
        raise ValueError(f"{who}: ds_config offloads the optimizer, which runs DeepSpeed's CPU Adam; optim_func="
                         f"{getattr(ctx.optim_func, '__name__', ctx.optim_func)!r} is not it. Pass optim_func="
                         "deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode=True is AdamW), or drop optim_func and "
                         "put {'optimizer': {'type': 'AdamW', 'params': {...}}} in ds_config")
    # The engine broadcasts rank 0's weights when it is built: models of different layouts would abort there.
    # Every rank is a data rank here (validate_deepspeed), so the check runs over the default group.
    check_layouts_agree(ctx.model, None, None, who)
    ctx.is_sharded = True                # no DDP: the engine reduces gradients
    ctx.autocast_by_wrapper = ctx.autocast_dtype is not None
    ctx.loss_scaling_by_wrapper = True   # DeepSpeed's fp16 has its own loss scaler


def _is_deepspeed_cpu_adam(factory: Any) -> bool:
    """Whether an optim_func builds DeepSpeed's CPU Adam (by class name: importing DeepSpeed takes seconds)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return isinstance(factory, type) and any(c.__name__ == "DeepSpeedCPUAdam" for c in factory.__mro__)


def deepspeed_config(ctx: ModelContext, who: str, stage: int, ds_config: DsConfigSpec) -> Dict[str, Any]:
    """The engine's config: atorch's derived keys with the user's `ds_config` merged over them (checked)."""
    global_batch = ctx.dataloader_args.get("batch_size")
    # train_step sets the accumulation boundary itself; the batch keys keep DeepSpeed's bookkeeping true.
    trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
    return zero_ds_config(who, ds_config, stage=stage, data_size=ctx.data_parallel_size(),
                          global_batch=int(global_batch) if global_batch else None,
                          accumulation_steps=ctx.gradient_accumulation_steps, autocast_dtype=ctx.autocast_dtype,
                          trainable_elements=trainable)


def check_adagrad_groups(who: str, optim: torch.optim.Optimizer) -> None:
    """Refuse a torch Adagrad that DeepSpeed ZeRO cannot rebuild as given.

    ZeRO (stages 1 to 3) builds a new `torch.optim.Adagrad(flat partitions, **optim.defaults)`: one
    parameter group from the constructor's defaults. Several groups fail at the first step (IndexError
    inside DeepSpeed, which steps one group per partition); a single group's own hyperparameters
    (`optim_param_func` giving it another lr or weight_decay) would be dropped silently.
    """
    groups = optim.param_groups
    differ = sorted(k for k in optim.defaults if any(g.get(k, optim.defaults[k]) != optim.defaults[k] for g in groups))
    if len(groups) > 1 or differ:
        what = f"{len(groups)} parameter groups" if len(groups) > 1 else f"a parameter group with its own {differ}"
        raise ValueError(
            f"{who} with use_ds_zero=True and torch.optim.Adagrad given {what}: DeepSpeed ZeRO rebuilds Adagrad "
            "over its flat partitions as one group from the constructor's arguments, so per-group settings "
            "cannot be kept (several groups fail inside DeepSpeed at the first step). Pass the settings to "
            "Adagrad itself (optim_args) with no optim_param_func, use another optimizer (e.g. AdamW), or use "
            "the torch implementation (use_ds_zero=False)")


def build_deepspeed_engine(ctx: ModelContext, who: str, stage: int, ds_config: DsConfigSpec = None) -> Dict[str, Any]:
    """Wrapper phase: a DeepSpeed engine over the model and the user's optimizer (ZeRO `stage`).

    DeepSpeed reuses the process group atorch already created (dist_init_required=False). An
    LR scheduler is built here, on the user's optimizer, and handed to the engine, because
    `engine.step()` is what steps it; built again on the optimizer ZeRO rebuilds (torch Adagrad,
    see `check_adagrad_groups`). With `optimizer` in ds_config, DeepSpeed builds the
    optimizer itself over the trainable parameters.
    """
    import deepspeed  # heavy; only when an engine is asked for

    config = deepspeed_config(ctx, who, stage, ds_config)
    user_optim = ctx.optim
    if user_optim is not None:
        # The same on every rank: raised before DeepSpeed's collectives.
        check_flat_partition_optimizer(who, user_optim)
    if isinstance(user_optim, torch.optim.Adagrad):
        check_adagrad_groups(who, user_optim)
    scheduler = None
    if ctx.lr_scheduler_cls is not None and ctx.optim is not None:
        scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
    params = [p for p in ctx.model.parameters() if p.requires_grad] if ctx.optim is None else None
    # Every rank is a data rank here (validate_deepspeed): no pipeline grid an earlier DeepSpeed 3D engine of
    # this process left in DeepSpeed's globals may stand for this engine's groups.
    forget_library_model_parallel()
    engine, optim, _, scheduler = deepspeed.initialize(model=ctx.model, optimizer=ctx.optim, model_parameters=params,
                                                       lr_scheduler=scheduler, config=config,
                                                       dist_init_required=False)
    inner = getattr(optim, "optimizer", None)
    if scheduler is not None and ctx.lr_scheduler_cls is not None and user_optim is not None \
            and isinstance(inner, torch.optim.Optimizer) and inner is not user_optim:
        # ZeRO rebuilt the optimizer over its flat partitions (torch Adagrad, whose state is made at
        # construction): the scheduler built above would drive the user's orphaned optimizer, so the
        # learning rate DeepSpeed steps with would never change. Build it again on the one that steps.
        scheduler = ctx.lr_scheduler_cls(inner, **ctx.lr_scheduler_args)
        engine.lr_scheduler = scheduler
    ctx.engine = engine
    ctx.optim = optim
    ctx.lr_scheduler = scheduler
    ctx.deepspeed_config = config
    half = half_dtype(config)
    if half is not None:
        cast_float_inputs(engine.module, half)   # DeepSpeed holds the module itself in `half`
    optimizer_device, param_device = offload_devices(config)
    return {"backend": "deepspeed", "zero_stage": stage,
            "mixed_precision": dtype_name(ctx.autocast_dtype) if ctx.autocast_dtype is not None else None,
            "offload_optimizer": optimizer_device, "offload_param": param_device}



# -- fsdp and zero2: FSDP2 with or without resharding after forward, or DeepSpeed ZeRO ------
@dataclass(frozen=True)
class Fsdp2ShardingConfig:
    """Options shared by `fsdp` and `zero2`; `_owner` names the optimization in errors."""

    _owner: ClassVar[str] = ""
    wrap_cls: Optional[Tuple[ClassSpec, ...]] = None
    """Sharding unit classes (or class names); None: the model's transformer block, auto-detected (torch only)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (torch only)."""
    sync_module_states: bool = False
    """Broadcast data-rank 0's weights before sharding, for models initialized differently per rank
    (DeepSpeed always does)."""
    use_ds_zero: bool = False
    """Use a DeepSpeed ZeRO engine instead of torch FSDP2 (then wrap_cls and cpu_offload must stay unset)."""
    ds_config: DsConfigSpec = None
    """DeepSpeed's config (dict or JSON path), merged over what atorch derives (use_ds_zero only): offload,
    bucket sizes, overlap... Batch keys, ZeRO stage and bf16/fp16 may repeat the strategy's but not contradict it."""

    def __post_init__(self) -> None:
        for key in ("cpu_offload", "sync_module_states", "use_ds_zero"):
            check_bool(self._owner, key, getattr(self, key))
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls(self._owner, self.wrap_cls))
        object.__setattr__(self, "ds_config", check_ds_config_field(self._owner, self.ds_config, self.use_ds_zero))


# ATorch's FSDP1 options for fsdp/zero2 (fsdp_config dicts of its strategies).
FSDP_CONFIG_ALIASES: Dict[str, ConfigAlias] = {
    "atorch_wrap_cls": ConfigAlias(to="wrap_cls"),
    "use_orig_params": ConfigAlias(accepts=is_true, instead="FSDP2 always keeps the original parameters (as "
                                   "use_orig_params=True); drop the key"),
    "limit_all_gathers": ConfigAlias(accepts=is_true, instead="FSDP2 always bounds the all-gathers in flight to the "
                                     "next unit (as limit_all_gathers=True); drop the key"),
    "forward_prefetch": ConfigAlias(accepts=is_false, instead="FSDP2 prefetches the next unit's all-gather in "
                                    "backward only by default; drop the key (explicit prefetching is "
                                    "FSDPModule.set_modules_to_forward_prefetch on the result's blocks)"),
    "auto_wrap_policy": ConfigAlias(instead="FSDP2 shards per module class, not with an FSDP1 wrap policy; pass "
                                    "wrap_cls (or atorch_wrap_cls) with the transformer block classes"),
}


class Fsdp2ShardingOptimization(Optimization):
    """`fsdp` and `zero2` differ only in these two class attributes (and their name/conflicts)."""

    order = Order.SHARDING
    wrapper_order = WrapperOrder.ENGINE   # builds the DeepSpeed engine when use_ds_zero=True

    config_aliases = FSDP_CONFIG_ALIASES
    reshard_after_forward: ClassVar[bool]
    deepspeed_stage: ClassVar[int]
    shards: ClassVar[str]          # what it shards over the data ranks, for `require_data_dim`'s message

    @classmethod
    def config_conflicts(cls, config: Fsdp2ShardingConfig) -> Dict[str, str]:
        return dict(DEEPSPEED_CONFLICTS) if config.use_ds_zero else {}

    @classmethod
    def changes_nothing(cls, config: Fsdp2ShardingConfig, context: ValidationContext) -> Optional[str]:
        if config.use_ds_zero:
            return deepspeed_changes_nothing(cls.deepspeed_stage, config.ds_config, context)
        # Over one data rank FSDP2 shards nothing; it can only add its all-gather copies. Not with
        # amp_native (FSDP2's mixed precision then replaces autocast: other numerics) or CPU offload
        # (memory moves to the host).
        if config.cpu_offload or "amp_native" in context.configs:
            return None
        if over_one_data_rank(context):
            return "torch FSDP2 over a data-parallel group of 1 rank, without mixed precision or offload, trains as " \
                   "without it"
        return None

    @classmethod
    def wraps(cls, config: Fsdp2ShardingConfig) -> bool:
        return config.use_ds_zero

    @classmethod
    def memory_saving(cls, config: Fsdp2ShardingConfig) -> Dict[str, float]:
        return zero_memory_saving(cls.deepspeed_stage, config.use_ds_zero, config.cpu_offload)

    @classmethod
    def syncs_gradients(cls, config: Fsdp2ShardingConfig) -> bool:
        return True

    @classmethod
    def describe_config(cls, config: Fsdp2ShardingConfig) -> str:
        return describe_sharding(cls, config, cls.deepspeed_stage)

    @classmethod
    def describe_step(cls, config: Fsdp2ShardingConfig) -> str:
        if config.use_ds_zero:
            return f"{cls.name}(deepspeed stage {cls.deepspeed_stage})"
        reshard = "reshard" if cls.reshard_after_forward else "no reshard"
        return f"{cls.name}(torch FSDP2, {reshard}{', cpu offload' if config.cpu_offload else ''})"

    @classmethod
    def cost_traits(cls, config: Fsdp2ShardingConfig, context: CostContext) -> Dict[str, Any]:
        if config.use_ds_zero:
            return deepspeed_cost_traits(cls.deepspeed_stage, config.ds_config)
        return {"sharding": "fsdp2", "zero_stage": 3 if cls.reshard_after_forward else 2,
                "reshard_after_forward": cls.reshard_after_forward, "cpu_offload": config.cpu_offload,
                "ddp_wrap": False}

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """torch FSDP2; with CPU offload where there is a device to offload from; DeepSpeed's stage
        where DeepSpeed is installed."""
        out: List[Any] = [None, cls.name]
        if context.device_type == "cuda":
            out.append((cls.name, {"cpu_offload": True}))
        if deepspeed_installed():
            out.append((cls.name, {"use_ds_zero": True}))
        return out

    def validate(self, config: Fsdp2ShardingConfig, context: ValidationContext) -> None:
        if config.use_ds_zero:    # DeepSpeed's own check refuses any dimension but "data"
            validate_deepspeed(self.name, context, self.deepspeed_stage, config.ds_config,
                               cpu_offload=config.cpu_offload, wrap_cls=config.wrap_cls)
            return
        require_data_dim(self.name, self.shards, context)
        if config.wrap_cls is not None and context.model is not None:
            # A class name the model lacks, named now rather than while applying (after the groups exist).
            resolve_module_classes(context.model, config.wrap_cls, f"{self.name}: wrap_cls")

    def apply(self, ctx: ModelContext, config: Fsdp2ShardingConfig) -> None:
        if config.use_ds_zero:
            # DeepSpeed partitions when the engine is built, after the optimizer exists, and
            # broadcasts rank 0's weights first (every stage): sync_module_states is implied.
            prepare_deepspeed(ctx, self.name, config.ds_config)
            return
        ctx.summaries[self.name] = shard_with_fsdp2(
            ctx, self.name, wrap_cls=config.wrap_cls, reshard_after_forward=self.reshard_after_forward,
            cpu_offload=config.cpu_offload, sync_module_states=config.sync_module_states)

    def apply_wrapper(self, ctx: ModelContext, config: Fsdp2ShardingConfig) -> None:
        if config.use_ds_zero:
            ctx.summaries[self.name] = build_deepspeed_engine(ctx, self.name, self.deepspeed_stage, config.ds_config)
