"""`search_strategy`: find the fastest strategy of a space with few dry runs, and say how sure it is.

Pure: it takes a `SearchSpace`, an evaluator callable (one dry run per call) and an optional
predictor (the cost model); it never imports training code. Order of work:

1. Predict every candidate. A candidate may be run only while it is *feasible* (`_Feasibility`):
   its predicted peak, rescaled by the measured/predicted ratio of the trials so far, fits
   `memory_limit_bytes`, and it needs less memory than no candidate that ran out of memory
   (by the predicted peak while the predictor orders the measured peaks consistently, and by
   dominance in memory-saving choices, `space.memory_saving_ranks`, always).
2. Evaluate the predictor's top candidates, then `random_samples` spread-out random ones.
3. Then HEBO's acquisition over the remaining feasible candidates picks each next one
   (`bo.py`): a GP on log-throughput with a main-effect + pairwise-interaction kernel, the
   prediction as a learned feature, and the measured noise as its noise floor.
   Failed trials are not throughput observations: an exception or timeout retires that one
   candidate, an out-of-memory trial teaches feasibility (step 1); neither reaches the GP.
4. The search phase stops at its share of `max_trials`, after `patience` trials without
   improvement, when the next trial would overrun `time_limit_s`, or when nothing is left.
5. When the evaluator reports per-step times (its noise), the top two are re-measured
   interleaved (A, B, A, B, counted in `max_trials`) and compared with a 95% interval of their
   throughput ratio (`stats.py`); inside the noise, the one using at least 10% less memory
   wins, else the higher measured mean. `SearchResult.comparison` holds that comparison, `reason` says it in one line.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import numpy as np
import pandas as pd

from atorch.auto.search.space import Candidate, SearchSpace, memory_saving_ranks
from atorch.auto.search.stats import LogEstimate, RatioCI, log_throughput_of_steps, pool_runs, ratio_ci
from atorch.auto.strategy import Strategy

logger = logging.getLogger(__name__)

# Candidates the predictor ranks first are tried before any random sample: when the cost model
# is right the search is over after one confirming trial, and when it is wrong it costs two.
PREDICTED_SEEDS = 2
# How far measured peaks may rescale the cost model's memory predictions (see _Feasibility).
MEMORY_SCALE_RANGE = (0.5, 2.0)
# Interleaved re-measurement rounds of the top two (each round: one dry run of each).
REMEASURE_ROUNDS = 2
# Inside the noise, a candidate wins on memory when it needs at least this much less.
MEMORY_TIE_BREAK = 0.10

TRIAL_COLUMNS = ["trial", "strategy", "status", "throughput", "throughput_lo", "throughput_hi",
                 "predicted_throughput", "predicted_memory", "measured_memory", "reason", "seconds",
                 "planner_seconds", "source"]


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
class Comparison:
    """The winner against the runner-up after re-measurement: throughput ratio winner/runner-up
    (pooled over every dry run of each) with its 95% interval, and on what the winner was chosen."""

    winner: Strategy
    runner_up: Strategy
    ratio: float
    lo: Optional[float]                # None: the evaluator reported no noise, no interval
    hi: Optional[float]
    chosen_by: str                     # "throughput", "memory" or "measured mean"
    memory_saving: Optional[float] = None    # fraction less peak memory than the runner-up
    runs: Tuple[int, int] = (1, 1)     # dry runs pooled for the winner and the runner-up

    @property
    def separated(self) -> bool:
        return self.lo is not None and (self.lo > 1.0 or cast(float, self.hi) < 1.0)  # both set or neither

    def line(self) -> str:
        a, b = self.winner.describe(), self.runner_up.describe()
        if self.lo is None:
            return f"{a}: {self.ratio:.3g}x the runner-up {b} (no interval: the evaluator reported no step times)"
        ci = f"95% CI {self.lo:.3g}-{self.hi:.3g}"
        if self.separated:
            return f"{a}: {self.ratio:.3g}x {b} ({ci})"
        saving = f"{self.memory_saving * 100:.0f}% less memory" if self.memory_saving is not None else "less memory"
        why = {"memory": saving, "measured mean": "higher measured mean"}[self.chosen_by]
        return f"{a} and {b} within noise ({self.ratio:.3g}x, {ci}); chose {a}: {why}"


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

    @property
    def planner_seconds(self) -> List[float]:
        return [s for s in self.trials["planner_seconds"].tolist() if s == s]  # drop NaN

    def explain(self) -> str:
        return self.reason


def search_strategy(space: SearchSpace, evaluator: Evaluator, *, max_trials: int = 30, random_samples: int = 3,
                    patience: int = 8, seed: int = 0, predictor: Optional[Predictor] = None,
                    memory_limit_bytes: Optional[int] = None, time_limit_s: Optional[float] = None,
                    batch_size: Optional[int] = None, progress: bool = False,
                    clock: Callable[[], float] = time.monotonic,
                    remeasure_rounds: int = REMEASURE_ROUNDS, planner_factory: Optional[Callable] = None
                    ) -> SearchResult:
    """Search `space` for the highest-throughput strategy; see the module docstring.

    `batch_size` turns predicted step times into predicted samples/s for the table (ranking
    only needs the step times). `progress` shows a tqdm bar. `remeasure_rounds` (0 to turn it
    off) interleaved re-measurements of the top two close the search when the evaluator
    reports per-step times. `planner_factory(labels, choices, prior, seed)` replaces the HEBO
    planner (tests, benchmarks).
    """
    if max_trials < 1:
        raise ValueError(f"max_trials={max_trials} must be >= 1")
    if random_samples < 0 or patience < 1:
        raise ValueError(f"random_samples={random_samples} must be >= 0 and patience={patience} >= 1")
    if time_limit_s is not None and time_limit_s <= 0:
        raise ValueError(f"time_limit_s={time_limit_s} must be > 0 (or None for no limit)")
    if remeasure_rounds < 0:
        raise ValueError(f"remeasure_rounds={remeasure_rounds} must be >= 0")
    start = clock()
    candidates = space.candidates()
    if not candidates:
        raise ValueError(f"the search space has no valid candidate ({space.size} combinations were all refused; "
                         f"e.g. {next(iter(space.rejected.items()), None)})")
    predictions = [_predict(predictor, c.strategy) for c in candidates]
    trials = _TrialLog(candidates, predictions, batch_size)
    feasibility = _Feasibility(candidates, predictions, memory_limit_bytes, memory_saving_ranks(space))
    feasible = feasibility.allowed_among(range(len(candidates)))
    if not feasible:
        return trials.result(None, "every candidate is predicted over the memory limit",
                             feasibility.pruned_table(trials.tried), len(candidates), memory_limit_bytes)

    rng = np.random.default_rng(seed)
    queue = _initial_queue(feasible, predictions, random_samples, rng, candidates)
    make_planner = planner_factory or _hebo_planner
    prior = _prior(predictions)
    labels = list(space.labels().values())
    choices = [c.choices for c in candidates]
    # Built before the first trial when it will be needed, so its one-time cost (importing hebo,
    # a first GP fit: seconds) counts against time_limit_s like everything else.
    planner = make_planner(labels, choices, prior, seed) if len(feasible) > len(queue) else None
    stop_reason = "exhausted"
    since_improvement = 0
    bar = _progress_bar(min(max_trials, len(feasible) + 2 * remeasure_rounds), progress)

    def out_of_time(planner_cost: float = 0.0) -> bool:
        return time_limit_s is not None and clock() - start + trials.typical_seconds() + planner_cost > time_limit_s

    try:
        while True:   # the search phase
            remaining = feasibility.allowed_among(i for i in range(len(candidates)) if i not in trials.tried)
            # Once the evaluator has shown it reports noise, keep budget for the re-measurements.
            reserve = _remeasure_reserve(max_trials, remeasure_rounds) if trials.noise_reported else 0
            if not remaining:
                stop_reason = "every candidate that fits evaluated"
                break
            if trials.count >= max_trials - reserve:
                stop_reason = f"max_trials={max_trials} reached" + (
                    f" ({reserve} kept for re-measuring the top two)" if reserve else "")
                break
            if since_improvement >= patience:
                stop_reason = f"no improvement in {patience} trials (patience)"
                break
            queue = [q for q in queue if q[0] in remaining]
            if out_of_time(planner.expected_seconds if planner and not queue else 0.0):
                stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                break
            planner_s, source = float("nan"), "initial"
            if queue:
                index, source = queue.pop(0)
            else:
                if planner is None:   # candidates came back under a corrected memory prediction
                    planner = make_planner(labels, choices, prior, seed)
                suggestion = planner.suggest(trials.observations(), remaining)
                index, planner_s, source = suggestion.index, suggestion.seconds, f"hebo-{suggestion.how}"
                if out_of_time():
                    stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                    break
            result, seconds = _evaluate(evaluator, candidates[index].strategy, clock)
            improved = trials.add(index, result, seconds, planner_s, source)
            feasibility.observe(index, result)
            since_improvement = 0 if improved else since_improvement + 1
            bar.update(1)
            bar.set_postfix_str(f"best {trials.best_mean_throughput():.4g}/s")
        # The re-measurement phase: A, B, A, B, stopping early once the interval separates them.
        for _ in range(remeasure_rounds if trials.noise_reported else 0):
            top = trials.ranked()[:2]
            if len(top) < 2 or trials.count + 2 > max_trials or out_of_time(trials.typical_seconds()):
                break
            for index in top:
                result, seconds = _evaluate(evaluator, candidates[index].strategy, clock)
                trials.add(index, result, seconds, float("nan"), "remeasure")
                feasibility.observe(index, result)
                bar.update(1)
            comparison = trials.compare(*top)
            if comparison is not None and comparison.separated:
                break
    finally:
        bar.close()
    return trials.result(stop_reason, None, feasibility.pruned_table(trials.tried), len(candidates),
                         memory_limit_bytes)


def _remeasure_reserve(max_trials: int, rounds: int) -> int:
    """Dry runs kept from the search phase for re-measuring: 2 per round, one round per 10 dry
    runs of budget (a budget of 14 keeps 2, one of 20 or more 4): at small budgets finding the
    best region matters more than a second round (benchmarks/search.py)."""
    return min(2 * rounds, 2 * (max_trials // 10))


class _Feasibility:
    """Which candidates may be dry-run, learned from the memory model and from out-of-memory trials.

    - Predicted peak x `scale` <= limit, where `scale` is the median measured/predicted peak
      ratio of the trials that ran (clamped to [0.5, 2]): a cost model that underestimates
      prunes more after the first trial, one that overestimates gives back what it pruned.
    - A candidate needing at least the memory of one that ran out of memory is skipped. "At
      least" by dominance in memory-saving choices (every ordered dimension saves no more,
      every unordered one equal: `memory_saving_ranks`), and by the predicted peak while the
      predictor is consistent with what ran (no candidate ran fine while predicted at or above
      the prediction of one that ran out). A predictor that ranks memory wrongly is ignored here.
    """

    def __init__(self, candidates: List[Candidate], predictions: List[Any], limit: Optional[int],
                 ranks: Sequence[Optional[Sequence[float]]]) -> None:
        self.candidates, self.predictions, self.limit = candidates, predictions, limit
        self.ranks = list(ranks)
        self.scale = 1.0
        self._ratios: List[float] = []
        self.oom: List[int] = []
        self._ok_predicted: List[float] = []      # raw predicted peaks of candidates that ran fine

    def raw(self, i: int) -> Optional[float]:
        pred = self.predictions[i]
        return None if pred is None else float(pred.peak_memory_bytes)

    def predicted(self, i: int) -> Optional[float]:
        raw = self.raw(i)
        return None if raw is None else raw * self.scale

    def fits_prediction(self, i: int) -> bool:
        p = self.predicted(i)
        return self.limit is None or p is None or p <= self.limit

    @property
    def predictor_consistent(self) -> bool:
        oom_preds = [p for p in (self.raw(j) for j in self.oom) if p is not None]
        return not oom_preds or not self._ok_predicted or max(self._ok_predicted) < min(oom_preds)

    def needs_at_least(self, i: int, j: int) -> bool:
        """Whether candidate i needs at least the memory of candidate j."""
        ci, cj = self.candidates[i].choices, self.candidates[j].choices
        dominated = True
        for a, b, r in zip(ci, cj, self.ranks):
            if r is None:
                if a != b:
                    dominated = False
                    break
            elif r[a] > r[b]:
                dominated = False
                break
        if dominated:
            return True
        ri, rj = self.raw(i), self.raw(j)
        return ri is not None and rj is not None and ri >= rj and self.predictor_consistent

    def oom_blocker(self, i: int) -> Optional[int]:
        return next((j for j in self.oom if j != i and self.needs_at_least(i, j)), None)

    def allowed(self, i: int) -> bool:
        return self.fits_prediction(i) and self.oom_blocker(i) is None

    def allowed_among(self, indices: Any) -> List[int]:
        return [i for i in indices if self.allowed(i)]

    def observe(self, i: int, result: DryRunResult) -> None:
        raw = self.raw(i)
        if result.status == "oom":
            if i not in self.oom:
                self.oom.append(i)
            return
        if not result.ok:
            return
        if raw is not None:
            self._ok_predicted.append(raw)
            if raw > 0 and result.peak_memory_bytes:
                self._ratios.append(result.peak_memory_bytes / raw)
                self.scale = min(MEMORY_SCALE_RANGE[1], max(MEMORY_SCALE_RANGE[0], float(np.median(self._ratios))))

    def pruned_table(self, tried: Set[int]) -> pd.DataFrame:
        rows = []
        for i, cand in enumerate(self.candidates):
            if i in tried or self.allowed(i):
                continue
            p = self.predicted(i)
            if not self.fits_prediction(i):
                scaled = f" (cost model x {self.scale:.2f}, the measured/predicted ratio)" if self.scale != 1.0 else ""
                reason = f"predicted {format_bytes(p)}{scaled} > {format_bytes(self.limit)} limit"
            else:
                # Not allowed yet fits the prediction: an out-of-memory candidate blocks it.
                blocker = self.candidates[cast(int, self.oom_blocker(i))].label()
                reason = f"needs at least the memory of {blocker}, which ran out of memory"
            rows.append({"strategy": cand.label(), "predicted_memory": int(p) if p is not None else None,
                         "reason": reason})
        return pd.DataFrame(rows, columns=["strategy", "predicted_memory", "reason"])


def _predict(predictor: Optional[Predictor], strategy: Strategy) -> Any:
    if predictor is None:
        return None
    try:
        return predictor(strategy)
    except Exception as e:  # noqa: BLE001 - an unpredictable candidate is still searchable
        logger.warning("predictor failed on %s (%s); it is searched without a prediction", strategy.describe(), e)
        return None


def _prior(predictions: List[Any]) -> Optional[List[float]]:
    """Predicted log-throughput of every candidate (up to a constant), or None unless all are predicted."""
    if not predictions or any(p is None for p in predictions):
        return None
    return [-math.log(max(float(p.step_time_s), 1e-12)) for p in predictions]


def _initial_queue(feasible: List[int], predictions: List[Any], random_samples: int,
                   rng: np.random.Generator, candidates: Optional[List[Candidate]] = None) -> List[tuple]:
    """(index, source) pairs: the predictor's fastest, then random ones that cover the space.

    The random part has at least as many points as the largest dimension has options, and each
    is drawn among the candidates showing the most options not yet covered (then the farthest,
    in changed dimensions, from those already queued): after it every option of every dimension
    has been measured once where feasibility allows, so the surrogate's main effects all start
    from data rather than from its prior.
    """
    queue: List[tuple] = []
    predicted = [i for i in feasible if predictions[i] is not None]
    predicted.sort(key=lambda i: predictions[i].step_time_s)
    for i in predicted[:PREDICTED_SEEDS]:
        queue.append((i, "predicted-top"))
    chosen = [q for q, _ in queue]
    if candidates is None or random_samples == 0:
        rest = [i for i in feasible if i not in chosen]
        picks = [int(i) for i in rng.permutation(rest)[:random_samples]] if rest else []
        return queue + [(i, "random") for i in picks]
    widest = max(len({c.choices[d] for c in candidates}) for d in range(len(candidates[0].choices)))
    covered = {(d, v) for j in chosen for d, v in enumerate(candidates[j].choices)}
    for _ in range(max(random_samples, widest)):
        pool = [i for i in feasible if i not in chosen]
        if not pool:
            break
        new = [sum((d, v) not in covered for d, v in enumerate(candidates[i].choices)) for i in pool]
        dist = [min((_hamming(candidates[i].choices, candidates[j].choices) for j in chosen), default=0) for i in pool]
        key = [(n, d) for n, d in zip(new, dist)]
        top = max(key)
        pool = [i for i, k in zip(pool, key) if k == top]
        pick = int(pool[int(rng.integers(len(pool)))])
        chosen.append(pick)
        covered.update((d, v) for d, v in enumerate(candidates[pick].choices))
        queue.append((pick, "random"))
    return queue


def _hamming(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x != y for x, y in zip(a, b))


def _hebo_planner(labels: List[List[str]], choices: List[Tuple[int, ...]], prior: Optional[List[float]], seed: int):
    from atorch.auto.search.bo import CandidatePlanner

    return CandidatePlanner(labels, choices, prior=prior, seed=seed)


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


def _run_estimate(result: DryRunResult) -> Tuple[float, Optional[float], float]:
    """(log-throughput, variance of it or None, its degrees of freedom) of one successful dry run."""
    log_tp = math.log(result.throughput)
    steps = log_throughput_of_steps(result.step_times_s) if result.step_times_s else None
    if steps is not None:
        return log_tp, steps.var, steps.df
    if result.throughput_ci is not None:
        lo, hi = result.throughput_ci
        if 0 < lo <= hi:
            # Half the log-width of a 95% interval is 1.96 standard errors (normal approximation).
            return log_tp, ((math.log(hi) - math.log(lo)) / (2 * 1.96)) ** 2, math.inf
    return log_tp, None, math.inf


def _interval(result: DryRunResult) -> Tuple[float, float]:
    """The trial table's (throughput_lo, throughput_hi): the evaluator's interval, else one from its steps."""
    if not result.ok:
        return float("nan"), float("nan")
    if result.throughput_ci is not None:
        return float(result.throughput_ci[0]), float(result.throughput_ci[1])
    log_tp, var, df = _run_estimate(result)
    if var is None:
        return float("nan"), float("nan")
    from atorch.auto.search.stats import t_quantile

    half = (t_quantile(0.95, df) if math.isfinite(df) else 1.96) * math.sqrt(var)
    return math.exp(log_tp - half), math.exp(log_tp + half)


class _TrialLog:
    """Every dry run, and each candidate's pooled measurement."""

    def __init__(self, candidates: List[Candidate], predictions: List[Any], batch_size: Optional[int]) -> None:
        self.candidates = candidates
        self.predictions = predictions
        self.batch_size = batch_size
        self.rows: List[Dict[str, Any]] = []
        self.runs: Dict[int, List[Tuple[DryRunResult, float, Optional[float], float]]] = {}   # ok runs only
        self.failed: Dict[int, DryRunResult] = {}
        self.tried: Set[int] = set()
        self.order: List[int] = []                 # aligned with rows
        self.noise_reported = False
        self._best_mean = -math.inf

    @property
    def count(self) -> int:
        return len(self.rows)

    def add(self, index: int, result: DryRunResult, seconds: float, planner_s: float, source: str) -> bool:
        """Record one dry run; True when it raised the best pooled mean."""
        if index in self.tried and source != "remeasure":
            raise AssertionError(f"candidate {index} suggested twice")   # the search's own invariant
        self.tried.add(index)
        self.order.append(index)
        if result.ok:
            est = _run_estimate(result)
            self.runs.setdefault(index, []).append((result, *est))
            self.noise_reported = self.noise_reported or est[1] is not None
        else:
            self.failed[index] = result
        pred = self.predictions[index]
        lo, hi = _interval(result)
        self.rows.append({
            "trial": len(self.rows) + 1, "strategy": self.candidates[index].label(), "status": result.status,
            "throughput": result.throughput, "throughput_lo": lo, "throughput_hi": hi,
            "predicted_throughput": pred.throughput(self.batch_size) if pred is not None and self.batch_size
            else float("nan"),
            "predicted_memory": pred.peak_memory_bytes if pred is not None else None,
            "measured_memory": result.peak_memory_bytes, "reason": result.error or "",
            "seconds": seconds, "planner_seconds": planner_s, "source": source})
        ranked = self.ranked()
        best = self.pooled(ranked[0]).mean if ranked else -math.inf
        improved = best > self._best_mean + 1e-12 and result.ok
        self._best_mean = max(self._best_mean, best)
        return improved

    def pooled(self, index: int) -> LogEstimate:
        runs = self.runs[index]
        est = pool_runs([r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs if r[2] is not None])
        if est is None:     # no noise reported: the mean with an unknown variance
            est = LogEstimate(float(np.mean([r[1] for r in runs])), math.nan, math.inf, len(runs))
        return est

    def eligible(self) -> List[int]:
        """Candidates that can win: ran fine, and never failed on a re-measurement."""
        return [i for i in self.runs if i not in self.failed]

    def ranked(self) -> List[int]:
        """Eligible candidates by pooled mean log-throughput, best first."""
        return sorted(self.eligible(), key=lambda i: (-self.pooled(i).mean, i))

    def best_mean_throughput(self) -> float:
        ranked = self.ranked()
        return self.mean_throughput(ranked[0]) if ranked else 0.0

    def mean_throughput(self, index: int) -> float:
        return float(np.mean([r[0].throughput for r in self.runs[index]]))

    def observations(self) -> List[Any]:
        from atorch.auto.search.bo import Observation

        out = []
        for i in self.runs:           # re-measured or not, one pooled observation per candidate
            est = self.pooled(i)
            out.append(Observation(i, est.mean, None if math.isnan(est.var) else est.var))
        return out

    def typical_seconds(self) -> float:
        """Median duration of a trial so far (0 before the first): what the next one will probably cost."""
        if not self.rows:
            return 0.0
        return float(np.median([r["seconds"] for r in self.rows]))

    def _peak(self, index: int) -> Optional[float]:
        peaks = [r[0].peak_memory_bytes for r in self.runs[index] if r[0].peak_memory_bytes]
        return float(np.mean(peaks)) if peaks else None

    def compare(self, a: int, b: int) -> Optional[Comparison]:
        """A (the higher pooled mean) against B: separated by the interval, or a tie broken by
        memory (at least MEMORY_TIE_BREAK less), else by the measured mean."""
        ea, eb = self.pooled(a), self.pooled(b)
        sa, sb = self.candidates[a].strategy, self.candidates[b].strategy
        if math.isnan(ea.var) or math.isnan(eb.var):
            return Comparison(sa, sb, math.exp(ea.mean - eb.mean), None, None, "measured mean", runs=(ea.n, eb.n))
        ci: RatioCI = ratio_ci(ea, eb)
        if ci.separated:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, "throughput", runs=(ea.n, eb.n))
        pa, pb = self._peak(a), self._peak(b)
        winner, chosen_by, saving = a, "measured mean", None
        if pa and pb and abs(pa - pb) >= MEMORY_TIE_BREAK * max(pa, pb):
            winner, chosen_by = (a, "memory") if pa < pb else (b, "memory")
            saving = 1.0 - min(pa, pb) / max(pa, pb)
        # Otherwise the higher measured mean, still the best estimate: preferring the simpler
        # strategy here chose a 7% slower one on a benchmark landscape (3% noise per dry run).
        if winner == a:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, chosen_by, saving, (ea.n, eb.n))
        inv = ratio_ci(eb, ea)
        return Comparison(sb, sa, inv.ratio, inv.lo, inv.hi, chosen_by, saving, (eb.n, ea.n))

    def result(self, stop_reason: Optional[str], failure: Optional[str], pruned: pd.DataFrame, num_candidates: int,
               memory_limit_bytes: Optional[int]) -> SearchResult:
        from atorch.auto.search.report import explain

        trials = pd.DataFrame(self.rows, columns=TRIAL_COLUMNS)
        ranked = self.ranked()
        comparison = self.compare(ranked[0], ranked[1]) if len(ranked) >= 2 else None
        best_index: Optional[int]
        if comparison is not None:
            best_index = next(i for i in ranked[:2] if self.candidates[i].strategy == comparison.winner)
        else:
            best_index = ranked[0] if ranked else None
        best = self.candidates[best_index].strategy if best_index is not None else None
        best_tp = self.mean_throughput(best_index) if best_index is not None else 0.0
        out = SearchResult(best, best_tp, trials, pruned, [self.candidates[i].strategy for i in self.order],
                           stop_reason or failure or "", num_candidates, memory_limit_bytes, comparison=comparison)
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
