"""Dry runs: apply a candidate strategy to a fresh copy of the model, train and time steps, measure.

Collective: every rank calls `dry_run` with the same strategy and every rank gets the same
`DryRunResult` (throughput from the slowest rank, the largest per-rank peak memory, and when
ranks failed one rank's error: an out-of-memory error first, then an exception, then a timeout,
the lowest rank among equals, skipping ranks that only timed out waiting on a failed peer while
another rank has an error of its own: `merge_outcomes`). A failure -- an exception, an
out-of-memory error, the simulated device limit (`memory_limit_bytes`, from
ATORCH_DEVICE_MEMORY_LIMIT), a timeout, a NaN or infinite loss (checked once per run:
`FiniteLossCheck`) -- is a failed trial, never a crash of the search nor a measured throughput.

What is guaranteed, and how:
- Fresh state per candidate, without a second copy of the weights: the user's weights wait in a
  scratch file while candidates are built from it (`model_source.ModelSource`), the RNG state is
  restored afterwards, and the candidate's parallel groups live on its own context (nothing
  process-wide is saved or restored; its gloo groups are destroyed after a clean run). The simulated
  device limit counts whatever of the user's model is still on the device (nothing, normally).
- Time with a stated uncertainty: steps are timed until the 95% confidence half-width of the
  step time is <= `target_relative_ci` or a budget is spent (`step_timing`); the result carries
  the per-step times and the throughput interval.
- Ranks stay in step when only some fail (e.g. OOM on rank 0 while rank 1 waits in an
  all-reduce): on gloo each candidate runs in a fresh world process group, installed as the
  default group for the duration, and every group it creates gets `timeout_s` (in a search,
  after its first clean dry run, about 3 clean dry runs' time: `make_evaluator`); a rank left
  waiting in a collective gets gloo's timeout error instead of hanging, and the possibly
  broken groups are never used again. Results are agreed on the untouched original group.
- A candidate stuck in Python code (a loop, a sleep) is interrupted by SIGALRM after
  `timeout_s` (main thread only). Not covered: a non-collective C++ call that never returns,
  and on nccl a rank left in a collective (NCCL's watchdog ends the process instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from atorch import distributed as adist
from atorch.auto.model_context import ModelContext
from atorch.auto.model_source import ModelSource
from atorch.auto.search.search import DryRunResult
from atorch.auto.step_timing import PILOT_SAMPLES, is_precise_enough, steps_per_sample, summarize
from atorch.auto.strategy import Strategy
from atorch.auto.user_errors import UserCodeError, as_text
from atorch.utils.env import check_output_location, env_float, env_int, env_str
from atorch.utils.peak_memory import PeakMemoryTracker, is_out_of_memory
from atorch.utils.quiet import candidate_logs_quieted

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
    """How a candidate is run. Warm-up steps are measured for memory, then steps are timed until
    the step time is known to `target_relative_ci` or a budget is spent (`atorch.auto.step_timing`)."""

    warmup_steps: int = 2
    """Untimed steps before timing, during which memory is measured (at least MIN_MEMORY_STEPS are run)."""
    profile_steps: int = PILOT_SAMPLES
    """Timed samples at least, before the interval is checked (a sample is one step, or several if
    short); their spread fixes the reported interval (Stein's pilot, `atorch.auto.step_timing`)."""
    max_profile_steps: int = 40
    """The step budget: timing stops after this many timed steps even if the interval is still wide."""
    max_profile_seconds: float = 60.0
    """The time budget of the timed steps (the slowest rank's seconds, so every rank stops together)."""
    target_relative_ci: float = 0.03
    """Stop once the 95% confidence half-width of the mean step time is <= this fraction of it."""
    scratch_dir: Optional[str] = None
    """Where the user's weights wait during dry runs (one file per rank, the model's size); None: the temp dir."""
    timeout_s: float = 300.0
    """Timeout of every process group a candidate creates (gloo); a Python-level hang is interrupted
    ALARM_GRACE_S later."""
    memory_limit_bytes: Optional[int] = None
    """Simulated per-rank device memory; crossing it is an out-of-memory error at that allocation."""
    peer_wait_s: Optional[float] = None
    """How long a collective of the candidate waits for a peer (gloo); None: `timeout_s`. The search's
    evaluator shortens it after its first clean dry run (`make_evaluator`)."""
    peer_wait_floor_s: float = 60.0
    """The shortest peer wait the search's evaluator sets."""

    def validate(self) -> "DryRunConfig":
        if self.warmup_steps < 1:
            raise ValueError(f"dry run warmup_steps={self.warmup_steps} must be >= 1 (ATORCH_DRYRUN_WARMUP_STEP): "
                             "memory is measured on the warm-up steps")
        if self.profile_steps < 1:
            raise ValueError(f"dry run profile_steps={self.profile_steps} must be >= 1 (ATORCH_DRYRUN_PROFILE_STEP)")
        if self.max_profile_steps < self.profile_steps:
            raise ValueError(f"dry run max_profile_steps={self.max_profile_steps} must be >= profile_steps="
                             f"{self.profile_steps} (ATORCH_DRYRUN_MAX_STEPS, ATORCH_DRYRUN_PROFILE_STEP)")
        if self.max_profile_seconds <= 0:
            raise ValueError(f"dry run max_profile_seconds={self.max_profile_seconds} must be > 0 "
                             "(ATORCH_DRYRUN_MAX_SECONDS)")
        if not 0 <= self.target_relative_ci < 1:
            raise ValueError(f"dry run target_relative_ci={self.target_relative_ci} must be in [0, 1) "
                             "(ATORCH_DRYRUN_TARGET_CI; 0 times every step of the budget)")
        if self.timeout_s <= 0:
            raise ValueError(f"dry run timeout_s={self.timeout_s} must be > 0 (ATORCH_DRYRUN_TIMEOUT)")
        if self.peer_wait_s is not None and not 0 < self.peer_wait_s <= self.timeout_s:
            raise ValueError(f"dry run peer_wait_s={self.peer_wait_s} must be > 0 and <= timeout_s={self.timeout_s}")
        if self.peer_wait_floor_s <= 0:
            raise ValueError(f"dry run peer_wait_floor_s={self.peer_wait_floor_s} must be > 0")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes={self.memory_limit_bytes} must be > 0 "
                             "(ATORCH_DEVICE_MEMORY_LIMIT, in bytes)")
        if self.scratch_dir is not None:
            check_output_location("ATORCH_DRYRUN_SCRATCH_DIR", self.scratch_dir, directory=True)
        return self

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "DryRunConfig":
        """Read ATORCH_DRYRUN_WARMUP_STEP, ATORCH_DRYRUN_PROFILE_STEP, ATORCH_DRYRUN_MAX_STEPS,
        ATORCH_DRYRUN_MAX_SECONDS, ATORCH_DRYRUN_TARGET_CI, ATORCH_DRYRUN_TIMEOUT,
        ATORCH_DRYRUN_SCRATCH_DIR and ATORCH_DEVICE_MEMORY_LIMIT; for entry points only."""
        env = os.environ if environ is None else environ
        limit = env_int("ATORCH_DEVICE_MEMORY_LIMIT", None, env)
        budget = env_int("ATORCH_DRYRUN_MAX_STEPS", None, env)
        # A budget below the default pilot (ATORCH_DRYRUN_MAX_STEPS=5 for quick runs) lowers the pilot;
        # a minimum above the default budget raises the budget; both set and crossed still fail validation.
        default_pilot = cls.profile_steps if budget is None else max(1, min(cls.profile_steps, budget))
        profile_steps = env_int("ATORCH_DRYRUN_PROFILE_STEP", default_pilot, env)
        return cls(warmup_steps=env_int("ATORCH_DRYRUN_WARMUP_STEP", cls.warmup_steps, env),
                   profile_steps=profile_steps,
                   max_profile_steps=budget if budget is not None else max(cls.max_profile_steps, profile_steps),
                   max_profile_seconds=env_float("ATORCH_DRYRUN_MAX_SECONDS", cls.max_profile_seconds, env),
                   target_relative_ci=env_float("ATORCH_DRYRUN_TARGET_CI", cls.target_relative_ci, env),
                   timeout_s=env_float("ATORCH_DRYRUN_TIMEOUT", cls.timeout_s, env),
                   scratch_dir=env_str("ATORCH_DRYRUN_SCRATCH_DIR", None, env),
                   memory_limit_bytes=limit).validate()


