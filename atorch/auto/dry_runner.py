"""Dry runs: apply a candidate strategy to a fresh copy of the model, train a few steps, measure.

Collective: every rank calls `dry_run` with the same strategy and every rank gets the same
`DryRunResult` (throughput from the slowest rank, the largest per-rank peak memory, the first
rank's error). A failure -- an exception, an out-of-memory error, the simulated device limit
(`memory_limit_bytes`, from ATORCH_DEVICE_MEMORY_LIMIT), a timeout -- is a failed trial, never a
crash of the search.

What is guaranteed, and how:
- Fresh state per candidate: the user's model is deep-copied before `apply` mutates it, the
  RNG state is restored afterwards and the parallel groups the candidate created are dropped.
- Ranks stay in step when only some fail (e.g. OOM on rank 0 while rank 1 waits in an
  all-reduce): on gloo each candidate runs in a fresh world process group, installed as the
  default group for the duration, and every group it creates gets `timeout_s`; a rank left
  waiting in a collective gets gloo's timeout error instead of hanging, and the possibly
  broken groups are never used again. Results are agreed on the untouched original group.
- A candidate stuck in Python code (a loop, a sleep) is interrupted by SIGALRM after
  `timeout_s` (main thread only). Not covered: a non-collective C++ call that never returns,
  and on nccl a rank left in a collective (NCCL's watchdog ends the process instead).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.search.search import DryRunResult
from atorch.auto.strategy import Strategy
from atorch.utils.peak_memory import PeakMemoryTracker, is_out_of_memory

logger = logging.getLogger(__name__)


class DryRunError(RuntimeError):
    """A strategy given with `ignore_dryrun_on_load_strategy=False` failed its dry run."""


class DryRunTimeout(BaseException):
    """Raised inside a dry run past its time budget; a BaseException so `except Exception` in the
    candidate's own code cannot swallow it."""


ALARM_GRACE_S = 3.0
# The optimizer state is allocated during the first step, so the steady-state peak (state plus
# activations plus gradients) first happens in the second: memory is measured over at least 2.
MIN_MEMORY_STEPS = 2


@dataclass(frozen=True)
class DryRunConfig:
    """How a candidate is run. Warm-up steps are measured for memory, profiled steps for time."""

    warmup_steps: int = 2
    """Untimed steps before timing, during which memory is measured (at least MIN_MEMORY_STEPS are run)."""
    profile_steps: int = 3
    """Timed steps; throughput = global batch * profile_steps / the slowest rank's seconds."""
    timeout_s: float = 300.0
    """Timeout of every process group a candidate creates (gloo); a Python-level hang is interrupted
    ALARM_GRACE_S later."""
    memory_limit_bytes: Optional[int] = None
    """Simulated per-rank device memory; crossing it is an out-of-memory error at that allocation."""

    def validate(self) -> "DryRunConfig":
        if self.warmup_steps < 1:
            raise ValueError(f"dry run warmup_steps={self.warmup_steps} must be >= 1 (ATORCH_DRYRUN_WARMUP_STEP): "
                             "memory is measured on the warm-up steps")
        if self.profile_steps < 1:
            raise ValueError(f"dry run profile_steps={self.profile_steps} must be >= 1 (ATORCH_DRYRUN_PROFILE_STEP)")
        if self.timeout_s <= 0:
            raise ValueError(f"dry run timeout_s={self.timeout_s} must be > 0 (ATORCH_DRYRUN_TIMEOUT)")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes={self.memory_limit_bytes} must be > 0 "
                             "(ATORCH_DEVICE_MEMORY_LIMIT, in bytes)")
        return self

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "DryRunConfig":
        """Read ATORCH_DRYRUN_WARMUP_STEP, ATORCH_DRYRUN_PROFILE_STEP, ATORCH_DRYRUN_TIMEOUT and
        ATORCH_DEVICE_MEMORY_LIMIT; for entry points only."""
        env = os.environ if environ is None else environ
        limit = _env_number(env, "ATORCH_DEVICE_MEMORY_LIMIT", None, int)
        return cls(warmup_steps=_env_number(env, "ATORCH_DRYRUN_WARMUP_STEP", cls.warmup_steps, int),
                   profile_steps=_env_number(env, "ATORCH_DRYRUN_PROFILE_STEP", cls.profile_steps, int),
                   timeout_s=_env_number(env, "ATORCH_DRYRUN_TIMEOUT", cls.timeout_s, float),
                   memory_limit_bytes=limit).validate()


def _env_number(env: Any, name: str, default: Any, kind: type) -> Any:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return kind(float(raw)) if kind is int else kind(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} must be a number") from e


