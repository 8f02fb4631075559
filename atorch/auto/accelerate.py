"""`auto_accelerate`: the entry point. Arguments -> (search) -> `engine.apply_strategy` -> result.

Mistakes in the arguments (see `atorch.auto.arguments`) and in the strategy (an unknown
optimization, a bad config, a conflicting pair) raise ValueError/TypeError on every rank before
anything is applied, as do atorch's own checks that can only run while applying. The checks are
local; on several ranks a small vote follows each (`atorch.distributed.agreement`), so a mistake
that only some ranks see, or inputs that differ between ranks, raise on every rank too.
`status=False` means a valid strategy failed while it was applied (any other exception, logged
with its traceback) or no searched strategy ran; every rank returns the same.
The work itself is in `atorch.auto.engine` (apply) and `atorch.auto.search` (the automatic mode).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from atorch import distributed as adist
from atorch.auto.arguments import (
    DEFAULT_GLOBAL_BATCH,
    check_dry_run_batches,
    check_sample_batch,
    validate_arguments,
    validate_resolved_layout,
)
from atorch.auto.compat import CompatArgs, drop_atorch_only_names, finetune_strategy_items, translate_atorch_kwargs
from atorch.auto.engine import (
    applied_strategy,
    apply_resolved,
    apply_strategy,
    build_dataloader,
    new_call,
    validation_context,
)
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import get_optimization
from atorch.auto.opt_lib.resolve import ResolvedOptimization, resolve_strategy
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.strategy import NotStorableError, Strategy, StrategyLike
from atorch.auto.train_step import train_step
from atorch.distributed.agreement import agree, agree_on_error, agree_on_values
from atorch.utils.quiet import configure_logging, third_party_warnings_filtered
from atorch.utils.stable import stable_repr

logger = logging.getLogger(__name__)

__all__ = ["AutoAccelerateResult", "apply_strategy", "auto_accelerate", "build_dataloader", "train_step",
           "validation_context"]

_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")


def auto_accelerate(
    model: nn.Module,
    optim_func: Optional[Callable[..., torch.optim.Optimizer]] = None,
    dataset: Any = None,
    loss_func: Optional[Callable[[Any, Any], Any]] = None,
    prepare_input: Optional[Callable[[Any, torch.device], Any]] = None,
    model_input_format: Optional[str] = None,
    optim_args: Optional[Dict[str, Any]] = None,
    optim_param_func: Optional[Callable[[nn.Module], Iterable]] = None,
    dataloader_args: Optional[Dict[str, Any]] = None,
    distributed_sampler_cls: Optional[Callable[..., Any]] = None,
    excluded: Optional[Sequence[str]] = None,
    included: Optional[Sequence[str]] = None,
    load_strategy: Optional[StrategyLike] = None,
    lr_scheduler_cls: Optional[Callable[..., Any]] = None,
    lr_scheduler_args: Optional[Dict[str, Any]] = None,
    finetune_strategy: bool = False,
    save_strategy_to_file: Optional[str] = None,
    *,
    ignore_dryrun_on_load_strategy: bool = True,
    report_path: Optional[str] = None,
    **kargs: Any,
) -> Tuple[bool, Optional[AutoAccelerateResult], Optional[Strategy]]:
    """Make `model` train fast under a given or searched strategy.

    The positional order is that of the system we follow, so its scripts run unchanged.
    Returns `(status, result, strategy)`; `result` is an `AutoAccelerateResult` whose
    dataloader yields this data rank's share of each *global* batch of
    `dataloader_args["batch_size"]` (default 1, as torch's DataLoader). After a successful call
    the strategy's parallel groups are also the process default
    (`atorch.distributed.parallel_group(name)`).

    ATorch's extra keywords (`atorch.auto.compat`): `sample_batch` with `batch_size` (and
    `expand_sample_batch`) stands in for `dataset` in the dry runs only (no dataloader is
    made from it); `sampler_seed` seeds the sampler (atorch: `dataloader_args["seed"]`);
    `finetune_strategy=True` resets the configs of the loaded items but `parallel_mode` to
    their defaults.
    """
    error: Optional[Exception] = None
    try:
        compat = translate_atorch_kwargs(dataset=dataset, load_strategy=load_strategy,
                                         distributed_sampler_cls=distributed_sampler_cls,
                                         finetune_strategy=finetune_strategy, **kargs)
        dataloader_args = compat.dataloader_args(dataloader_args)
        if model_input_format not in _INPUT_FORMATS:
            raise ValueError(f"model_input_format={model_input_format!r}; valid values are {list(_INPUT_FORMATS)}")
        validate_arguments(model=model, optim_func=optim_func, dataset=dataset, model_input_format=model_input_format,
                           loss_func=loss_func,
                           prepare_input=prepare_input, optim_args=optim_args, optim_param_func=optim_param_func,
                           dataloader_args=dataloader_args, lr_scheduler_cls=lr_scheduler_cls,
                           lr_scheduler_args=lr_scheduler_args, save_strategy_to_file=save_strategy_to_file,
                           report_path=report_path, excluded=excluded, included=included)
        stand_in = compat.dry_run_dataset()
        if stand_in is not None:
            check_sample_batch(stand_in, compat.expand_sample_batch, model, model_input_format, prepare_input)
        check_dry_run_batches(has_batches=dataset is not None or stand_in is not None,
                              load_strategy_given=load_strategy is not None,
                              ignore_dryrun_on_load_strategy=ignore_dryrun_on_load_strategy)
    except Exception as e:  # noqa: BLE001 - agreed across ranks below, then raised on each
        if not _several_ranks():
            raise
        error = e
    # A mistake only some ranks see (a per-rank dataset, a path on one node): every rank raises it,
    # rather than the others waiting in the first collective until the timeout.
    adist.init_distributed()
    agree("auto_accelerate: checking the arguments", error)
    configure_logging()
    set_train_mode(model)
    new_call()
    if load_strategy is not None and (excluded or included):
        logger.warning("auto_accelerate: excluded=%s and included=%s only restrict the automatic search; with "
                       "load_strategy they are not used", excluded, included)
    ctx = ModelContext(
        model=model, optim_func=optim_func, optim_args=dict(optim_args or {}), optim_param_func=optim_param_func,
        dataset=dataset, loss_func=loss_func, prepare_input=prepare_input, model_input_format=model_input_format,
        dataloader_args=dict(dataloader_args or {}), distributed_sampler_cls=distributed_sampler_cls,
        lr_scheduler_cls=lr_scheduler_cls, lr_scheduler_args=dict(lr_scheduler_args or {}), device=adist.device())
    with third_party_warnings_filtered():
        return _accelerate(ctx, load_strategy, ignore_dryrun_on_load_strategy, excluded, included, report_path,
                           save_strategy_to_file, compat)


def set_train_mode(model: nn.Module) -> None:
    """Put a model in eval mode into train mode, as Hugging Face's Trainer does, and say so once (INFO, rank 0).

    `from_pretrained` returns a model in eval mode: trained so, its dropout stayed off, silently (only lora
    switched it on, through peft). A model already in train mode is left as it is, submodules the user put
    in eval mode (a frozen BatchNorm) included."""
    if model.training:
        return
    model.train()
    if adist.rank() == 0:
        logger.info("auto_accelerate: the model (%s) was in eval mode (as from_pretrained returns it); it is now in "
                    "train mode, so its dropout is on. Call model.eval() on result.model to evaluate",
                    type(model).__name__)


def _dry_run_context(ctx: ModelContext, compat: CompatArgs) -> ModelContext:
    """`ctx`, or a copy reading ATorch's `sample_batch` as its dataset (for dry runs; it is already model input)."""
    stand_in = compat.dry_run_dataset()
    if stand_in is None:
        return ctx
    args = {k: v for k, v in ctx.dataloader_args.items() if k != "collate_fn"}
    args["batch_size"] = compat.batch_size
    return dataclasses.replace(ctx, dataset=stand_in, dataloader_args=args)