@dataclass
class _LocalOutcome:
    """One rank's view of a candidate (picklable: it is all-gathered)."""

    rank: int
    error_kind: Optional[str] = None      # "oom" | "timeout" | "exception"
    message: str = ""
    peak_memory_bytes: Optional[int] = None
    step_times_s: List[float] = field(default_factory=list)   # per timed sample, agreed (slowest rank)
    samples: int = 0
    collective_timeout: bool = False      # waiting on a rank that failed, not a failure of its own


def dry_run(ctx: ModelContext, strategy: Strategy, config: DryRunConfig = DryRunConfig(),
            source: Optional[ModelSource] = None) -> DryRunResult:
    """Run `strategy` on a fresh copy of `ctx`'s model on every rank; every rank returns the same result.

    `source` is `ctx.model`'s offloaded weights (a search passes one for all its dry runs);
    without it the weights are offloaded for this call and restored before it returns.
    """
    config.validate()
    if source is None:
        with ModelSource(ctx.model, config.scratch_dir) as own:
            return dry_run(ctx, strategy, config, own)
    if source.model is not ctx.model:
        raise ValueError(f"dry_run: source is a ModelSource of another model ({type(source.model).__name__} at "
                         f"{id(source.model):#x}) than ctx.model ({type(ctx.model).__name__} at {id(ctx.model):#x}); "
                         "pass ModelSource(ctx.model), or source=None to offload ctx.model for this call")
    if not source.offloaded:
        raise ValueError("dry_run: source is a ModelSource of ctx.model whose weights are not offloaded (it is not "
                         "entered, or already exited); call dry_run inside `with source:` (or after "
                         "source.offload()), or pass source=None")
    strategy = Strategy.from_any(strategy)
    with candidate_logs_quieted():   # this dry run's one line is logged below
        outcome = _run_local(ctx, strategy, config, source)
    outcomes = _gather(outcome)
    result = merge_outcomes(outcomes, pilot=config.profile_steps)
    _log_result(strategy, result)
    return result


