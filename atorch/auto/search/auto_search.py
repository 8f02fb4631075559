"""The automatic mode of `auto_accelerate`: default space -> cost model -> HEBO search of dry runs.

This is the entry point, so it is the one place that reads the search's environment variables:
BO_SG_MAX_IETR (max trials, default 30), RANDOM_SAMPLE (default 3), MAX_PATIENCE (default 8),
ATORCH_SEARCH_TIME_LIMIT (seconds, default none), ATORCH_SEARCH_REPORT_DIR (default
./atorch_search), ATORCH_DEVICE_MEMORY_LIMIT (bytes: prunes predictions and is enforced in dry
runs), ATORCH_DRYRUN_WARMUP_STEP, ATORCH_DRYRUN_PROFILE_STEP, ATORCH_DRYRUN_TIMEOUT.

Rank 0 plans; every rank dry-runs each candidate rank 0 broadcasts, so the planner's
randomness and clock never have to agree across ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.search.search import SearchResult, search_strategy
from atorch.auto.search.space import SearchSpace
from atorch.auto.strategy import Strategy

logger = logging.getLogger(__name__)

DEFAULT_REPORT_DIR = "atorch_search"
# On CPU the "device" is host RAM shared by the local ranks; leave room for the OS and the runtime.
CPU_MEMORY_FRACTION = 0.8


class SearchError(RuntimeError):
    """No candidate of the automatic search ran successfully."""


@dataclass(frozen=True)
class SearchOutcome:
    """What the automatic search chose, the same strategy on every rank; the rest is rank 0's."""

    strategy: Strategy
    reason: str
    result: Optional[SearchResult] = None          # rank 0
    report: Optional[Dict[str, str]] = None        # rank 0: paths of the table, plot and chosen strategy


@dataclass(frozen=True)
class SearchSettings:
    """The knobs of the automatic search, read from the environment once."""

    max_trials: int = 30
    random_samples: int = 3
    patience: int = 8
    time_limit_s: Optional[float] = None
    report_dir: str = DEFAULT_REPORT_DIR
    memory_limit_bytes: Optional[int] = None     # None: the device's memory

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None) -> "SearchSettings":
        env = os.environ if environ is None else environ

        def number(name: str, default: Any, kind: type) -> Any:
            raw = env.get(name)
            if raw in (None, ""):
                return default
            try:
                return kind(float(raw)) if kind is int else kind(raw)
            except ValueError as e:
                raise ValueError(f"environment variable {name}={raw!r} must be a number") from e

        settings = cls(max_trials=number("BO_SG_MAX_IETR", cls.max_trials, int),
                       random_samples=number("RANDOM_SAMPLE", cls.random_samples, int),
                       patience=number("MAX_PATIENCE", cls.patience, int),
                       time_limit_s=number("ATORCH_SEARCH_TIME_LIMIT", None, float),
                       report_dir=env.get("ATORCH_SEARCH_REPORT_DIR") or DEFAULT_REPORT_DIR,
                       memory_limit_bytes=number("ATORCH_DEVICE_MEMORY_LIMIT", None, int))
        if settings.max_trials < 1 or settings.random_samples < 0 or settings.patience < 1:
            raise ValueError(f"BO_SG_MAX_IETR={settings.max_trials} must be >= 1, RANDOM_SAMPLE="
                             f"{settings.random_samples} >= 0 and MAX_PATIENCE={settings.patience} >= 1")
        return settings


