"""`auto_accelerate`: validate -> (search) -> apply -> `AutoAccelerateResult`.

Mistakes in the arguments (see `atorch.auto.arguments`) and in the strategy (an unknown
optimization, a bad config, a conflicting pair) raise ValueError/TypeError on every rank before
any collective, as do atorch's own checks that can only run while applying (all ranks agree
on them). `status=False` means a valid strategy failed while it was applied (any other
exception, logged with its traceback) or no searched strategy ran; every rank returns the same.
"""

from __future__ import annotations

import logging
import os
from collections import namedtuple
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from atorch import distributed as adist
from atorch.auto.arguments import check_loss, validate_arguments, validate_batch_layout
from atorch.auto.model_context import ModelContext, call_model, default_loss_func, default_prepare_input, first_loss
from atorch.auto.opt_lib.base import ValidationContext
from atorch.auto.opt_lib.resolve import resolve_strategy
from atorch.auto.strategy import Strategy, StrategyLike
from atorch.distributed.agreement import agree_on_error

logger = logging.getLogger(__name__)

AutoAccelerateResult = namedtuple(
    "AutoAccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"])

_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")


def auto_accelerate(
    model: nn.Module,
    optim_func: Optional[Callable] = None,
    dataset: Any = None,
    loss_func: Optional[Callable] = None,
    prepare_input: Optional[Callable] = None,
    model_input_format: Optional[str] = None,
    optim_args: Optional[Dict[str, Any]] = None,
    optim_param_func: Optional[Callable] = None,
    dataloader_args: Optional[Dict[str, Any]] = None,
    lr_scheduler_cls: Optional[Callable] = None,
    lr_scheduler_args: Optional[Dict[str, Any]] = None,
    load_strategy: Optional[StrategyLike] = None,
    ignore_dryrun_on_load_strategy: bool = True,
    save_strategy_to_file: Optional[str] = None,
    excluded: Optional[Sequence[str]] = None,
    included: Optional[Sequence[str]] = None,
    report_path: Optional[str] = None,
) -> Tuple[bool, Optional[AutoAccelerateResult], Optional[Strategy]]:
    """Make `model` train fast under a given or searched strategy.

    Returns `(status, result, strategy)`; `result` is an `AutoAccelerateResult` whose
    `dataloader_args["batch_size"]` is the *global* batch size, split over data-parallel ranks.
    """
    if model_input_format not in _INPUT_FORMATS:
        raise ValueError(f"model_input_format={model_input_format!r}; valid values are {list(_INPUT_FORMATS)}")
    validate_arguments(model=model, optim_func=optim_func, dataset=dataset, loss_func=loss_func,
                       prepare_input=prepare_input, optim_args=optim_args, optim_param_func=optim_param_func,
                       dataloader_args=dataloader_args, lr_scheduler_cls=lr_scheduler_cls,
                       lr_scheduler_args=lr_scheduler_args, save_strategy_to_file=save_strategy_to_file,
                       report_path=report_path, excluded=excluded, included=included)
    adist.init_distributed()
    ctx = ModelContext(
        model=model, optim_func=optim_func, optim_args=dict(optim_args or {}), optim_param_func=optim_param_func,
        dataset=dataset, loss_func=loss_func, prepare_input=prepare_input, model_input_format=model_input_format,
        dataloader_args=dict(dataloader_args or {}), lr_scheduler_cls=lr_scheduler_cls,
        lr_scheduler_args=dict(lr_scheduler_args or {}), device=adist.device())
    if load_strategy is None:
        from atorch.auto.search.auto_search import SearchError, search_for_context  # planner: only when searching

        try:
            with agree_on_error("auto_accelerate: the strategy search"):
                strategy = search_for_context(ctx, excluded=excluded, included=included, report_path=report_path)
        except SearchError:  # every candidate failed its dry run: the documented status=False path
            logger.exception("auto_accelerate: the strategy search found no strategy that runs")
            return False, None, None
    else:
        with agree_on_error("auto_accelerate: reading load_strategy"):
            strategy = Strategy.from_any(load_strategy)
        if not ignore_dryrun_on_load_strategy:
            from atorch.auto.dry_runner import DryRunError, check_strategy_runs

            try:
                check_strategy_runs(ctx, strategy)   # validates first: a bad strategy still raises ValueError
            except DryRunError:
                logger.exception("auto_accelerate: the loaded strategy failed its dry run")
                return False, None, None
    # Validation raises ValueError on every rank before any collective.
    vctx = validation_context(ctx)
    resolved = resolve_strategy(strategy, vctx)
    pipeline = vctx.configs.get("pipeline_parallel")
    validate_batch_layout(ctx.dataloader_args, vctx.parallel_sizes(),
                          (pipeline.chunks or vctx.parallel_sizes().get("pipeline")) if pipeline else None)
    try:
        # Every rank returns the same status. A rank failing inside an optimization, before one of
        # its collectives, leaves the others in that collective until ATORCH_COLLECTIVE_TIMEOUT.
        with agree_on_error(f"auto_accelerate: applying {strategy.describe()}"):
            result = apply_resolved(ctx, resolved)
    except (ValueError, TypeError):  # atorch's checks that run while applying: argument mistakes, raised
        raise
    except Exception:  # noqa: BLE001 - documented status=False path, full reason logged
        logger.exception("auto_accelerate could not apply strategy %s", strategy.describe())
        return False, None, None
    chosen = Strategy(r.item for r in resolved)
    with agree_on_error(f"auto_accelerate: save_strategy_to_file={save_strategy_to_file!r}"):
        if save_strategy_to_file and adist.rank() == 0:
            chosen.save(save_strategy_to_file)
    return True, result, chosen