def _log_result(strategy: Strategy, result: DryRunResult) -> None:
    """One INFO line per dry run (so rank 0 only, by default; see atorch.utils.quiet)."""
    if result.ok:
        logger.info("dry run of %s: %.4g samples/s, peak %s bytes per rank", strategy.describe(), result.throughput,
                    result.peak_memory_bytes)
    else:
        reason = (result.error or "").splitlines()[0] if result.error else "unknown"
        logger.info("dry run of %s failed: %s", strategy.describe(), reason)


# A clean dry run's longest collective wait is the ranks' imbalance within it, a fraction of its
# wall time; a peer still silent after 3 whole dry runs' time has failed.
PEER_WAIT_FACTOR = 3.0


def make_evaluator(ctx: ModelContext, config: DryRunConfig,
                   source: Optional[ModelSource] = None) -> Callable[[Strategy], DryRunResult]:
    """The search's evaluator: one collective dry run per call, candidates built from `source`.

    After the first clean dry run, a candidate's collectives wait for a peer at most
    PEER_WAIT_FACTOR x the longest clean dry run so far (at least `peer_wait_floor_s`, at most
    `timeout_s`): a candidate that fails on one rank only (out of memory on the first pipeline
    stage) left the others waiting the whole `timeout_s` (300 s by default) in a collective, per
    candidate. gloo offers no way to wake them sooner (destroying or aborting the failed rank's
    group does not: measured with torch 2.13, the peer still waits for its timeout). Dropping the
    group's last Python reference would (its sockets close; the peer gets "Connection closed by
    peer" at once, measured), but a group DDP was built on keeps ~10 references from C++ after
    the model and `destroy_process_group` are gone (torch 2.13), so it never closes. Before the
    first clean dry run the wait is `timeout_s`; a rank still running after LONG_RUN_WARNING_S says so.
    """
    longest = 0.0

    def evaluate(strategy: Strategy) -> DryRunResult:
        nonlocal longest
        run_config = config
        if longest > 0 and config.peer_wait_s is None:
            wait = min(config.timeout_s, max(config.peer_wait_floor_s, PEER_WAIT_FACTOR * longest))
            run_config = dataclasses.replace(config, peer_wait_s=wait)
        start = time.monotonic()
        result = dry_run(ctx, strategy, run_config, source)
        if result.ok:
            longest = max(longest, time.monotonic() - start)
        return result

    return evaluate


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
    return result


