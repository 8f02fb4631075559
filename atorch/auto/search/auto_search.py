"""The automatic mode of `auto_accelerate`: default space -> cost model -> HEBO search of dry runs.

This is the entry point, so it is the one place that reads the search's environment variables:
BO_SG_MAX_IETR (max trials, default 30), RANDOM_SAMPLE (default 3), MAX_PATIENCE (default 8),
ATORCH_SEARCH_TIME_LIMIT (seconds, default none), ATORCH_SEARCH_REPORT_DIR (default
./atorch_search), ATORCH_SEARCH_CACHE (the results cache file; default search_cache.json in the
report directory; "off" disables it), ATORCH_DEVICE_MEMORY_LIMIT (bytes: prunes predictions and
is enforced in dry runs), and the dry runner's (`DryRunConfig.from_env`).

Rank 0 plans; every rank dry-runs each candidate rank 0 broadcasts, so the planner's
randomness and clock never have to agree across ranks. While the search runs, the user's
weights wait in a scratch file and every candidate is built from it (`ModelSource`): the
search needs no second copy of the model. Rank 0 remembers every measurement in the results
cache (`cache.py`); a search on the same setup and space then runs one confirming dry run of
the remembered winner instead of a search, and says so in its reason line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import pandas as pd
import torch
import torch.distributed as dist

from atorch import distributed as adist
from atorch.auto.cost_model.optimizer import OptimizerStates, optimizer_states
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import DataSetup
from atorch.auto.search.cache import CACHE_FILE_NAME, SearchCache, optimizer_description, setup_key, space_signature
from atorch.auto.search.search import TRIAL_COLUMNS, DryRunResult, SearchResult, search_strategy
from atorch.auto.search.space import SearchSpace
from atorch.auto.strategy import Strategy
from atorch.utils.env import check_output_location, env_float, env_int, env_str
from atorch.utils.finite_numbers import is_finite_number

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
    cache_path: Optional[str] = None             # None: search_cache.json in the report directory
    cache_enabled: bool = True

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None) -> "SearchSettings":
        env = os.environ if environ is None else environ

        cache = env_str("ATORCH_SEARCH_CACHE", None, env)
        cache_enabled = (cache or "").strip().lower() not in ("off", "0", "false", "none")
        settings = cls(max_trials=env_int("BO_SG_MAX_IETR", cls.max_trials, env),
                       random_samples=env_int("RANDOM_SAMPLE", cls.random_samples, env),
                       patience=env_int("MAX_PATIENCE", cls.patience, env),
                       time_limit_s=env_float("ATORCH_SEARCH_TIME_LIMIT", None, env),
                       report_dir=env_str("ATORCH_SEARCH_REPORT_DIR", DEFAULT_REPORT_DIR, env) or DEFAULT_REPORT_DIR,
                       memory_limit_bytes=env_int("ATORCH_DEVICE_MEMORY_LIMIT", None, env),
                       cache_path=cache if cache_enabled else None, cache_enabled=cache_enabled)
        bad = [f"{name}={value} must be >= {least} ({what})" for name, value, least, what in (
            ("BO_SG_MAX_IETR", settings.max_trials, 1, "the search's dry runs"),
            ("RANDOM_SAMPLE", settings.random_samples, 0, "spread-out candidates tried first"),
            ("MAX_PATIENCE", settings.patience, 1, "trials without improvement before the search stops"))
               if value < least]
        if bad:
            raise ValueError("environment variable " + "; ".join(bad))
        if settings.time_limit_s is not None and settings.time_limit_s <= 0:
            raise ValueError(f"environment variable ATORCH_SEARCH_TIME_LIMIT={settings.time_limit_s!r} must be a "
                             "positive number of seconds (unset: no limit)")
        if settings.memory_limit_bytes is not None and settings.memory_limit_bytes <= 0:
            raise ValueError(f"environment variable ATORCH_DEVICE_MEMORY_LIMIT={settings.memory_limit_bytes!r} must "
                             "be a positive number of bytes per rank (unset: the device's memory)")
        # Paths are checked here, on every rank, not when rank 0 first writes (after a dry run has been spent).
        if env_str("ATORCH_SEARCH_REPORT_DIR", None, env) is not None:
            report = settings.report_dir
            png = report.lower().endswith(".png")   # the plot's path, in the directory that holds the report
            check_output_location("ATORCH_SEARCH_REPORT_DIR", os.path.dirname(os.path.abspath(report)) if png
                                  else report, directory=True)
        if settings.cache_path is not None:
            _check_cache_location(settings.cache_path)
        return settings


def _check_cache_location(path: str) -> None:
    """The results cache can be written, or at least read: an existing cache file where nothing can be
    written (a shared, read-only copy) is used as it is, with a warning; anything else that cannot be
    written is a ValueError now, before any dry run is spent."""
    try:
        check_output_location("ATORCH_SEARCH_CACHE", path, directory=False)
    except ValueError as e:
        if not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise
        logger.warning("%s: the results cache is read, not updated, by this search", e)


def search_for_context(ctx: ModelContext, excluded: Optional[Sequence[str]] = None,
                       included: Optional[Sequence[str]] = None, report_path: Optional[str] = None) -> SearchOutcome:
    """Find the fastest strategy for `ctx` that fits; the same `Strategy` is returned on every rank.

    Writes the trial table (trials.csv), the plot (search.png) and the winner
    (best_strategy.json) to `report_path` (a directory, or the PNG's path) on rank 0.
    Raises SearchError when no candidate ran.
    """
    from atorch.auto.dry_runner import DryRunConfig, make_evaluator
    from atorch.auto.model_source import ModelSource

    check_searchable(ctx)
    settings = SearchSettings.from_env()
    dry_config = DryRunConfig.from_env()
    world_size = adist.world_size()
    batch_size = int(ctx.dataloader_args.get("batch_size", 1))
    space = SearchSpace.default_for(ctx.model, world_size, ctx.device.type, global_batch_size=batch_size,
                                    loss_func_given=ctx.loss_func is not None, data=DataSetup.of(ctx),
                                    ranks_per_node=ranks_per_node(world_size)).restricted(excluded, included)
    space.candidates()   # validated against the real model, before its weights are offloaded
    seq_len = infer_seq_len(ctx.dataset)
    memory_limit = settings.memory_limit_bytes or device_memory_bytes(ctx.device)
    predictor = make_predictor(ctx.model, batch_size, seq_len, world_size, ctx.device,
                               optimizer_states(ctx.optim_func, ctx.optim_args))
    directory, plot_name = _report_location(report_path or settings.report_dir)
    found: Optional[SearchResult] = None
    report: Optional[Dict[str, str]] = None
    with ModelSource(ctx.model, dry_config.scratch_dir) as source:
        evaluate = make_evaluator(ctx, dry_config, source)
        if adist.rank() == 0:
            # Everything rank 0 does alone is inside this try: the other ranks wait in _follow
            # for its next message, so any failure here must reach them as one.
            try:
                cache = _open_cache(settings, directory, ctx, world_size, batch_size, seq_len)
                logger.info("searching %s (%d valid candidates), memory limit %s bytes per rank", space,
                            len(space.candidates()), memory_limit)
                result = _search_or_confirm(space, _leader_evaluator(evaluate), cache, settings, predictor,
                                            memory_limit, batch_size, memory_limit_source(settings, ctx.device))
            except BaseException as e:
                _broadcast(("error", f"{type(e).__name__}: {e}"))
                raise
            _broadcast(("done", result.best, result.reason))
            best, reason = result.best, result.reason
        else:
            best, reason = _follow(evaluate)
    if adist.rank() == 0:
        found, report = result, _write_report_or_warn(result, directory, plot_name)
    if best is None:
        # The reason line of a search where nothing ran starts "no strategy ran" itself.
        raise SearchError(f"the automatic search found no strategy: {reason}")
    return SearchOutcome(best, reason, found, report)


def check_searchable(ctx: ModelContext) -> None:
    """ValueError unless the automatic search can time `ctx`'s training: its dry runs time optimizer
    steps, so it needs the optimizer (`optim_func`). Raised on every rank alike (the same arguments),
    before anything is built or dry-run."""
    if ctx.optim_func is None:
        raise ValueError("auto_accelerate: optim_func=None, but without load_strategy auto_accelerate searches for "
                         "a strategy by timing training steps, optimizer step included, so it needs the optimizer; "
                         "pass optim_func (e.g. optim_func=torch.optim.AdamW), or a fixed load_strategy (e.g. "
                         "load_strategy=['amp_native']) to prepare the model for a training loop of your own")


def _open_cache(settings: SearchSettings, directory: str, ctx: ModelContext, world_size: int, batch_size: int,
                seq_len: int) -> Optional[SearchCache]:
    if not settings.cache_enabled:
        return None
    path = settings.cache_path or os.path.join(directory, CACHE_FILE_NAME)
    return SearchCache.load(path, setup_key(ctx.model, world_size, ctx.device, batch_size, seq_len,
                                            optimizer_description(ctx.optim_func, ctx.optim_args),
                                            ranks_per_node(world_size)))


def _write_report_or_warn(result: SearchResult, directory: str, plot_name: str) -> Optional[Dict[str, str]]:
    """Rank 0: the report's paths, or None with a warning when it cannot be written.

    The other ranks already have the winner and are on their way to training: a report that
    cannot be written (disk full, a plotting failure) must not raise on rank 0 alone, where it
    would leave them waiting in the first collective of training."""
    try:
        paths = write_search_report(result, directory, plot_name)
    except Exception as e:      # noqa: BLE001  (any failure of an auxiliary output, see above)
        logger.warning("could not write the search report to %s (%s: %s); the search result stands: %s",
                       directory, type(e).__name__, e, result.reason)
        return None
    logger.info("chosen strategy: %s\n%s\ntrial table: %s, plot: %s", result.best.describe() if result.best
                else None, result.reason, paths["table"], paths["plot"])
    return paths


def _search_or_confirm(space: SearchSpace, evaluate: Callable[[Strategy], DryRunResult],
                       cache: Optional[SearchCache], settings: SearchSettings,
                       predictor: Optional[Callable[[Strategy], Any]],
                       memory_limit: int, batch_size: int, limit_source: str = "") -> SearchResult:
    """Rank 0: one confirming dry run of the cached winner if there is one, else the search.

    A confirmation that fails (the winner no longer runs) falls back to a full search, which
    still reuses the cached measurements of the other candidates. `limit_source` (`memory_limit_source`)
    is said in the reason line next to the limit when candidates were not run for memory.
    """
    candidates = space.candidates()
    signature = space_signature([c.label() for c in candidates], memory_limit)
    just_measured: Dict[str, DryRunResult] = {}     # the failed confirmation, if any: measured now
    if cache is not None:
        best = cache.cached_best(signature, {c.strategy for c in candidates})
        if best is not None:
            remembered = cache.get(best)
            started = time.monotonic()
            confirmed = evaluate(best)
            seconds = time.monotonic() - started
            cache.put(best, confirmed)
            cache.save()
            if confirmed.ok:
                return _confirmed_result(cache, best, confirmed, remembered, memory_limit, seconds)
            logger.warning("the cached winner %s failed its confirming dry run (%s): searching again", best.describe(),
                           confirmed.error)
            just_measured[best.to_json()] = confirmed
        served: List[bool] = []
        evaluate = _cached_evaluator(evaluate, cache, served, just_measured, settings.memory_limit_bytes)
    result = search_strategy(
        space, evaluate, max_trials=settings.max_trials, random_samples=settings.random_samples,
        patience=settings.patience, predictor=predictor, memory_limit_bytes=memory_limit,
        time_limit_s=settings.time_limit_s, batch_size=batch_size, progress=True, memory_limit_source=limit_source)
    if cache is not None:
        _mark_served(result, served, cache.path)
        cache.record_search(result.best, signature, _records(result.trials), _records(result.pruned), result.reason,
                            result.stop_reason, result.num_candidates)
        cache.save()
    return result


def _cached_evaluator(evaluate: Callable[[Strategy], DryRunResult], cache: SearchCache, served: List[bool],
                      just_measured: Optional[Dict[str, DryRunResult]] = None,
                      enforced_limit_bytes: Optional[int] = None) -> Callable[[Strategy], DryRunResult]:
    """Serves remembered successful results without a dry run; remembers (and saves) every new one.
    `served` gets one flag per call: whether the cache answered it. `just_measured` (strategy JSON ->
    result) holds dry runs of this process served as they are, failures included (a confirmation
    that just failed): they were measured now, so they are not counted as served by the cache.

    `enforced_limit_bytes` is the memory limit this search's dry runs enforce (ATORCH_DEVICE_MEMORY_LIMIT,
    None when unset): a remembered success whose measured peak is above it is served as the out-of-memory
    result such a dry run gives, its peak kept for the memory model (`_served_under_limit`); it was measured
    under another limit, and served as a success it could win a search it does not fit.

    Only a strategy's first evaluation in this search may come from the cache: the search asks
    again for a strategy only to re-measure it (the interleaved top-two comparison), and serving
    the remembered numbers a second time would count one measurement twice. A remembered failure
    is run again: the code that raised (a loss function, a model) is not part of the cache's key
    and may have been fixed since, and an out-of-memory run depends on the memory limit of its
    search (`ATORCH_DEVICE_MEMORY_LIMIT`), which the per-strategy results do not record.
    """
    asked: set = set()

    def run(strategy: Strategy) -> DryRunResult:
        key = strategy.to_json()
        first_time = key not in asked
        asked.add(key)
        cached = cache.get(strategy) if first_time else None
        if first_time and just_measured and key in just_measured:
            served.append(False)
            return just_measured[key]
        served.append(cached is not None and cached.ok)
        if served[-1]:
            return _served_under_limit(cast(DryRunResult, cached), enforced_limit_bytes, cache.path)
        result = evaluate(strategy)
        cache.put(strategy, result)
        cache.save()      # after every trial: an interrupted search resumes from here
        return result

    return run


def _served_under_limit(cached: DryRunResult, limit_bytes: Optional[int], path: str) -> DryRunResult:
    """`cached`, or when its measured peak is above `limit_bytes`, the out-of-memory result a dry run
    under that limit gives (the dry runner's tracker raises at the allocation that crosses it): status
    "oom", throughput 0, the peak kept, so the search prunes what needs as much and learns the memory
    scale from it. A result without a peak is served as it is (nothing says it does not fit). The dry
    run also counts what of the user's model stayed on the device (`ModelSource.resident_bytes`,
    normally nothing: it is offloaded); the remembered peak does not hold it."""
    peak = cached.peak_memory_bytes
    if limit_bytes is None or not cached.ok or peak is None or peak <= limit_bytes:
        return cached
    return DryRunResult(0.0, peak, f"oom: measured peak {peak} bytes (remembered in {path}) > memory limit "
                                   f"{limit_bytes} bytes (ATORCH_DEVICE_MEMORY_LIMIT)")


def _mark_served(result: SearchResult, served: List[bool], path: str) -> None:
    """Say which trials the results cache answered: their `source` gains " (cached)", and the reason
    line counts them (a search that ran few or no dry runs would otherwise look like one that did)."""
    count = sum(served)
    if not count or len(served) != len(result.trials):
        return
    sources = result.trials["source"] if "source" in result.trials else [""] * len(served)
    result.trials["source"] = [f"{s} (cached)".strip() if hit else s for s, hit in zip(sources, served)]
    result.reason += f"; {count} of {len(served)} trial(s) served from the results cache {path}"


def _confirmed_result(cache: SearchCache, best: Strategy, confirmed: DryRunResult, remembered: Optional[DryRunResult],
                      memory_limit: int, seconds: Optional[float] = None) -> SearchResult:
    """The cached search's result, its trial table extended by the confirming dry run (its interval,
    its seconds, and the predictions the search that chose it made for the winner).

    When the confirmation's interval misses the remembered one, the reason says so: the
    machine's load or the setup changed, and the user may want to search again."""
    last = cache.last_search or {}
    trials = pd.DataFrame(last.get("trials") or [])
    ci = confirmed.throughput_ci
    row: Dict[str, Any] = {"trial": len(trials) + 1, "strategy": best.describe(), "status": confirmed.status,
                           "throughput": confirmed.throughput, "throughput_lo": ci[0] if ci else None,
                           "throughput_hi": ci[1] if ci else None, "measured_memory": confirmed.peak_memory_bytes,
                           "reason": confirmed.error or "", "seconds": seconds, "source": "cache-confirm"}
    if len(trials) and "strategy" in trials:
        earlier = trials[trials["strategy"] == best.describe()]
        for column in ("predicted_throughput", "predicted_memory"):
            if column in earlier and len(earlier):
                row[column] = earlier[column].iloc[-1]
    trials = pd.concat([trials, pd.DataFrame([row])], ignore_index=True) if len(trials) else pd.DataFrame([row])
    # Every column of a search's table, whatever the cache held (a hand-edited file may lack some).
    trials = trials.reindex(columns=list(dict.fromkeys(TRIAL_COLUMNS + list(trials.columns))))
    interval = f" (95% CI {ci[0]:.4g}-{ci[1]:.4g})" if ci else ""
    drift = ""
    if remembered is not None and remembered.ok and not _overlap(confirmed.throughput_ci, remembered.throughput_ci):
        drift = (f" (remembered {remembered.throughput:.4g} samples/s, outside this run's interval: the load "
                 "between runs, or the machine or setup changed since; ATORCH_SEARCH_CACHE=off searches again)")
    rival = _fastest_other(last.get("trials") or [], best.describe())
    if rival is not None and confirmed.throughput < rival[1]:
        # The old verdict below compared runs made together; this one is not one of them.
        drift += (f"; now below the remembered {rival[0]} ({rival[1]:.4g} samples/s, measured in the earlier "
                  "search: the comparison below is that search's)")
    reason = (f"{best.describe()}: remembered from {cache.path} and confirmed by 1 dry run, "
              f"{confirmed.throughput:.4g} samples/s{interval}{drift}; the search that chose it: "
              f"{last.get('reason', '')}")
    return SearchResult(best, confirmed.throughput, trials, pd.DataFrame(last.get("pruned") or []), [best],
                        "confirmed the cached winner (1 dry run)", int(last.get("num_candidates") or 0),
                        memory_limit, reason)