def _accelerate(ctx: ModelContext, load_strategy: Optional[StrategyLike], ignore_dryrun_on_load_strategy: bool,
                excluded: Optional[Sequence[str]], included: Optional[Sequence[str]], report_path: Optional[str],
                save_strategy_to_file: Optional[str], compat: CompatArgs
                ) -> Tuple[bool, Optional[AutoAccelerateResult], Optional[Strategy]]:
    search = None
    strategy: Optional[Strategy] = None
    if load_strategy is not None:
        # Read on every rank; a file may fail to read on one rank only: every rank raises the same error.
        with agree_on_error("auto_accelerate: reading load_strategy"):
            strategy = Strategy.from_any(load_strategy)
            if compat.finetune_strategy:
                strategy = finetune_strategy_items(strategy)
    default_batch_size(ctx, strategy)
    dry_ctx = _dry_run_context(ctx, compat)
    _agree_between_ranks(ctx, strategy)
    if strategy is None:
        from atorch.auto.search.auto_search import SearchError, search_for_context  # planner: only when searching

        try:
            with agree_on_error("auto_accelerate: the strategy search"):
                search = search_for_context(dry_ctx, excluded=drop_atorch_only_names(excluded), included=included,
                                            report_path=report_path)
        except SearchError:  # every candidate failed its dry run: the documented status=False path
            logger.exception("auto_accelerate: the strategy search found no strategy that runs")
            return False, None, None
        strategy = search.strategy
    # Validation is local and the same on every rank (same strategy, same arguments); the vote after
    # it covers what only one rank's objects can show (a model that differs), before anything is built.
    with agree_on_error("auto_accelerate: validating the strategy"):
        try:
            resolved = _validate_layout(ctx, strategy, note_idle=True)
        except ValueError as e:
            if compat.finetune_strategy:
                raise ValueError(f"{e} (finetune_strategy=True reset the configs of the loaded strategy, all but "
                                 "parallel_mode's, to their defaults; pass finetune_strategy=False to keep them)"
                                 ) from e
            raise
        if save_strategy_to_file:
            _check_storable(resolved, save_strategy_to_file)
    if search is None and not ignore_dryrun_on_load_strategy:
        from atorch.auto.dry_runner import DryRunError, check_strategy_runs

        if dry_ctx is not ctx:  # the sample batch's layout is an argument mistake, not a failed dry run
            _validate_layout(dry_ctx, strategy)
        try:
            check_strategy_runs(dry_ctx, strategy)   # validates first: a bad strategy still raises ValueError
        except DryRunError:
            logger.exception("auto_accelerate: the loaded strategy failed its dry run")
            return False, None, None
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
    if search is not None:
        result.search, result.search_report, result.search_reason = search.result, search.report, search.reason
    # Users of the system we follow read the groups through atorch.distributed after this call.
    adist.set_default_parallel_mesh(result.parallel)
    with agree_on_error(f"auto_accelerate: save_strategy_to_file={save_strategy_to_file!r}"):
        if save_strategy_to_file and adist.rank() == 0:
            # Its directory exists, or it is the report directory (validated, created here if no search ran).
            os.makedirs(os.path.dirname(os.path.abspath(save_strategy_to_file)), exist_ok=True)
            result.strategy.save(save_strategy_to_file)
    return True, result, result.strategy


