"""Apply a strategy to a `ModelContext` and assemble the `AutoAccelerateResult`.

The one path every strategy takes, whether `auto_accelerate` applies it, the dry runner
tries it, or an optimization builds on it (DeepSpeed 3D's micro-batch loader):

    resolve (validate, order) -> apply phase (by `order`) -> place the model -> build the
    optimizer -> wrapper phase (by `wrapper_order`) -> LR scheduler -> dataloader -> result

Every function here raises; only the entry point turns a failure into `status=False`.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, default_collate

from atorch import distributed as adist
from atorch.auto.arguments import DEFAULT_GLOBAL_BATCH, check_loss, check_optimizer
from atorch.auto.model_context import ModelContext, default_loss_func, default_prepare_input, first_loss
from atorch.auto.opt_lib.base import ValidationContext
from atorch.auto.opt_lib.resolve import ResolvedOptimization, resolve_strategy, wrapper_phase
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.data.samplers import WholeStepsSampler, record_set_epoch
from atorch.distributed.agreement import agree_on_error

logger = logging.getLogger(__name__)


def validation_context(ctx: ModelContext) -> ValidationContext:
    """What validation may see of `ctx`: plain values, the same on every rank."""
    return ValidationContext(world_size=adist.world_size(), model=ctx.model,
                             model_config=getattr(ctx.model, "config", None), device_type=ctx.device.type,
                             global_batch_size=ctx.dataloader_args.get("batch_size"),
                             loss_func_given=ctx.loss_func is not None)


def resolve(ctx: ModelContext, strategy: Strategy) -> List[ResolvedOptimization]:
    """Validate `strategy` for `ctx` (ValueError on every rank before any collective), in application order."""
    return resolve_strategy(strategy, validation_context(ctx))


def apply_strategy(ctx: ModelContext, strategy: Strategy) -> AutoAccelerateResult:
    """Validate and apply `strategy` to `ctx`, raising on any problem."""
    return apply_resolved(ctx, resolve(ctx, strategy))


def apply_resolved(ctx: ModelContext, resolved: List[ResolvedOptimization]) -> AutoAccelerateResult:
    """Apply `resolved` to `ctx` and assemble the result.

    Every optimization's apply, the user's code, and every wrapper end in a vote (`agree_on_error`): a
    failure on one rank after its last collective raises the same exception, naming the step that failed,
    on every rank, instead of that rank voting at one point while the others vote at the next (each
    raising a different error) or wait in the next step's collective.
    """
    for r in resolved:
        with agree_on_error(f"auto_accelerate: applying {r.name}"):
            r.optimization.apply(ctx, r.config)
        ctx.applied.append(r.name)
    warn_unsynced_batch_norm(ctx.model, ctx.data_parallel_size())
    with agree_on_error("auto_accelerate: placing the model and calling optim_func"):
        place_model(ctx)
        if ctx.optim is None and ctx.optim_func is not None:
            ctx.optim = check_optimizer(ctx.optim_func(ctx.optim_params(), **ctx.optim_args), ctx.optim_func)
    for r in wrapper_phase(resolved):
        with agree_on_error(f"auto_accelerate: wrapping the model with {r.name} (after optim_func)"):
            r.optimization.apply_wrapper(ctx, r.config)
    with agree_on_error("auto_accelerate: calling lr_scheduler_cls and building the dataloader"):
        if ctx.lr_scheduler is None and ctx.lr_scheduler_cls is not None and ctx.optim is not None:
            ctx.lr_scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
        if ctx.dataloader is None and ctx.dataset is not None:
            ctx.dataloader, ctx.sampler = build_dataloader(ctx)
    from atorch.checkpoint.model_methods import attach_checkpoint_methods  # imported on use: DCP is heavy

    if "transformers" in sys.modules:  # only a transformers model generates; do not import it for others
        from atorch.generation import enable_fused_generate

        enable_fused_generate(ctx.model)  # `generate(..., fused_no_repeat_ngram_blocking=True)`
    # `result.model.save_parallelized(dir, merge_checkpoints=...)` / `.from_parallelized(dir)`.
    return attach_checkpoint_methods(assemble_result(ctx, applied_strategy(resolved)))


def warn_unsynced_batch_norm(model: nn.Module, data_parallel_size: int) -> None:
    """Warn (once per auto_accelerate) that BatchNorm under data parallelism normalizes with each rank's own batch
    statistics and keeps per-rank running statistics, unlike single-process training: atorch does not convert
    it; torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before auto_accelerate does."""
    if data_parallel_size <= 1:
        return
    first = next(((name, m) for name, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)), None)
    if first is not None:
        logger.warning("BatchNorm %r (%s) and any others use per-rank batch statistics over %d data-parallel ranks "
                       "(running_mean/var differ between ranks, not synchronized); for statistics over the global "
                       "batch, convert before auto_accelerate: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm("
                       "model)", first[0], type(first[1]).__name__, data_parallel_size)


def applied_strategy(resolved: List[ResolvedOptimization]) -> Strategy:
    """The strategy as applied, each config in plain JSON form where it has one (dtypes by name,
    non-default fields, nothing dropped), so the saved file says exactly what ran."""
    items = []
    for r in resolved:
        plain = type(r.optimization).plain_config(r.config)
        config = plain if plain is not None and (plain or r.item.config is None) else r.item.config
        items.append(StrategyItem(r.name, config or None, r.item.tunable))
    return Strategy(items)


def place_model(ctx: ModelContext) -> None:
    """Move an ordinary model to the device; sharded or engine-owned models are placed by their wrapper."""
    if ctx.is_sharded or ctx.engine is not None:
        return
    on_meta = [name for name, p in ctx.model.named_parameters() if p.is_meta]
    if on_meta:
        raise ValueError(f"the model still has {len(on_meta)} parameter tensor(s) on the meta device after all "
                         f"optimizations, the first {on_meta[0]!r}: a model built under record_module_init needs "
                         "tensor_parallel, pipeline or deepspeed_3d_parallel to materialize it (or build the model "
                         "outside record_module_init / load its weights before auto_accelerate)")
    ctx.model.to(ctx.device)


def stack_samples(samples: List[Any]) -> Any:
    """torch's default collate (stack each field), saying what to do when samples of one batch differ in length:
    torch's "stack expects each tensor to be equal size" names neither the dataset nor a remedy. Module level,
    so DataLoader workers can pickle it."""
    try:
        return default_collate(samples)
    except RuntimeError as e:
        if "stack expects each tensor to be equal size" not in str(e):
            raise
        raise ValueError(f"dataloader: the samples of one batch differ in length ({e}); pad them to one length in "
                         "the dataset, or pass dataloader_args={'collate_fn': ...} that pads each batch (e.g. "
                         "transformers' DataCollatorForSeq2Seq, or one padding input_ids with the pad token and "
                         "labels with -100)") from e


# (dataset length, global batch, drop_last) already told about its last global batch (`build_dataloader`),
# since the current auto_accelerate call began (`new_call`).
_SAID_OF_THE_LAST_BATCH: Set[Tuple[Optional[int], int, bool]] = set()


def new_call() -> None:
    """An auto_accelerate call begins: what `build_dataloader` says once, it says again in it."""
    _SAID_OF_THE_LAST_BATCH.clear()


def build_dataloader(ctx: ModelContext, global_batch: Optional[int] = None,
                     micro_batches: int = 1) -> Tuple[DataLoader, Sampler]:
    """A DataLoader whose `batch_size` is the global one (or `global_batch`) divided over the data-parallel ranks
    and into `micro_batches` items (DeepSpeed 3D's engine pulls a step's micro-batches from the loader itself)."""
    args = dict(ctx.dataloader_args)
    batch = args.pop("batch_size", DEFAULT_GLOBAL_BATCH)
    global_batch = batch if global_batch is None else global_batch
    dp = ctx.data_parallel_size()
    if global_batch % dp != 0:
        raise ValueError(f"dataloader_args batch_size={global_batch} (global) is not divisible by the data-parallel "
                         f"size {dp}")
    shuffle = args.pop("shuffle", False)
    seed = args.pop("seed", 0)
    drop_last = args.pop("drop_last", True)
    sampler = _make_sampler(ctx, dp, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if (global_batch // dp) % micro_batches != 0:
        raise ValueError(f"dataloader_args batch_size={global_batch} (global) does not split into {micro_batches} "
                         f"micro-batches on each of {dp} data-parallel ranks")
    # With drop_last, items that are micro-batches stop at the last whole step, as whole batches would: an engine
    # taking `micro_batches` items per step (DeepSpeed 3D) would run out in the middle of an epoch's last step.
    # (Without drop_last, DeepSpeed 3D refuses an epoch ending mid-step before training.)
    whole_steps = micro_batches > 1 and drop_last and hasattr(sampler, "__len__")
    if args.get("collate_fn") is None:
        args["collate_fn"] = stack_samples
    loader = DataLoader(ctx.dataset, batch_size=global_batch // dp // micro_batches, drop_last=drop_last,
                        sampler=WholeStepsSampler(sampler, global_batch // dp) if whole_steps else sampler, **args)
    size = len(ctx.dataset) if hasattr(ctx.dataset, "__len__") else None
    # Once per auto_accelerate call and setting: an automatic search builds a dataloader for every dry run.
    said = (size, global_batch, drop_last)
    if size is not None and size % global_batch and adist.rank() == 0 and said not in _SAID_OF_THE_LAST_BATCH:
        _SAID_OF_THE_LAST_BATCH.add(said)
        if drop_last:
            logger.warning("dataloader: %d samples in global batches of %d: the last %d are left out in each epoch "
                           "(dataloader_args['drop_last']=True)", size, global_batch, size % global_batch)
        else:
            logger.info("dataloader: %d samples in global batches of %d: the last global batch is smaller (the "
                        "sampler repeats a few samples so that every data rank gets the same number) in each epoch "
                        "(dataloader_args['drop_last']=False)", size, global_batch)
    return loader, sampler


def _make_sampler(ctx: ModelContext, dp: int, *, shuffle: bool, seed: int, drop_last: bool) -> Sampler:
    """The user's `distributed_sampler_cls` (DistributedSampler's interface), or DistributedSampler."""
    sampler_cls = ctx.distributed_sampler_cls or DistributedSampler
    kwargs: Dict[str, Any] = {"num_replicas": dp, "rank": ctx.data_parallel_rank(), "shuffle": shuffle, "seed": seed,
              "drop_last": drop_last}
    try:
        accepted: Mapping[str, inspect.Parameter] = inspect.signature(sampler_cls).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented callable: pass everything
        accepted = {}
    if accepted and not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    # Whether the loop calls set_epoch decides the order a checkpoint at an epoch boundary resumes in.
    return record_set_epoch(sampler_cls(ctx.dataset, **kwargs))


def _global_batch(ctx: ModelContext) -> Optional[int]:
    """The dataloader's global batch: `dataloader_args["batch_size"]`, or the default `build_dataloader` used
    (for callers of `apply_strategy` that left it out; `auto_accelerate` writes it down); None without a dataloader."""
    batch = ctx.dataloader_args.get("batch_size")
    if batch is None and ctx.dataloader is not None:
        return DEFAULT_GLOBAL_BATCH
    return batch


def assemble_result(ctx: ModelContext, strategy: Strategy) -> AutoAccelerateResult:
    """The typed result of an applied context."""
    user_loss = ctx.loss_func or default_loss_func
    transforms = list(ctx.loss_transforms)

    def loss_func(batch: Any, output: Any) -> torch.Tensor:
        loss = check_loss(first_loss(user_loss(batch, output)), ctx.loss_func)
        for transform in transforms:
            loss = transform(loss)
        return loss

    user_prepare = ctx.prepare_input or default_prepare_input
    device = ctx.device

    def prepare_input(batch: Any, device_: Optional[torch.device] = None) -> Any:
        return user_prepare(batch, device_ or device)

    return AutoAccelerateResult(
        model=ctx.engine if ctx.engine is not None else ctx.model, optim=ctx.optim, dataloader=ctx.dataloader,
        loss_func=loss_func, prepare_input=prepare_input, user_loss_func=ctx.loss_func is not None,
        lr_scheduler=ctx.lr_scheduler, strategy=strategy,
        device=ctx.device, model_input_format=ctx.model_input_format, parallel=ctx.parallel,
        data_parallel_size=ctx.data_parallel_size(), global_batch_size=_global_batch(ctx),
        sampler=ctx.sampler, engine=ctx.engine, deepspeed_config=ctx.deepspeed_config,
        autocast_dtype=ctx.autocast_dtype, grad_scaler=ctx.grad_scaler, custom_train_step=ctx.custom_train_step,
        gradient_accumulation_steps=ctx.gradient_accumulation_steps, sync_each_micro_step=ctx.sync_each_micro_step,
        micro_batch_size=ctx.micro_batch_size,
        pipeline=ctx.pipeline, pipeline_stage=ctx.pipeline_stage, randomizer=ctx.randomizer,
        summaries=dict(ctx.summaries), applied=list(ctx.applied))