# -- one rank -----------------------------------------------------------------------------------

def _run_local(ctx: ModelContext, strategy: Strategy, config: DryRunConfig, source: ModelSource) -> _LocalOutcome:
    from atorch.auto.engine import apply_strategy
    from atorch.auto.train_step import train_step

    outcome = _LocalOutcome(rank=adist.rank())
    candidate: Optional[ModelContext] = None
    result: Any = None
    limit = config.memory_limit_bytes
    if limit is not None:
        # The device holds whatever of the user's model was not offloaded, next to the candidate
        # (a 1-byte limit makes the candidate's first allocation the out-of-memory error).
        limit = max(1, limit - source.resident_bytes(ctx.device))
    tracker = PeakMemoryTracker(ctx.device, limit)
    try:
        # Collectives time out first, so a rank waiting on a failed peer reports a collective
        # timeout rather than its own alarm; the alarm is for Python-level hangs.
        peer_wait = config.peer_wait_s if config.peer_wait_s is not None else config.timeout_s
        with _preserved_rng(ctx.device), _candidate_world(peer_wait) as world, \
                _alarm(config.timeout_s + ALARM_GRACE_S), _long_run_warning(strategy, config, peer_wait):
            try:
                losses = FiniteLossCheck()
                with tracker:
                    candidate = fresh_context(ctx, source)
                    result = apply_strategy(candidate, strategy)
                    batches = _cycle(result)
                    for _ in range(max(config.warmup_steps, MIN_MEMORY_STEPS)):
                        losses.record(train_step(result, next(batches)))
                outcome.peak_memory_bytes = tracker.peak_bytes
                outcome.step_times_s = time_steps(lambda: losses.record(train_step(result, next(batches))), config,
                                                  ctx.device)
                outcome.samples = int(result.global_batch_size or 0)
                if world is not None:
                    world["clean"] = True     # every collective completed, whatever the losses were
                # Once per run, after the last collective: the ranks' verdicts are agreed by `_gather`.
                losses.check()
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
                release_engine(candidate)
                result = candidate = None
                gc.collect()
    except DryRunTimeout:   # the alarm fired during cleanup
        outcome.error_kind, outcome.message = outcome.error_kind or "timeout", outcome.message or "cleanup"
    # The candidate's parallel groups lived on its own ModelContext (nothing process-wide to restore).
    return outcome


class NonFiniteLoss(RuntimeError):
    """A dry run's loss was NaN or infinite: the candidate does not train, whatever its speed."""


