"""`search_strategy`: find the fastest strategy of a space with as few evaluations as possible.

Pure: it takes a `SearchSpace`, an evaluator callable (one dry run per call) and an optional
predictor (the cost model); it never imports training code. Order of work:

1. Predict every candidate; never evaluate one predicted over `memory_limit_bytes` (the
   prediction is rescaled by the measured/predicted peak ratio of the trials run so far).
2. Evaluate the predictor's top candidates, then `random_samples` random ones.
3. Then HEBO's acquisition over all remaining candidates picks each next one (`bo.py`).
4. Stop at `max_trials`, after `patience` trials without improvement, when the next trial
   would overrun `time_limit_s`, or when nothing is left. No strategy is evaluated twice.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from atorch.auto.search.space import Candidate, SearchSpace
from atorch.auto.strategy import Strategy

logger = logging.getLogger(__name__)

# Candidates the predictor ranks first are tried before any random sample: when the cost model
# is right the search is over after one confirming trial, and when it is wrong it costs two.
PREDICTED_SEEDS = 2
# How far measured peaks may rescale the cost model's memory predictions (see _MemoryGate).
MEMORY_SCALE_RANGE = (0.5, 2.0)

TRIAL_COLUMNS = ["trial", "strategy", "status", "throughput", "predicted_throughput", "predicted_memory",
                 "measured_memory", "reason", "seconds", "planner_seconds", "source"]


@dataclass
class DryRunResult:
    """What one dry run of a strategy measured. `error` is None on success, else "oom",
    "timeout" or "exception: <message>"; a failed run has throughput 0."""

    throughput: float                          # samples/s over the profiled steps
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
        if self.error is None:
            return "ok"
        head = self.error.split(":", 1)[0].strip()
        return head if head in ("oom", "timeout", "exception") else "failed"


Predictor = Callable[[Strategy], Any]          # -> an object with peak_memory_bytes and step_time_s
Evaluator = Callable[[Strategy], DryRunResult]


@dataclass
class SearchResult:
    """The winner and every trial. `trials` has one row per evaluated strategy (TRIAL_COLUMNS);
    `pruned` one row per candidate never run because its predicted memory exceeded the limit."""

    best: Optional[Strategy]
    best_throughput: float
    trials: pd.DataFrame
    pruned: pd.DataFrame
    evaluated: List[Strategy] = field(default_factory=list)    # aligned with trials rows
    stop_reason: str = ""
    num_candidates: int = 0
    memory_limit_bytes: Optional[int] = None
    reason: str = ""                                            # one line: why the winner won

    @property
    def planner_seconds(self) -> List[float]:
        return [s for s in self.trials["planner_seconds"].tolist() if s == s]  # drop NaN

    def explain(self) -> str:
        return self.reason


def search_strategy(space: SearchSpace, evaluator: Evaluator, *, max_trials: int = 30, random_samples: int = 3,
                    patience: int = 8, seed: int = 0, predictor: Optional[Predictor] = None,
                    memory_limit_bytes: Optional[int] = None, time_limit_s: Optional[float] = None,
                    batch_size: Optional[int] = None, progress: bool = False,
                    clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Search `space` for the highest-throughput strategy; see the module docstring.

    `batch_size` turns predicted step times into predicted samples/s for the table (ranking
    only needs the step times). `progress` shows a tqdm bar.
    """
    if max_trials < 1:
        raise ValueError(f"max_trials={max_trials} must be >= 1")
    if random_samples < 0 or patience < 1:
        raise ValueError(f"random_samples={random_samples} must be >= 0 and patience={patience} >= 1")
    if time_limit_s is not None and time_limit_s <= 0:
        raise ValueError(f"time_limit_s={time_limit_s} must be > 0 (or None for no limit)")
    start = clock()
    candidates = space.candidates()
    if not candidates:
        raise ValueError(f"the search space has no valid candidate ({space.size} combinations were all refused; "
                         f"e.g. {next(iter(space.rejected.items()), None)})")
    predictions = [_predict(predictor, c.strategy) for c in candidates]
    trials = _TrialLog(candidates, predictions, batch_size)
    memory = _MemoryGate(predictions, memory_limit_bytes)
    feasible = memory.fitting(range(len(candidates)))
    if not feasible:
        return trials.result(None, "every candidate is predicted over the memory limit",
                             memory.pruned_table(candidates, trials.done), len(candidates), memory_limit_bytes)

    rng = np.random.default_rng(seed)
    queue = _initial_queue(feasible, predictions, random_samples, rng, candidates)
    # Built before the first trial when it will be needed, so its one-time cost (importing hebo,
    # a first GP fit: seconds) counts against time_limit_s like everything else.
    planner = _planner(space, candidates, predictions, seed) if len(feasible) > len(queue) else None
    stop_reason = "exhausted"
    since_improvement = 0
    bar = _progress_bar(min(max_trials, len(feasible)), progress)
    try:
        while True:
            remaining = memory.fitting(i for i in range(len(candidates)) if i not in trials.done)
            if not remaining:
                stop_reason = "every candidate that fits evaluated"
                break
            if len(trials.done) >= max_trials:
                stop_reason = f"max_trials={max_trials} reached"
                break
            if since_improvement >= patience:
                stop_reason = f"no improvement in {patience} trials (patience)"
                break
            queue = [q for q in queue if q[0] in remaining]
            next_cost = trials.typical_seconds() + (planner.expected_seconds if planner and not queue else 0.0)
            if time_limit_s is not None and clock() - start + next_cost > time_limit_s:
                stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                break
            planner_s, source = float("nan"), "initial"
            if queue:
                index, source = queue.pop(0)
            else:
                if planner is None:   # candidates came back under a corrected memory prediction
                    planner = _planner(space, candidates, predictions, seed)
                suggestion = planner.suggest(trials.observations(), remaining)
                index, planner_s, source = suggestion.index, suggestion.seconds, f"hebo-{suggestion.how}"
                if time_limit_s is not None and clock() - start + trials.typical_seconds() > time_limit_s:
                    stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                    break
            result, seconds = _evaluate(evaluator, candidates[index].strategy, clock)
            improved = trials.add(index, result, seconds, planner_s, source)
            memory.observe(index, result)
            since_improvement = 0 if improved else since_improvement + 1
            bar.update(1)
            bar.set_postfix_str(f"best {trials.best_throughput:.4g}/s")
    finally:
        bar.close()
    return trials.result(stop_reason, None, memory.pruned_table(candidates, trials.done), len(candidates),
                         memory_limit_bytes)