@dataclass
class _LocalOutcome:
    """One rank's view of a candidate (picklable: it is all-gathered)."""

    rank: int
    error_kind: Optional[str] = None      # "oom" | "timeout" | "exception"
    message: str = ""
    peak_memory_bytes: Optional[int] = None
    seconds: Optional[float] = None
    samples: int = 0
    collective_timeout: bool = False      # waiting on a rank that failed, not a failure of its own


def dry_run(ctx: ModelContext, strategy: Strategy, config: DryRunConfig = DryRunConfig()) -> DryRunResult:
    """Run `strategy` on a fresh copy of `ctx`'s model on every rank; every rank returns the same result."""
    config.validate()
    outcome = _run_local(ctx, Strategy.from_any(strategy), config)
    outcomes = _gather(outcome)
    return merge_outcomes(outcomes, config.profile_steps)


def make_evaluator(ctx: ModelContext, config: DryRunConfig) -> Callable[[Strategy], DryRunResult]:
    """The search's evaluator: one collective dry run per call."""
    return lambda strategy: dry_run(ctx, strategy, config)


def check_strategy_runs(ctx: ModelContext, strategy: Strategy, config: Optional[DryRunConfig] = None) -> DryRunResult:
    """Validate, then dry-run a loaded strategy; raise `DryRunError` (on every rank) if it fails.

    Validation first, so a bad strategy raises the same ValueError as without the dry run,
    before any collective.
    """
    from atorch.auto.engine import resolve

    resolve(ctx, Strategy.from_any(strategy))
    result = dry_run(ctx, strategy, config or DryRunConfig.from_env())
    if not result.ok:
        raise DryRunError(f"strategy {Strategy.from_any(strategy).describe()} failed its dry run: {result.error}")
    logger.info("dry run of %s: %.4g samples/s, peak %s bytes per rank", Strategy.from_any(strategy).describe(),
                result.throughput, result.peak_memory_bytes)
    return result


# -- one rank -----------------------------------------------------------------------------------

def _run_local(ctx: ModelContext, strategy: Strategy, config: DryRunConfig) -> _LocalOutcome:
    from atorch.auto.engine import apply_strategy
    from atorch.auto.train_step import train_step

    outcome = _LocalOutcome(rank=adist.rank())
    layout = adist.parallel_config() if adist.is_parallel_group_created() else None
    candidate: Optional[ModelContext] = None
    result: Any = None
    tracker = PeakMemoryTracker(ctx.device, config.memory_limit_bytes)
    try:
        # Collectives time out first, so a rank waiting on a failed peer reports a collective
        # timeout rather than its own alarm; the alarm is for Python-level hangs.
        with _preserved_rng(ctx.device), _candidate_world(config.timeout_s) as world, \
                _alarm(config.timeout_s + ALARM_GRACE_S):
            try:
                with tracker:
                    candidate = fresh_context(ctx)
                    result = apply_strategy(candidate, strategy)
                    batches = _cycle(result)
                    for _ in range(max(config.warmup_steps, MIN_MEMORY_STEPS)):
                        train_step(result, next(batches))
                outcome.peak_memory_bytes = tracker.peak_bytes
                _synchronize(ctx.device)
                start = time.perf_counter()
                for _ in range(config.profile_steps):
                    train_step(result, next(batches))
                _synchronize(ctx.device)
                outcome.seconds = time.perf_counter() - start
                outcome.samples = int(result.args.get("global_batch_size") or 0)
                if world is not None:
                    world["clean"] = True
            except DryRunTimeout:
                outcome.error_kind, outcome.message = "timeout", f"exceeded {config.timeout_s:g} s"
            except Exception as e:  # noqa: BLE001 - every failure of a candidate is a failed trial
                _classify(outcome, e)
                logger.debug("dry run of %s failed on rank %d:\n%s", strategy.describe(), outcome.rank,
                             traceback.format_exc())
            finally:
                if outcome.peak_memory_bytes is None and tracker.current_peak_bytes:
                    outcome.peak_memory_bytes = tracker.current_peak_bytes
                # DDP-wrapped models must be gone before their groups are dropped.
                result = candidate = None
                gc.collect()
    except DryRunTimeout:   # the alarm fired during cleanup
        outcome.error_kind, outcome.message = outcome.error_kind or "timeout", outcome.message or "cleanup"
    finally:
        adist.destroy_parallel_group()
        if layout is not None:
            adist.create_parallel_group(layout)
    return outcome


def fresh_context(ctx: ModelContext) -> ModelContext:
    """A context with the user's inputs and a deep copy of the model (optimizations mutate both)."""
    return ModelContext(
        model=copy.deepcopy(ctx.model), optim_func=ctx.optim_func, optim_args=dict(ctx.optim_args),
        optim_param_func=ctx.optim_param_func, dataset=ctx.dataset, loss_func=ctx.loss_func,
        prepare_input=ctx.prepare_input, model_input_format=ctx.model_input_format,
        dataloader_args=dict(ctx.dataloader_args), lr_scheduler_cls=ctx.lr_scheduler_cls,
        lr_scheduler_args=dict(ctx.lr_scheduler_args), device=ctx.device)


