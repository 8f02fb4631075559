"""Sharding machinery shared by `fsdp`, `zero1` and `zero2`: torch FSDP2 and DeepSpeed ZeRO engines.

Not an optimization (it registers nothing); the registry imports it like every module here,
so DeepSpeed is imported only inside the functions that build an engine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._precision import dtype_name
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, WrapperOrder
from atorch.distributed.mesh import ParallelMesh
from atorch.utils.module_utils import modules_of_classes, resolve_module_classes

logger = logging.getLogger(__name__)

ClassSpec = Union[Type[nn.Module], str]


# -- config checks shared by the sharding configs ------------------------------------------
def check_bool(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} must be True or False")


def normalize_wrap_cls(where: str, value: Any) -> Optional[Tuple[ClassSpec, ...]]:
    """None, one class / class name, or a non-empty list of them -> a tuple (hashable, JSON-friendly)."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: wrap_cls={value!r} must be None (auto-detect the transformer block) or a "
                         "non-empty list of nn.Module classes or class names")
    for entry in value:
        if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
            raise ValueError(f"{where}: wrap_cls entry {entry!r} must be an nn.Module subclass or a class name")
    return tuple(value)


# -- torch FSDP2 ----------------------------------------------------------------------------
def broadcast_module_states(model: nn.Module, device: torch.device, parallel: ParallelMesh) -> None:
    """Make every data-parallel rank hold data-rank 0's parameters and buffers."""
    group = parallel.group("data")
    src = parallel.group_ranks("data")[0]
    if device.type != "cpu":
        model.to(device)  # nccl broadcasts device tensors only
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


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
    if sync_module_states:
        broadcast_module_states(model, ctx.device, parallel)
    kwargs: Dict[str, Any] = {"mesh": parallel.device_mesh("data")}
    if ctx.autocast_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=ctx.autocast_dtype, reduce_dtype=torch.float32)
        ctx.autocast_by_wrapper = True
    if cpu_offload:
        # Pinned host memory only helps (and only exists) with a GPU on the other side.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    classes = resolve_module_classes(model, wrap_cls, f"{who}: wrap_cls")
    blocks = modules_of_classes(model, classes)
    if not blocks:
        logger.warning("%s: no transformer block found (pass wrap_cls); the whole model is one FSDP unit, so its "
                       "parameters are all-gathered at once", who)
    # Children first: a nested block must own its parameters before an enclosing unit is made.
    for block in reversed(blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root stays gathered after forward whatever the blocks do: backward starts with it
    # (the LM head), so resharding it would only add an all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    ctx.is_sharded = True
    return {"backend": "torch_fsdp2", "wrapped_classes": sorted({type(b).__name__ for b in blocks}),
            "units": len(blocks) + 1, "reshard_after_forward": reshard_after_forward,
            "mixed_precision": dtype_name(ctx.autocast_dtype) if ctx.autocast_dtype is not None else None,
            "cpu_offload": cpu_offload}


# -- DeepSpeed ZeRO -------------------------------------------------------------------------
def validate_deepspeed(who: str, context: ValidationContext, cpu_offload: bool = False,
                       wrap_cls: Optional[Sequence[ClassSpec]] = None) -> None:
    """What DeepSpeed ZeRO here cannot do, raised before any process group work."""
    if wrap_cls is not None:
        raise ValueError(f"{who}: wrap_cls={list(wrap_cls)!r} applies to torch FSDP2 only; with use_ds_zero=True "
                         "DeepSpeed partitions the parameters itself, so leave wrap_cls unset")
    sizes = context.parallel_sizes()
    others = {n: s for n, s in sizes.items() if n != "data" and s > 1}
    if others:
        raise ValueError(f"{who} with use_ds_zero=True needs every rank data-parallel, but parallel_mode has "
                         f"{others}; use the torch implementation (use_ds_zero=False) with other parallel dims")
    if cpu_offload:
        raise ValueError(f"{who}: cpu_offload=True with use_ds_zero=True is not supported (DeepSpeed's offload "
                         "needs its own CPU Adam); use use_ds_zero=False for torch FSDP2 CPU offload")
    amp = context.configs.get("amp_native")
    if amp is not None and amp.dtype is torch.float16 and context.device_type == "cpu":
        raise ValueError(f"amp_native(dtype=float16) with {who} (use_ds_zero=True) is not supported on CPU: "
                         "DeepSpeed's CPU accelerator has no fp16; use dtype=torch.bfloat16")


# Partners a DeepSpeed ZeRO engine (use_ds_zero=True) cannot be combined with, and why.
DEEPSPEED_CONFLICTS: Dict[str, str] = {
    "half": "DeepSpeed keeps fp32 master weights and sets the parameter dtype itself (use_ds_zero=True); use "
            "amp_native instead of half",
    "ddp": "the DeepSpeed engine (use_ds_zero=True) averages gradients itself",
}


def prepare_deepspeed(ctx: ModelContext) -> None:
    """Apply phase: claim gradient sync and precision before the optimizer and wrappers run."""
    ctx.is_sharded = True                # no DDP: the engine reduces gradients
    ctx.autocast_by_wrapper = ctx.autocast_dtype is not None
    ctx.loss_scaling_by_wrapper = True   # DeepSpeed's fp16 has its own loss scaler


def deepspeed_config(ctx: ModelContext, stage: int) -> Dict[str, Any]:
    dp = ctx.data_parallel_size()
    global_batch = ctx.dataloader_args.get("batch_size")
    # DeepSpeed insists on a batch size; without a dataloader it only feeds its throughput logs.
    micro = max(1, global_batch // dp) if global_batch else 1
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * dp,
        "zero_optimization": {"stage": stage},
        # The user's torch optimizer is passed as DeepSpeed's "client optimizer", so the update
        # rule is exactly the one asked for; DeepSpeed warns about it unless told it is intended.
        "zero_allow_untested_optimizer": True,
        # DeepSpeed 0.19 clips gradients to norm 1.0 unless told otherwise; training must match
        # the user's plain loop, which does not clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 2 ** 31 - 1,
        "wall_clock_breakdown": False,
    }
    if ctx.autocast_dtype is torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif ctx.autocast_dtype is torch.float16:
        config["fp16"] = {"enabled": True}
    return config


def build_deepspeed_engine(ctx: ModelContext, who: str, stage: int) -> Dict[str, Any]:
    """Wrapper phase: a DeepSpeed engine over the model and the user's optimizer (ZeRO `stage`).

    DeepSpeed reuses the process group atorch already created (dist_init_required=False). An
    LR scheduler is built here, on the user's optimizer, and handed to the engine, because
    `engine.step()` is what steps it.
    """
    if ctx.optim is None:
        raise ValueError(f"{who} with use_ds_zero=True needs optim_func: DeepSpeed ZeRO shards the optimizer")
    import deepspeed  # heavy; only when an engine is asked for

    config = deepspeed_config(ctx, stage)
    scheduler = None
    if ctx.lr_scheduler_cls is not None:
        scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
    engine, optim, _, scheduler = deepspeed.initialize(model=ctx.model, optimizer=ctx.optim, lr_scheduler=scheduler,
                                                       config=config, dist_init_required=False)
    ctx.engine = engine
    ctx.optim = optim
    ctx.lr_scheduler = scheduler
    ctx.deepspeed_config = config
    return {"backend": "deepspeed", "zero_stage": stage,
            "mixed_precision": dtype_name(ctx.autocast_dtype) if ctx.autocast_dtype is not None else None}



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

    def __post_init__(self) -> None:
        for key in ("cpu_offload", "sync_module_states", "use_ds_zero"):
            check_bool(self._owner, key, getattr(self, key))
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls(self._owner, self.wrap_cls))