class FiniteLossCheck:
    """Remembers the first step whose loss is not finite, without a host sync per step.

    Each `record` is a few device ops (the flag stays on the loss's device, so a timed GPU step is not
    serialized by reading it); `check` reads it once, at the end of the run, and raises `NonFiniteLoss`
    naming the step (1-based, warm-up steps included) and the loss. A strategy whose loss is NaN
    (e.g. fp32 overflows that autocast avoids, or the reverse) must be a failed trial, never the fastest one.
    """

    def __init__(self) -> None:
        self.steps = 0
        self._first_bad: Optional[torch.Tensor] = None     # 0: every loss so far finite, else the step
        self._bad_loss: Optional[torch.Tensor] = None

    def record(self, loss: Any) -> Any:
        """Count one step's loss (a tensor, or a number); returns `loss` unchanged."""
        self.steps += 1
        if loss is None:     # a custom train step that returns no loss: nothing to check
            return loss
        value = torch.as_tensor(loss).detach()
        total = value.float().sum()          # NaN or inf if any element is
        if self._first_bad is None or self._bad_loss is None:
            self._first_bad = torch.zeros((), dtype=torch.long, device=total.device)
            self._bad_loss = torch.zeros((), dtype=torch.float32, device=total.device)
        total = total.to(self._bad_loss.device)
        first = (self._first_bad == 0) & ~torch.isfinite(total)
        self._first_bad = torch.where(first, torch.full_like(self._first_bad, self.steps), self._first_bad)
        self._bad_loss = torch.where(first, total, self._bad_loss)
        return loss

    def check(self) -> None:
        if self._first_bad is None or self._bad_loss is None:
            return
        step = int(self._first_bad.item())
        if step:
            raise NonFiniteLoss(f"non-finite loss ({float(self._bad_loss.item())}) at step {step} of "
                                f"{self.steps} (warm-up steps included): the candidate does not train")


def release_engine(candidate: Optional[ModelContext]) -> None:
    """Destroy a candidate's DeepSpeed engine (`engine.destroy()`: its optimizer removes the hooks it
    put on every parameter's gradient accumulator). Those hooks close over the optimizer from inside
    autograd's C++ nodes, a cycle Python's gc cannot see: without this every DeepSpeed dry run kept
    its model, master weights and optimizer state alive (2-2.5x the model's fp32 bytes a candidate;
    a 35M-parameter model's sweep of the default space reached 12 GB a rank and was OOM-killed)."""
    engine = getattr(candidate, "engine", None)
    destroy = getattr(engine, "destroy", None)
    if destroy is None:
        return
    try:
        module = getattr(engine, "module", None)
        destroy()
        _clear_zero3_caches()
        _restore_functional_linear()
        # ZeRO-3 still leaks after destroy(): hooks it leaves on the modules close over the engine
        # from C++ (DeepSpeed 0.19). Whatever keeps the engine, its optimizer and the model's modules
        # alive then holds no tensor: their attributes are dropped, and each ZeRO-3 parameter's
        # partition and data (the candidate's own tensors: `ModelSource.build` made them).
        optimizer = getattr(engine, "optimizer", None)
        for owner in (getattr(optimizer, "optimizer", None), optimizer, engine):
            if owner is not None and hasattr(owner, "__dict__"):
                owner.__dict__.clear()
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            if hasattr(parameter, "ds_id"):       # a parameter ZeRO-3 converted
                setattr(parameter, "ds_tensor", None)
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    except Exception as e:  # noqa: BLE001 - a teardown failure must not turn a measured trial into a failed one
        logger.warning("releasing the DeepSpeed engine of a dry run failed (%s: %s); its memory may stay allocated",
                       type(e).__name__, e)