def _fastest_other(trials: List[Dict[str, Any]], winner: str) -> Optional[Tuple[str, float]]:
    """(strategy, throughput) of the fastest successful trial of the remembered search other than `winner`."""
    best: Optional[Tuple[str, float]] = None
    for row in trials:
        value = row.get("throughput")
        if row.get("status") != "ok" or row.get("strategy") == winner or not is_finite_number(value):
            continue
        if best is None or float(cast(float, value)) > best[1]:
            best = (str(row.get("strategy")), float(cast(float, value)))
    return best


def _overlap(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """Whether two intervals overlap; True when either is unknown (nothing to contradict)."""
    return a is None or b is None or (a[0] <= b[1] and b[0] <= a[1])


def _records(frame: pd.DataFrame) -> list:
    return json.loads(frame.to_json(orient="records")) if len(frame) else []


def make_predictor(model: Any, batch_size: int, seq_len: int, world_size: int, device: torch.device,
                   optimizer: Optional[OptimizerStates] = None) -> Optional[Callable[[Strategy], Any]]:
    """The cost model bound to this run's model shape, batch and world (gradient accumulation
    included), refitted on every dry run of the search (`LearningPredictor`: per-option
    corrections learned from the candidates that ran move the ranking of those that have not;
    on benchmarks/real_landscape.json held-out Kendall tau 0.535 -> 0.76 after 8 dry runs, 0.85
    after 16). Built-in device constants: the probes did not rank better on this machine
    (benchmarks/RESULTS.md, "Step-time calibration"). `optimizer`: what the user's optimizer keeps
    per parameter (Adam's by default)."""
    from atorch.auto.calibration import LearningPredictor, cost_model_predictor

    try:
        predictor = cost_model_predictor(model, batch_size, seq_len, world_size, device, optimizer=optimizer)
    except ValueError as e:
        # A layout the cost model has no formula for (a config without attention heads, as Mamba's): the search
        # still runs, on measurements alone (the `none` predictor of benchmarks/search.py), and learns memory
        # from the measured peaks. The same on every rank: the shape is read from the same model and config.
        logger.warning("the cost model cannot describe %s (%s): the search runs without its predictions, on dry "
                       "runs alone", type(model).__name__, e)
        return None
    return LearningPredictor(predictor)


def infer_seq_len(dataset: Any) -> int:
    """The sequence length of the dataset's first sample (its input_ids, else its first tensor); 1 if none.

    Token ids (integer tensors) are [..., seq]; a floating tensor is one sample's features ([features]: one
    position) or a sequence of feature vectors ([seq, features]); any other layout (images) counts as one
    position. The cost model multiplies per-position activations by it: reading a feature width as a length
    predicted a small MLP's activations 3x over."""
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
            if not t.is_floating_point():
                return int(t.shape[-1])
            return int(t.shape[0]) if t.dim() == 2 else 1
    return 1


def ranks_per_node(world_size: int) -> Optional[int]:
    """Ranks per node when the job spans several nodes (the launcher's LOCAL_WORLD_SIZE, the same on
    every node), else None: the space then keeps tensor splits inside one node."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or not 0 < int(local) < world_size:
        return None
    return int(local)


def memory_limit_source(settings: SearchSettings, device: torch.device) -> str:
    """Where the search's memory limit comes from, for the reason line: the user's
    ATORCH_DEVICE_MEMORY_LIMIT (with its value: the first thing to change when nothing fits), else the
    device's memory (`device_memory_bytes`)."""
    if settings.memory_limit_bytes is not None:
        return f"ATORCH_DEVICE_MEMORY_LIMIT={settings.memory_limit_bytes}"
    if torch.device(device).type == "cuda":
        return "the device's memory; ATORCH_DEVICE_MEMORY_LIMIT sets another"
    return f"{CPU_MEMORY_FRACTION:.0%} of host RAM over the local ranks; ATORCH_DEVICE_MEMORY_LIMIT sets another"


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