class Fsdp2ShardingOptimization(Optimization):
    """`fsdp` and `zero2` differ only in these two class attributes (and their name/conflicts)."""

    order = Order.SHARDING
    wrapper_order = WrapperOrder.ENGINE   # builds the DeepSpeed engine when use_ds_zero=True
    reshard_after_forward: ClassVar[bool]
    deepspeed_stage: ClassVar[int]

    @classmethod
    def cost_traits(cls, config: Fsdp2ShardingConfig, context: CostContext) -> Dict[str, Any]:
        if config.use_ds_zero:
            return {"sharding": "deepspeed", "zero_stage": cls.deepspeed_stage, "ddp_wrap": False,
                    "cpu_offload": config.cpu_offload}
        return {"sharding": "fsdp2", "zero_stage": 3 if cls.reshard_after_forward else 2,
                "reshard_after_forward": cls.reshard_after_forward, "cpu_offload": config.cpu_offload,
                "ddp_wrap": False}

    @classmethod
    def config_conflicts(cls, config: Fsdp2ShardingConfig) -> Dict[str, str]:
        return dict(DEEPSPEED_CONFLICTS) if config.use_ds_zero else {}

    @classmethod
    def wraps(cls, config: Fsdp2ShardingConfig) -> bool:
        return config.use_ds_zero

    @classmethod
    def syncs_gradients(cls, config: Fsdp2ShardingConfig) -> bool:
        return True

    @classmethod
    def describe_step(cls, config: Fsdp2ShardingConfig) -> str:
        if config.use_ds_zero:
            return f"{cls.name}(deepspeed stage {cls.deepspeed_stage})"
        reshard = "reshard" if cls.reshard_after_forward else "no reshard"
        return f"{cls.name}(torch FSDP2, {reshard}{', cpu offload' if config.cpu_offload else ''})"

    def validate(self, config: Fsdp2ShardingConfig, context: ValidationContext) -> None:
        if config.use_ds_zero:
            validate_deepspeed(self.name, context, cpu_offload=config.cpu_offload, wrap_cls=config.wrap_cls)

    def apply(self, ctx: ModelContext, config: Fsdp2ShardingConfig) -> None:
        if config.use_ds_zero:
            # DeepSpeed partitions when the engine is built, after the optimizer exists, and
            # broadcasts rank 0's weights first (every stage): sync_module_states is implied.
            prepare_deepspeed(ctx)
            return
        ctx.summaries[self.name] = shard_with_fsdp2(
            ctx, self.name, wrap_cls=config.wrap_cls, reshard_after_forward=self.reshard_after_forward,
            cpu_offload=config.cpu_offload, sync_module_states=config.sync_module_states)

    def apply_wrapper(self, ctx: ModelContext, config: Fsdp2ShardingConfig) -> None:
        if config.use_ds_zero:
            ctx.summaries[self.name] = build_deepspeed_engine(ctx, self.name, stage=self.deepspeed_stage)