def _restore_functional_linear() -> None:
    """Put back `torch.nn.functional.linear`, which building a ZeRO-3 engine replaces process-wide with
    DeepSpeed's `zero3_linear_wrap` ("memory_efficient_linear", never undone by `destroy()`): every later
    candidate of the search ran its linears through it and saved other tensors for backward (1.05 MB more on
    a tiny GPT-NeoX than measured alone). A later ZeRO-3 engine installs it again."""
    params_module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    linear_module = sys.modules.get("deepspeed.runtime.zero.linear")
    original = getattr(getattr(params_module, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    wrapped = getattr(linear_module, "zero3_linear_wrap", None)
    if original is not None and wrapped is not None and torch.nn.functional.linear is wrapped:
        torch.nn.functional.linear = original


def _clear_zero3_caches() -> None:
    """Empty the `functools.lru_cache`s on DeepSpeed's ZeRO-3 `PartitionedParameterCoordinator`
    methods (`__params_to_release`, DeepSpeed 0.19): a method cache without a size bound is
    process-wide and keys on `self` and the submodule, so it kept every ZeRO-3 candidate's
    coordinator, model and partitions alive after `destroy()` (2x the model's fp32 bytes a dry
    run). Only a memo: live engines recompute what they need."""
    module = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    coordinator = getattr(module, "PartitionedParameterCoordinator", None)
    for attribute in vars(coordinator).values() if coordinator is not None else ():
        # Through the decorators around the cache: `__wrapped__`, or a closure (DeepSpeed's nvtx
        # wrapper keeps the cached function in its closure only).
        todo, depth = [attribute], 0
        while todo and depth < 4:
            inner: List[Any] = []
            for function in todo:
                if callable(getattr(function, "cache_clear", None)):
                    function.cache_clear()
                    continue
                inner.append(getattr(function, "__wrapped__", None))
                for cell in getattr(function, "__closure__", None) or ():
                    try:
                        inner.append(cell.cell_contents)
                    except ValueError:      # an empty cell
                        pass
            todo, depth = [f for f in inner if callable(f)], depth + 1


def time_steps(step: Callable[[], Any], config: DryRunConfig, device: torch.device) -> List[float]:
    """Per-step seconds of timed samples, until the interval is tight enough or a budget is spent.

    Collective: each sample's time is the slowest rank's (all-reduced), so every rank sees the same
    list and stops after the same sample. The first sample is one step; if it is shorter than
    MIN_SAMPLE_SECONDS, later samples group several steps (`step_timing.steps_per_sample`).
    """
    times: List[float] = []
    per_sample, steps, seconds = 1, 0, 0.0
    while True:
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(per_sample):
            step()
        _synchronize(device)
        sample = _slowest(time.perf_counter() - start)
        times.append(sample / per_sample)
        steps += per_sample
        seconds += sample
        if steps >= config.max_profile_steps or seconds >= config.max_profile_seconds:
            return times
        if is_precise_enough(times, config.target_relative_ci, config.profile_steps):
            return times
        if len(times) == 1:
            per_sample = steps_per_sample(times[0])
        per_sample = max(1, min(per_sample, config.max_profile_steps - steps))


def _slowest(seconds: float) -> float:
    """The largest `seconds` over the ranks of the current default group (the candidate's world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=adist.collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def fresh_context(ctx: ModelContext, source: ModelSource) -> ModelContext:
    """A context with the user's inputs and a fresh model built from `source` (optimizations mutate both)."""
    return ModelContext(
        model=source.build(), optim_func=ctx.optim_func, optim_args=dict(ctx.optim_args),
        optim_param_func=ctx.optim_param_func, dataset=ctx.dataset, loss_func=ctx.loss_func,
        prepare_input=ctx.prepare_input, model_input_format=ctx.model_input_format,
        dataloader_args=dict(ctx.dataloader_args), lr_scheduler_cls=ctx.lr_scheduler_cls,
        lr_scheduler_args=dict(ctx.lr_scheduler_args), device=ctx.device,
        distributed_sampler_cls=ctx.distributed_sampler_cls)


def _cycle(result: Any) -> Iterator[Any]:
    loader = result.dataloader
    if loader is None:
        raise ValueError("a dry run needs batches: pass dataset= (and dataloader_args) to auto_accelerate")
    epoch = 0
    while True:
        sampler = result.sampler
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
    if isinstance(error, UserCodeError):       # the same under every strategy: the search stops at it
        outcome.error_kind, outcome.message = "user", as_text(error)
    elif is_out_of_memory(error):
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


# A dry run of a tiny model takes seconds; one still running after this long is usually a rank
# waiting for a peer, and says so once rather than stay silent for the whole timeout.
LONG_RUN_WARNING_S = 30.0


@contextlib.contextmanager
def _long_run_warning(strategy: Strategy, config: DryRunConfig, peer_wait_s: float) -> Iterator[None]:
    """Log once at INFO (rank 0 shows it; a large model's dry run may just be long) when the candidate is
    still running after LONG_RUN_WARNING_S, naming what bounds the wait; from a timer thread, as the main
    thread may be blocked inside a collective."""
    if config.timeout_s + ALARM_GRACE_S <= LONG_RUN_WARNING_S:
        yield
        return
    rank = adist.rank()

    def _warn() -> None:
        logger.info("rank %d: dry run of %s still running after %g s (a peer failed or is slow?); a collective "
                       "gives up after %g s, the dry run after %g s (ATORCH_DRYRUN_TIMEOUT)", rank,
                       strategy.describe(), LONG_RUN_WARNING_S, peer_wait_s, config.timeout_s)

    timer = threading.Timer(LONG_RUN_WARNING_S, _warn)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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
        # Each gloo group holds sockets to every peer; 30 candidates on 8 ranks would pile up
        # hundreds. Groups of a failed candidate may be mid-collective and are left alone, but
        # forgotten all the same: libraries that cache groups (DeepSpeed) must never hand one of
        # this candidate's groups to the next candidate.
        adist.retire_groups([pg for pg in c10d._world.pg_map if pg not in existing], destroy=state["clean"])


# -- agreement ------------------------------------------------------------------------------------

def _gather(outcome: _LocalOutcome) -> List[_LocalOutcome]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered


def merge_outcomes(outcomes: List[_LocalOutcome], pilot: int = PILOT_SAMPLES) -> DryRunResult:
    """The one result every rank agrees on (pure, deterministic in the rank order); `pilot`: the
    timed samples whose spread fixes the interval (the run's `profile_steps`)."""
    peaks = [o.peak_memory_bytes for o in outcomes if o.peak_memory_bytes is not None]
    peak = max(peaks) if peaks else None
    failed = [o for o in outcomes if o.error_kind is not None]
    if failed:
        # A rank that merely waited for a failed peer reports a collective timeout; the peer's
        # own error is the reason. Out-of-memory first: it is what the search acts on.
        own = [o for o in failed if not o.collective_timeout] or failed
        # A rank's timeout is usually the consequence of another rank's error: errors first.
        # An error in the user's own code or data ends the search whatever else happened: it goes before all.
        rank_of = {"user": -1, "oom": 0, "exception": 1, "timeout": 2}
        first = min(own, key=lambda o: (rank_of.get(o.error_kind or "exception", 1), o.rank))
        if first.error_kind == "timeout":
            error = "timeout" + (f": rank {first.rank}: {first.message}" if first.message else "")
        else:
            error = f"{first.error_kind}: rank {first.rank}: {first.message}"
        return DryRunResult(0.0, peak, error)
    samples = outcomes[0].samples
    # The lists are already agreed (all-reduced); the element-wise max only guards a rank that
    # somehow saw a different list.
    times = [max(ts) for ts in zip(*(o.step_times_s for o in outcomes))]
    if not times or samples <= 0 or min(times) <= 0:
        return DryRunResult(0.0, peak, "exception: no samples were timed (global batch size unknown)")
    summary = summarize(times, pilot=pilot)
    return DryRunResult(summary.throughput(samples), peak, None, summary.mean_s, tuple(times),
                        summary.throughput_interval(samples))