class _MemoryGate:
    """Which candidates may be dry-run: predicted peak x scale <= limit.

    `scale` starts at 1 and becomes the median measured/predicted peak ratio of the trials that
    ran (clamped to [0.5, 2]): a cost model that underestimates prunes more after the first
    trial, one that overestimates gives back candidates it had pruned. "Predicted" in "never
    dry-run a candidate predicted over the limit" means this corrected prediction. The median,
    not the largest ratio: on the benchmark landscapes the largest ratio of one strategy pruned
    the true best of others (benchmarks/RESULTS.md, "Strategy search").
    """

    def __init__(self, predictions: List[Any], limit: Optional[int]) -> None:
        self.predictions, self.limit = predictions, limit
        self.scale = 1.0
        self._ratios: List[float] = []

    def predicted(self, i: int) -> Optional[float]:
        pred = self.predictions[i]
        return None if pred is None else pred.peak_memory_bytes * self.scale

    def fits(self, i: int) -> bool:
        p = self.predicted(i)
        return self.limit is None or p is None or p <= self.limit

    def fitting(self, indices: Any) -> List[int]:
        return [i for i in indices if self.fits(i)]

    def observe(self, i: int, result: DryRunResult) -> None:
        pred = self.predictions[i]
        if result.ok and pred is not None and pred.peak_memory_bytes > 0 and result.peak_memory_bytes:
            self._ratios.append(result.peak_memory_bytes / pred.peak_memory_bytes)
            self.scale = min(MEMORY_SCALE_RANGE[1], max(MEMORY_SCALE_RANGE[0], float(np.median(self._ratios))))

    def pruned_table(self, candidates: List[Candidate], done: Dict[int, Any]) -> pd.DataFrame:
        rows = []
        for i, cand in enumerate(candidates):
            if i in done or self.fits(i):
                continue
            scaled = f" (cost model x {self.scale:.2f}, the measured/predicted ratio)" if self.scale != 1.0 else ""
            rows.append({"strategy": cand.label(), "predicted_memory": int(self.predicted(i)),
                         "reason": f"predicted {format_bytes(self.predicted(i))}{scaled} > "
                                   f"{format_bytes(self.limit)} limit"})
        return pd.DataFrame(rows, columns=["strategy", "predicted_memory", "reason"])


def _predict(predictor: Optional[Predictor], strategy: Strategy) -> Any:
    if predictor is None:
        return None
    try:
        return predictor(strategy)
    except Exception as e:  # noqa: BLE001 - an unpredictable candidate is still searchable
        logger.warning("predictor failed on %s (%s); it is searched without a prediction", strategy.describe(), e)
        return None


