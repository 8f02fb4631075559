"""What a strategy search takes and gives: a dry run's result, the evaluator and predictor
types, the winner-vs-runner-up comparison and the search's result (with its trial table)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Protocol, Tuple, cast, runtime_checkable

import pandas as pd

from atorch.auto.strategy import Strategy
from atorch.utils.peak_memory import mentions_out_of_memory

TRIAL_COLUMNS = ["trial", "strategy", "status", "throughput", "throughput_lo", "throughput_hi",
                 "predicted_throughput", "predicted_memory", "measured_memory", "reason", "seconds",
                 "planner_seconds", "source"]


@dataclass
class DryRunResult:
    """What one dry run of a strategy measured. `error` is None on success, else "oom",
    "timeout", "exception: <message>" or "user: <message>" (an error in the user's code or data that
    no strategy changes: `atorch.auto.user_errors`); a failed run has throughput 0."""

    # samples/s over the profiled steps; must be finite and > 0 on success (else the run counts as failed:
    # the samples per step are unknown, so step times alone cannot give it). Given step_times_s and no
    # throughput_ci, the search rescales it to their outlier-free mean (the statistic of its intervals;
    # the dry runner reports that already).
    throughput: float
    peak_memory_bytes: Optional[int] = None    # largest per-rank peak
    error: Optional[str] = None
    step_time_s: Optional[float] = None        # mean of step_times_s
    # Per timed step, the slowest rank's seconds (what the confidence interval is computed from).
    step_times_s: Tuple[float, ...] = ()
    # 95% confidence interval of `throughput` (samples/s), from `step_times_s`; None when unknown.
    throughput_ci: Optional[Tuple[float, float]] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def status(self) -> str:
        """"ok", "oom", "timeout", "exception", "user" or "failed": the error's head ("oom: ..."), in any
        case, or an out-of-memory message however an evaluator words it ("CUDA out of memory",
        "exception: ... CUBLAS_STATUS_ALLOC_FAILED": an allocation failure is learned as memory,
        not as a candidate that raises)."""
        if self.error is None:
            return "ok"
        text = str(self.error)
        head = text.split(":", 1)[0].strip().lower()
        if head in ("oom", "timeout", "user"):
            return head
        if mentions_out_of_memory(text):
            return "oom"
        if head == "exception":
            return head
        if head in ("timed out", "time out"):
            return "timeout"
        return "failed"


Predictor = Callable[[Strategy], Any]          # -> an object with peak_memory_bytes and step_time_s


Evaluator = Callable[[Strategy], DryRunResult]


# Below this many degrees of freedom of the between-run variance a "within noise" line says why its interval is wide.
FEW_REPEATS = 3
# An interval wider than this (hi / lo) is called wide; the example of "within noise" is 0.97-1.05.
WIDE_INTERVAL = 1.1


@dataclass
class Comparison:
    """The winner against the runner-up after re-measurement: throughput ratio winner/runner-up
    (pooled over every dry run of each) with its 95% interval, and on what the winner was chosen."""

    winner: Strategy
    runner_up: Strategy
    ratio: float
    lo: Optional[float]                # None: the evaluator reported no noise, no interval
    hi: Optional[float]
    chosen_by: str                     # "throughput", "memory" or "measured mean"
    memory_saving: Optional[float] = None    # fraction less peak memory than the runner-up (when it is leaner)
    runs: Tuple[int, int] = (1, 1)     # dry runs pooled for the winner and the runner-up
    # The interval holds the between-run variance of re-measured candidates (`stats.between_run_variance`),
    # so a candidate run once is not judged by its own steps alone.
    between_runs: bool = False
    cold_run: str = ""                 # the process's first dry run, left out of the pooling (said in the line)
    between_df: Optional[float] = None   # degrees of freedom of that between-run variance (repeats pooled)

    @property
    def separated(self) -> bool:
        return self.lo is not None and (self.lo > 1.0 or cast(float, self.hi) < 1.0)  # both set or neither

    def line(self) -> str:
        a, b = self.winner.describe(), self.runner_up.describe()
        # Two decimals, as "1.01x (95% CI 0.97-1.05)": three significant digits printed 1.0 as "1x".
        if self.lo is None:
            return f"{a}: {self.ratio:.2f}x the runner-up {b} (no interval: the evaluator reported no step times)"
        ci = f"95% CI {self.lo:.2f}-{cast(float, self.hi):.2f}"
        if self.separated:
            return f"{a}: {self.ratio:.2f}x {b} ({ci}){self._single_run_note()}{self._cold_note()}"
        saving = f"{self.memory_saving * 100:.0f}% less memory" if self.memory_saving is not None else "less memory"
        why = {"memory": saving, "measured mean": "higher measured mean"}[self.chosen_by]
        if self.chosen_by == "measured mean" and self.memory_saving is not None:
            why += f" and {saving}"
        return f"{a} and {b} within noise ({self.ratio:.2f}x, {ci}); chose {a}: {why}{self._cold_note()}" \
            f"{self._few_repeats_note()}"

    def _few_repeats_note(self) -> str:
        """Why an interval is wide (hi / lo over WIDE_INTERVAL) when the between-run variance rests on one or two
        repeated dry runs: its t quantile is 12.7 at one degree of freedom, 4.3 at two, 2.8 at four (each
        repeat adds one)."""
        if self.between_df is None or self.between_df >= FEW_REPEATS or self.lo is None or self.hi is None \
                or self.hi <= WIDE_INTERVAL * self.lo:
            return ""
        n = int(self.between_df)
        return (f"; the interval is wide: the noise between dry runs rests on {n} repeated run{'s' if n > 1 else ''} "
                "(a larger max_trials re-measures more)")

    def _cold_note(self) -> str:
        return f"; {self.cold_run}" if self.cold_run else ""

    def _single_run_note(self) -> str:
        """A candidate measured once has an interval from the noise within its run only: a change of the
        machine's load between two runs (another job, thermal throttling) is not in it, and the
        re-measured candidates pool their runs precisely to see that (`stats.pool_runs`). No note when
        the interval holds the between-run variance of other, re-measured candidates (`between_runs`)."""
        single = [who for who, n in zip(("the winner", "the runner-up"), self.runs) if n < 2]
        if not single or self.between_runs:
            return ""
        who = "each" if len(single) == 2 else single[0]
        return f"; one dry run of {who}: the interval holds the noise within a run, not load changes between runs"


@dataclass
class SearchResult:
    """The winner and every trial. `trials` has one row per dry run (TRIAL_COLUMNS; a strategy
    re-measured has several); `pruned` one row per candidate never run because it was predicted
    over the memory limit or needs at least the memory of one that ran out."""

    best: Optional[Strategy]
    best_throughput: float
    trials: pd.DataFrame
    pruned: pd.DataFrame
    evaluated: List[Strategy] = field(default_factory=list)    # aligned with trials rows
    stop_reason: str = ""
    num_candidates: int = 0
    memory_limit_bytes: Optional[int] = None
    reason: str = ""                                            # one line: why the winner won
    comparison: Optional[Comparison] = None                     # winner vs runner-up, when two ran
    # Some dry run timed steps, but too few for an interval (fewer than 2 kept): its ratios rest on single samples.
    too_few_steps: bool = False

    @property
    def planner_seconds(self) -> List[float]:
        return [s for s in self.trials["planner_seconds"].tolist() if s == s]  # drop NaN

    def explain(self) -> str:
        return self.reason


@runtime_checkable
class LearningPredictorLike(Protocol):
    """A predictor that learns from measurements (e.g. `atorch.auto.calibration.LearningPredictor`).

    The search calls `observe(strategy, measured_step_time_s)` after every successful dry run
    (seconds per optimizer step) and then predicts every candidate again, so the surrogate's
    predictor feature and the memory model follow the refit."""

    def __call__(self, strategy: Strategy) -> Any: ...

    def observe(self, strategy: Strategy, measured_step_time_s: float) -> None: ...


def usable_peak(peak: Any) -> Optional[float]:
    """A measured peak the memory model can learn from: finite and positive, else unknown."""
    try:
        value = float(peak)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None