def default_batch_size(ctx: ModelContext, strategy: Optional[Strategy]) -> None:
    """Set `dataloader_args["batch_size"]` to 1 where it is absent and atorch builds a dataloader.

    1 is torch's DataLoader default, which the argument checks and `build_dataloader` apply too;
    written down once here, the strategy's validation (the global batch over the data ranks),
    the search, the dry runs (samples per step) and the result all count the same global batch.
    Left absent without a dataset (no dataloader: atorch knows no batch, and DeepSpeed's ZeRO
    engines keep the batch keys of the user's ds_config), and for a strategy with an optimization
    that takes the global batch from its own config when the dataloader gives none
    (`global_batch_from_config`: deepspeed_3d_parallel and its ds_config's batch keys).
    """
    if "batch_size" in ctx.dataloader_args or ctx.dataset is None:
        return
    if strategy is not None and any(_global_batch_from_config(item.name) for item in strategy):
        return
    ctx.dataloader_args["batch_size"] = DEFAULT_GLOBAL_BATCH


def _global_batch_from_config(name: str) -> bool:
    try:
        cls = get_optimization(name)
    except ValueError:   # an unknown name: validation names it
        return False
    return cls.global_batch_from_config


def _check_storable(resolved: List[ResolvedOptimization], path: str) -> None:
    """The strategy about to be applied can be written to `save_strategy_to_file`, checked before anything is
    built (the file is written after applying)."""
    try:
        applied_strategy(resolved).to_json()
    except NotStorableError as e:
        raise ValueError(f"save_strategy_to_file={path!r}: the strategy's {e.where} holds {e.what}, which a JSON "
                         "strategy file cannot store; drop save_strategy_to_file (keep the strategy in your code and "
                         "pass it as load_strategy=[...] again), or give that setting a value a file can hold (plain "
                         "values, dtypes, classes)") from None


def _several_ranks() -> bool:
    """This process is one of several ranks (a process group of more than one, or a launcher's WORLD_SIZE)."""
    try:
        return adist.world_size() > 1
    except ValueError:
        return False        # a malformed WORLD_SIZE: init_distributed names it