def _cycle(result: Any) -> Iterator[Any]:
    loader = result.dataloader
    if loader is None:
        raise ValueError("a dry run needs batches: pass dataset= (and dataloader_args) to auto_accelerate")
    epoch = 0
    while True:
        sampler = result.args.get("sampler")
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the dataloader yields no batch on this rank (dataset smaller than the global batch?)")
        epoch += 1


def _classify(outcome: _LocalOutcome, error: BaseException) -> None:
    text = f"{type(error).__name__}: {error}".strip()
    if is_out_of_memory(error):
        outcome.error_kind, outcome.message = "oom", text
    elif _is_collective_timeout(error):
        outcome.error_kind, outcome.message, outcome.collective_timeout = "timeout", text, True
    else:
        outcome.error_kind, outcome.message = "exception", text
    outcome.message = outcome.message.splitlines()[0][:500] if outcome.message else outcome.message


def _is_collective_timeout(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, (RuntimeError, dist.DistBackendError)) and (
        "Timed out" in text or "timed out" in text or "Connection closed by peer" in text
        or "Connection reset by peer" in text)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _preserved_rng(device: torch.device) -> Iterator[None]:
    """A dry run consumes random numbers (init, dropout); the real training after the search must not notice."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    """Raise DryRunTimeout in the main thread after `timeout_s` (Python-level hangs)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _fire(signum: int, frame: Any) -> None:
        raise DryRunTimeout(f"dry run exceeded {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, _fire)
    # Re-fires every second until cancelled: a raise that lands in a weakref finalizer or a
    # __del__ is swallowed by the interpreter, and a one-shot alarm would then be lost.
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _candidate_world(timeout_s: float) -> Iterator[Optional[dict]]:
    """On gloo: a fresh world group with `timeout_s`, installed as the default group meanwhile.

    Groups the candidate creates (the DeviceMesh of parallel_mode, DeepSpeed's) are made from
    it and inherit the short timeout, so a rank waiting on a failed peer errors out instead of
    hanging, and a group left mid-collective is never reused by the next candidate or by the
    agreement, which runs on the original default group. Set `["clean"] = True` on the yielded
    dict when the candidate ran without error: its groups are then destroyed on the way out.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        yield None
        return
    c10d = dist.distributed_c10d
    timeout = datetime.timedelta(seconds=timeout_s)
    original = c10d._get_default_group()
    existing = set(c10d._world.pg_map)
    fresh = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout, backend="gloo")
    saved_timeout = c10d.default_pg_timeout
    c10d.default_pg_timeout = timeout      # read by new_group for groups created without a timeout
    c10d._update_default_pg(fresh)
    state = {"clean": False}
    try:
        yield state
    finally:
        c10d._update_default_pg(original)
        c10d.default_pg_timeout = saved_timeout
        if state["clean"]:
            # Each gloo group holds sockets to every peer; 30 candidates on 8 ranks would pile up
            # hundreds. Groups of a failed candidate may be mid-collective and are left alone.
            for pg in [pg for pg in c10d._world.pg_map if pg not in existing]:
                dist.destroy_process_group(pg)


# -- agreement ------------------------------------------------------------------------------------

def _gather(outcome: _LocalOutcome) -> List[_LocalOutcome]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered


def merge_outcomes(outcomes: List[_LocalOutcome], profile_steps: int) -> DryRunResult:
    """The one result every rank agrees on (pure, deterministic in the rank order)."""
    peaks = [o.peak_memory_bytes for o in outcomes if o.peak_memory_bytes is not None]
    peak = max(peaks) if peaks else None
    failed = [o for o in outcomes if o.error_kind is not None]
    if failed:
        # A rank that merely waited for a failed peer reports a collective timeout; the peer's
        # own error is the reason. Out-of-memory first: it is what the search acts on.
        own = [o for o in failed if not o.collective_timeout] or failed
        # A rank's timeout is usually the consequence of another rank's error: errors first.
        rank_of = {"oom": 0, "exception": 1, "timeout": 2}
        first = min(own, key=lambda o: (rank_of.get(o.error_kind, 1), o.rank))
        if first.error_kind == "timeout":
            error = "timeout" + (f": rank {first.rank}: {first.message}" if first.message else "")
        else:
            error = f"{first.error_kind}: rank {first.rank}: {first.message}"
        return DryRunResult(0.0, peak, error)
    seconds = max(o.seconds or 0.0 for o in outcomes)
    samples = outcomes[0].samples
    if seconds <= 0 or samples <= 0:
        return DryRunResult(0.0, peak, "exception: no samples were timed (global batch size unknown)")
    return DryRunResult(samples * profile_steps / seconds, peak, None, seconds / profile_steps)