def search_for_context(ctx: ModelContext, excluded: Optional[Sequence[str]] = None,
                       included: Optional[Sequence[str]] = None, report_path: Optional[str] = None) -> SearchOutcome:
    """Find the fastest strategy for `ctx` that fits; the same `Strategy` is returned on every rank.

    Writes the trial table (trials.csv), the plot (search.png) and the winner
    (best_strategy.json) to `report_path` (a directory, or the PNG's path) on rank 0.
    Raises SearchError when no candidate ran.
    """
    from atorch.auto.dry_runner import DryRunConfig, make_evaluator

    settings = SearchSettings.from_env()
    dry_config = DryRunConfig.from_env()
    world_size = adist.world_size()
    space = SearchSpace.default_for(ctx.model, world_size, ctx.device.type).restricted(excluded, included)
    batch_size = int(ctx.dataloader_args.get("batch_size", 1))
    seq_len = infer_seq_len(ctx.dataset)
    memory_limit = settings.memory_limit_bytes or device_memory_bytes(ctx.device)
    predictor = make_predictor(ctx.model, batch_size, seq_len, world_size, ctx.device)
    evaluate = make_evaluator(ctx, dry_config)
    layout = adist.parallel_config() if adist.is_parallel_group_created() else None

    if adist.rank() == 0:
        logger.info("searching %s (%d valid candidates), memory limit %s bytes per rank", space,
                    len(space.candidates()), memory_limit)
        try:
            result = search_strategy(
                space, _leader_evaluator(evaluate), max_trials=settings.max_trials,
                random_samples=settings.random_samples, patience=settings.patience, predictor=predictor,
                memory_limit_bytes=memory_limit, time_limit_s=settings.time_limit_s, batch_size=batch_size,
                progress=True)
        except BaseException as e:
            _broadcast(("error", f"{type(e).__name__}: {e}"))
            raise
        _broadcast(("done", result.best, result.reason))
        directory, plot_name = _report_location(report_path or settings.report_dir)
        paths = write_search_report(result, directory, plot_name)
        logger.info("chosen strategy: %s\n%s\ntrial table: %s, plot: %s", result.best.describe() if result.best
                    else None, result.reason, paths["table"], paths["plot"])
        best, reason, found, report = result.best, result.reason, result, paths
    else:
        (best, reason), found, report = _follow(evaluate), None, None
    if layout is not None and not adist.is_parallel_group_created():
        adist.create_parallel_group(layout)
    if best is None:
        raise SearchError(f"no strategy ran in the automatic search: {reason}")
    return SearchOutcome(best, reason, found, report)


def make_predictor(model: Any, batch_size: int, seq_len: int, world_size: int,
                   device: torch.device) -> Callable[[Strategy], Any]:
    """The cost model bound to this run's model shape, batch and world."""
    from atorch.auto.cost_model import ModelShape, estimate

    shape = ModelShape.from_module(model)
    return lambda strategy: estimate(shape, strategy, batch_size, seq_len, world_size, device)


def infer_seq_len(dataset: Any) -> int:
    """The sequence length of the dataset's first sample (its input_ids, else its first tensor); 1 if none."""
    if dataset is None:
        return 1
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - an iterable dataset: the cost model then sees one token a sample
        return 1
    if isinstance(sample, dict):
        tensors = [sample.get("input_ids")] + list(sample.values())
    elif isinstance(sample, (list, tuple)):
        tensors = list(sample)
    else:
        tensors = [sample]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[-1])
    return 1


def device_memory_bytes(device: torch.device) -> int:
    """Per-rank memory: the GPU's, or on CPU a fraction of host RAM shared by the local ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", adist.world_size()))
    return int(total * CPU_MEMORY_FRACTION / max(1, local))


def write_search_report(result: SearchResult, directory: str, plot_name: str = "search.png") -> Dict[str, str]:
    from atorch.auto.search.report import write_report

    paths = write_report(result, directory)
    if plot_name != "search.png":
        target = os.path.join(directory, plot_name)
        os.replace(paths["plot"], target)
        paths["plot"] = target
    return paths


def _report_location(path: str) -> tuple:
    if path.lower().endswith(".png"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return path, "search.png"


# -- rank 0 leads, the others follow ---------------------------------------------------------------

def _broadcast(message: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _leader_evaluator(evaluate: Callable[[Strategy], Any]) -> Callable[[Strategy], Any]:
    def run(strategy: Strategy) -> Any:
        _broadcast(("run", strategy))
        return evaluate(strategy)

    return run


def _follow(evaluate: Callable[[Strategy], Any]) -> tuple:
    while True:
        message = _broadcast(None)
        if message[0] == "run":
            evaluate(message[1])
        elif message[0] == "done":
            return message[1], message[2]
        else:
            raise SearchError(f"the search failed on rank 0: {message[1]}")