def _initial_queue(feasible: List[int], predictions: List[Any], random_samples: int,
                   rng: np.random.Generator, candidates: Optional[List[Candidate]] = None) -> List[tuple]:
    """(index, source) pairs: the predictor's fastest, then random ones."""
    queue: List[tuple] = []
    predicted = [i for i in feasible if predictions[i] is not None]
    predicted.sort(key=lambda i: predictions[i].step_time_s)
    for i in predicted[:PREDICTED_SEEDS]:
        queue.append((i, "predicted-top"))
    rest = [i for i in feasible if all(i != q for q, _ in queue)]
    chosen = [q for q, _ in queue]
    for _ in range(min(random_samples, len(rest))):
        # Random, but spread: among the candidates farthest (in changed dimensions) from those
        # already queued, one at random. Spread-out first points teach the surrogate every dimension.
        pool = [i for i in rest if i not in chosen]
        if chosen and candidates is not None:
            dist = [min(_hamming(candidates[i].choices, candidates[j].choices) for j in chosen) for i in pool]
            far = max(dist)
            pool = [i for i, d in zip(pool, dist) if d == far]
        pick = int(pool[int(rng.integers(len(pool)))])
        chosen.append(pick)
        queue.append((pick, "random"))
    return queue


def _hamming(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x != y for x, y in zip(a, b))


def _planner(space: SearchSpace, candidates: List[Candidate], predictions: List[Any], seed: int):
    from atorch.auto.search.bo import CandidatePlanner

    labels = list(space.labels().values())
    prior = None
    if all(p is not None for p in predictions):
        prior = [-math.log(max(p.step_time_s, 1e-12)) for p in predictions]
    return CandidatePlanner(labels, [c.choices for c in candidates], prior=prior, seed=seed)


def _evaluate(evaluator: Evaluator, strategy: Strategy, clock: Callable[[], float]) -> tuple:
    start = clock()
    try:
        result = evaluator(strategy)
        if not isinstance(result, DryRunResult):
            raise TypeError(f"the evaluator returned {type(result).__name__}, expected DryRunResult")
        if result.ok and not (isinstance(result.throughput, (int, float)) and math.isfinite(result.throughput)
                              and result.throughput > 0):
            result = DryRunResult(0.0, result.peak_memory_bytes,
                                  f"exception: evaluator reported throughput {result.throughput!r}")
    except Exception as e:  # noqa: BLE001 - an evaluator that raises is one failed trial
        logger.warning("evaluating %s raised %s: %s", strategy.describe(), type(e).__name__, e)
        result = DryRunResult(0.0, None, f"exception: {type(e).__name__}: {e}")
    return result, clock() - start


class _TrialLog:
    def __init__(self, candidates: List[Candidate], predictions: List[Any], batch_size: Optional[int]) -> None:
        self.candidates = candidates
        self.predictions = predictions
        self.batch_size = batch_size
        self.rows: List[Dict[str, Any]] = []
        self.done: Dict[int, DryRunResult] = {}
        self.order: List[int] = []
        self.best_index: Optional[int] = None
        self.best_throughput = 0.0

    def add(self, index: int, result: DryRunResult, seconds: float, planner_s: float, source: str) -> bool:
        if index in self.done:
            raise AssertionError(f"candidate {index} evaluated twice")  # the search's own invariant
        self.done[index] = result
        self.order.append(index)
        pred = self.predictions[index]
        improved = result.ok and result.throughput > self.best_throughput
        if improved:
            self.best_index, self.best_throughput = index, result.throughput
        self.rows.append({
            "trial": len(self.rows) + 1, "strategy": self.candidates[index].label(), "status": result.status,
            "throughput": result.throughput,
            "predicted_throughput": pred.throughput(self.batch_size) if pred is not None and self.batch_size
            else float("nan"),
            "predicted_memory": pred.peak_memory_bytes if pred is not None else None,
            "measured_memory": result.peak_memory_bytes, "reason": result.error or "",
            "seconds": seconds, "planner_seconds": planner_s, "source": source})
        return improved

    def observations(self) -> List[tuple]:
        return [(i, math.log(r.throughput) if r.ok else None) for i, r in ((i, self.done[i]) for i in self.order)]

    def typical_seconds(self) -> float:
        """Median duration of a trial so far (0 before the first): what the next one will probably cost."""
        if not self.rows:
            return 0.0
        return float(np.median([r["seconds"] for r in self.rows]))

    def result(self, stop_reason: Optional[str], failure: Optional[str], pruned: pd.DataFrame, num_candidates: int,
               memory_limit_bytes: Optional[int]) -> SearchResult:
        from atorch.auto.search.report import explain

        trials = pd.DataFrame(self.rows, columns=TRIAL_COLUMNS)
        best = self.candidates[self.best_index].strategy if self.best_index is not None else None
        out = SearchResult(best, self.best_throughput, trials, pruned,
                           [self.candidates[i].strategy for i in self.order], stop_reason or failure or "",
                           num_candidates, memory_limit_bytes)
        out.reason = explain(out)
        return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="strategy search", unit="trial", leave=True)


def format_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