def validation_context(ctx: ModelContext) -> ValidationContext:
    return ValidationContext(world_size=adist.world_size(), model=ctx.model,
                             model_config=getattr(ctx.model, "config", None), device_type=ctx.device.type)


def apply_strategy(ctx: ModelContext, strategy: Strategy) -> AutoAccelerateResult:
    """Validate and apply `strategy` to `ctx` (raising on any problem); used by the dry runner too."""
    return apply_resolved(ctx, resolve_strategy(strategy, validation_context(ctx)))


def apply_resolved(ctx: ModelContext, resolved) -> AutoAccelerateResult:
    for r in resolved:
        r.optimization.apply(ctx, r.config)
        ctx.applied.append(r.name)
    # The user's code runs between the optimizations' collectives: each call ends in a vote, so
    # a failure on one rank raises the same exception on every rank instead of leaving the
    # others in the next optimization's collective.
    with agree_on_error("auto_accelerate: placing the model and calling optim_func"):
        _place_model(ctx)
        if ctx.optim is None and ctx.optim_func is not None:
            ctx.optim = ctx.optim_func(ctx.optim_params(), **ctx.optim_args)
    for r in resolved:
        r.optimization.apply_wrapper(ctx, r.config)
    with agree_on_error("auto_accelerate: calling lr_scheduler_cls and building the dataloader"):
        if ctx.lr_scheduler is None and ctx.lr_scheduler_cls is not None and ctx.optim is not None:
            ctx.lr_scheduler = ctx.lr_scheduler_cls(ctx.optim, **ctx.lr_scheduler_args)
        if ctx.dataloader is None and ctx.dataset is not None:
            ctx.dataloader, ctx.sampler = build_dataloader(ctx)
    from atorch.checkpoint.model_methods import attach_checkpoint_methods  # imported on use: DCP is heavy

    # `result.model.save_parallelized(dir, merge_checkpoints=...)` / `.from_parallelized(dir)`.
    return attach_checkpoint_methods(_result(ctx))


def _place_model(ctx: ModelContext) -> None:
    """Move an ordinary model to the device; sharded or engine-owned models are placed by their wrapper."""
    if ctx.is_sharded or ctx.engine is not None:
        return
    if any(p.is_meta for p in ctx.model.parameters()):
        raise ValueError("the model still has parameters on the meta device after all optimizations: a model "
                         "built under record_module_init needs tensor_parallel, pipeline or deepspeed_3d_parallel "
                         "to materialize it")
    ctx.model.to(ctx.device)


def build_dataloader(ctx: ModelContext) -> Tuple[DataLoader, DistributedSampler]:
    """A DataLoader whose `batch_size` is the global one divided over the data-parallel ranks."""
    args = dict(ctx.dataloader_args)
    global_batch = args.pop("batch_size", 1)
    dp = ctx.data_parallel_size()
    if global_batch % dp != 0:
        raise ValueError(f"dataloader_args batch_size={global_batch} (global) is not divisible by the data-parallel "
                         f"size {dp}")
    shuffle = args.pop("shuffle", False)
    seed = args.pop("seed", 0)
    drop_last = args.pop("drop_last", True)
    sampler = DistributedSampler(ctx.dataset, num_replicas=dp, rank=ctx.data_parallel_rank(), shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    loader = DataLoader(ctx.dataset, batch_size=global_batch // dp, sampler=sampler, drop_last=drop_last, **args)
    return loader, sampler


def _result(ctx: ModelContext) -> AutoAccelerateResult:
    user_loss = ctx.loss_func or default_loss_func

    def loss_func(batch: Any, output: Any) -> torch.Tensor:
        loss = check_loss(first_loss(user_loss(batch, output)), ctx.loss_func)
        for transform in ctx.loss_transforms:
            loss = transform(loss)
        return loss

    user_prepare = ctx.prepare_input or default_prepare_input

    def prepare_input(batch: Any, device: Optional[torch.device] = None) -> Any:
        return user_prepare(batch, device or ctx.device)

    args = {
        "strategy": list(ctx.applied),
        "device": ctx.device,
        "model_input_format": ctx.model_input_format,
        "data_parallel_size": ctx.data_parallel_size(),
        "global_batch_size": ctx.dataloader_args.get("batch_size"),
        "autocast_dtype": ctx.autocast_dtype,
        "grad_scaler": ctx.grad_scaler,
        "engine": ctx.engine,
        "sampler": ctx.sampler,
        **ctx.extra,
    }
    model = ctx.engine if ctx.engine is not None else ctx.model
    return AutoAccelerateResult(model, ctx.optim, ctx.dataloader, loss_func, prepare_input, ctx.lr_scheduler, args)


def train_step(result: AutoAccelerateResult, batch: Any) -> torch.Tensor:
    """One optimizer step on `batch` for any strategy: forward, loss, backward, step, zero_grad.

    Plain loops (`loss.backward(); optim.step()`) work too; this helper also drives
    DeepSpeed engines, which need `engine.backward` / `engine.step`.
    """
    custom_step = result.args.get("train_step")
    if custom_step is not None:  # pipeline schedules/engines (pipeline_parallel, deepspeed_3d_parallel) step themselves
        return custom_step(result, batch)
    batch = result.prepare_input(batch)
    output = call_model(result.model, batch, result.args["model_input_format"])
    loss = result.loss_func(batch, output)
    engine = result.args.get("engine")
    if engine is not None:
        engine.backward(loss)
        engine.step()
    else:
        loss.backward()
        result.optim.step()
        result.optim.zero_grad(set_to_none=True)
        if result.lr_scheduler is not None:
            result.lr_scheduler.step()
    return loss.detach()


def env_int(name: str, default: int) -> int:
    """An integer environment variable (read at entry points only)."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from e