def _agree_between_ranks(ctx: ModelContext, strategy: Optional[Strategy]) -> None:
    """The inputs every rank must share, compared across ranks (one small all-gather): different
    strategies or batch sizes make ranks run different collectives, and a dataset of a different
    length on each rank makes them run a different number of steps; either leaves ranks waiting
    for each other, and nothing inside the backend's error would name the cause. The sampler's
    settings (`_sampler_text`) are compared in the same all-gather."""
    values = {"dataloader_args['batch_size']": repr(ctx.dataloader_args.get("batch_size"))}
    try:
        if ctx.dataset is not None and hasattr(ctx.dataset, "__len__"):
            values["len(dataset)"] = str(len(ctx.dataset))
    except (TypeError, NotImplementedError):   # a __len__ that refuses: nothing to compare
        pass
    if ctx.dataset is not None:
        values[_SAMPLER] = _sampler_text(ctx)
    if strategy is not None:
        values["load_strategy"] = strategy.describe()
    try:
        agree_on_values("auto_accelerate", values)
    except ValueError as e:    # the same text on every rank, so the same note is added everywhere
        if f"{_SAMPLER}:" in str(e):
            raise ValueError(f"{e} ({_SAMPLER_NOTE})") from None
        raise
    agree_on_values("auto_accelerate", _training_texts(ctx), why="so they would train their copies of the "
                    "model differently (each rank's optimizer steps its own replica or shard)")


def _training_texts(ctx: ModelContext) -> Dict[str, str]:
    """How each rank updates the model (optimizer, its arguments, the LR scheduler, the loss), as texts
    comparable across processes (`stable_text`): given different ones, data-parallel replicas drift apart
    with no error anywhere (lr 1e-3 on one rank and 1e-1 on the other: the weights differed by 0.3 after 3
    steps)."""
    return {"optim_func": stable_text(ctx.optim_func), "optim_args": stable_text(ctx.optim_args),
            "lr_scheduler_cls": stable_text(ctx.lr_scheduler_cls),
            "lr_scheduler_args": stable_text(ctx.lr_scheduler_args), "loss_func": stable_text(ctx.loss_func)}


def stable_text(value: Any) -> str:
    """`value` as a text that is the same in every process given the same value: a function or class by its
    qualified name (its repr holds a memory address), a partial with its arguments, a mapping sorted, numbers
    and strings by repr, any other object by its type (its contents are not compared)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, functools.partial):
        args = [stable_text(a) for a in value.args]
        args += [f"{k}={stable_text(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({stable_text(value.func)}, {', '.join(args)})"
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k!r}: {stable_text(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


# What decides which samples each data rank reads and how many steps an epoch has (`engine.build_dataloader`
# builds the sampler from them), compared as one text per rank. The other DataLoader keys (num_workers,
# pin_memory, collate_fn, ...) change how a rank loads its own samples, not which: they may differ between ranks.
_SAMPLER = "sampler (dataloader_args shuffle/seed/drop_last, distributed_sampler_cls)"
_SAMPLER_NOTE = ("these decide which samples each data rank reads and how many steps an epoch has: ranks given "
                 "different ones read some samples twice and others never (e.g. seed=rank), or run a step the "
                 "others never join")


def _sampler_text(ctx: ModelContext) -> str:
    """How the sampler of `ctx` is built, e.g. `DistributedSampler(shuffle=True, seed=0, drop_last=True)`, with
    the defaults written out (an absent key equals its default) and nothing that may differ between processes.

    The seed only where it is read: the default sampler reads it only to shuffle (so seed=rank without shuffling
    is harmless); a user's sampler class may read it anyway.
    """
    args = ctx.dataloader_args
    shuffle = args.get("shuffle", False)
    settings = [f"shuffle={shuffle!r}"]
    if shuffle or ctx.distributed_sampler_cls is not None:
        settings.append(f"seed={stable_repr(args.get('seed', 0))[:200]}")
    settings.append(f"drop_last={args.get('drop_last', True)!r}")
    return f"{stable_repr(ctx.distributed_sampler_cls or DistributedSampler)}({', '.join(settings)})"


def _validate_layout(ctx: ModelContext, strategy: Strategy, note_idle: bool = False) -> List[ResolvedOptimization]:
    """Resolve `strategy` for `ctx` and check that the global batch splits over its data ranks and chunks.

    `note_idle`: warn about each optimization that changes nothing under this layout (the search
    never proposes one; a user's strategy keeps it, e.g. FSDP on one GPU while debugging)."""
    vctx = validation_context(ctx)
    resolved = resolve_strategy(strategy, vctx)
    if note_idle:
        for r in resolved:
            why = type(r.optimization).changes_nothing(r.config, vctx)
            if why is not None:
                logger.warning("%s changes nothing here, applied as asked: %s", r.name, why)
    validate_resolved_layout(ctx.dataloader_args, vctx)
    return resolved
