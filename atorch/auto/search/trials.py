"""The search's record of its dry runs: each candidate's runs pooled into one estimate, the
leader and its likeliest challenger, the winner-vs-runner-up comparison (throughput interval,
then a memory tie-break inside the noise), and the final `SearchResult`."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import pandas as pd

from atorch.auto.search.feasibility import outlived
from atorch.auto.search.results import (TRIAL_COLUMNS, Comparison, DryRunResult, Evaluator, SearchResult,
                                        usable_peak)
from atorch.auto.search.space import Candidate
from atorch.auto.search.stats import (LogEstimate, RatioCI, between_run_variance, log_throughput_of_steps, pool_runs,
                                      ratio_ci)
from atorch.auto.step_timing import summarize
from atorch.auto.strategy import Strategy
from atorch.auto.user_errors import UserCodeError, as_text, from_text
from atorch.utils.finite_numbers import finite_float

logger = logging.getLogger(__name__)

# A leader whose throughput ratio to every other candidate has a 95% interval above this is
# not re-measured (its reserve goes to the search): repeated dry runs of one candidate on an
# idle machine differed by up to 1.12x (benchmarks/real_landscape.json, median 1.05x), i.e. a
# change of load between runs, which one run's own interval cannot see, moves a ratio by
# about this much; a lead beyond it is not undone by re-measuring.
CLEAR_LEAD = 1.10


# Inside the noise, a candidate wins on memory when it needs at least this much less.
MEMORY_TIE_BREAK = 0.10


# ... and when its measured throughput is at most this much lower: an interval that includes 1
# can still hold point estimates several % apart (a few noisy runs), and on benchmark landscapes
# with 3% noise per run a 3% allowance declared candidates truly 7% slower (benchmarks/search.py).
TIE_MAX_LOSS = 0.01


# ... and, when the leaner one is the one measured slower, when choosing it gives up less than
# this much log-throughput in expectation (the measured difference's normal approximation): the
# tie-break then needs measurements precise enough to say the cost is small, not just close means.
TIE_MAX_EXPECTED_LOSS = 0.01


# The variance of a run's log-throughput below which its steps count as identical (no noise).
NO_NOISE_VAR = 1e-12


# The confidence at which a round of re-measurement ends the rounds early (`TrialLog.challenge`);
# the comparison reported at the end is still a 95% interval. Each round is another look at the
# data: stopping at the first of up to 3 looks whose 95% interval excluded 1 declared identical
# candidates apart in 8% of simulated searches (2-5% of drift a run); stopping early only at 99%,
# then reporting the last look's 95%, in 4-6% (benchmarks/search_compare_noise.py).
LOOK_CONFIDENCE = 0.99


def evaluate(evaluator: Evaluator, strategy: Strategy, clock: Callable[[], float],
             memory_limit_bytes: Optional[int] = None, warned: Optional[Set[str]] = None
             ) -> Tuple[DryRunResult, float]:
    """One dry run through the user's evaluator: (its result, checked, and the seconds it took).

    An evaluator that raises, or returns something that is not a `DryRunResult` or no usable
    throughput, is one failed trial; what it reports beside the throughput is read leniently
    (`checked_result`), so a malformed interval or step list costs its information, not the search.
    """
    start = clock()
    try:
        result = evaluator(strategy)
        if not isinstance(result, DryRunResult):
            raise TypeError(f"the evaluator returned {type(result).__name__}, expected DryRunResult")
        result = checked_result(result, memory_limit_bytes, strategy, warned if warned is not None else set())
    except UserCodeError as e:     # the user's code or data: the search stops at it (`user_error`)
        result = DryRunResult(0.0, None, f"user: {as_text(e)}")
    except Exception as e:  # noqa: BLE001 - an evaluator that raises is one failed trial
        logger.warning("evaluating %s raised %s: %s", strategy.describe(), type(e).__name__, e)
        result = DryRunResult(0.0, None, f"exception: {type(e).__name__}: {e}")
    return result, clock() - start


def user_error(error: str, strategy: Strategy) -> UserCodeError:
    """The exception a "user: [rank R: ]TypeError|ValueError: message" dry-run error stands for, saying why the
    search stopped at it: an error in the code or data the search was given fails every candidate alike."""
    text = error.split(":", 1)[1].strip() if ":" in error else error
    where = ""
    if text.startswith("rank "):
        rank, _, text = text.partition(": ")
        where = f" on {rank}"
    return from_text(text, f" (the dry run of {strategy.describe()} raised it{where}; the search stopped there: no "
                           "strategy changes an error in the code or data it was given)")


def checked_result(result: DryRunResult, memory_limit_bytes: Optional[int], strategy: Strategy,
                   warned: Set[str]) -> DryRunResult:
    """`result` with every field the search reads in the type it expects.

    - A successful run needs a finite positive throughput (a numpy scalar is one), else it is a
      failed trial naming what was reported.
    - Step times that are not a sequence of numbers, and an interval that is not (lo, hi) with
      0 < lo <= throughput <= hi, are dropped with a warning (once per kind and search): the run
      then counts as one without noise information rather than crashing the search or the report.
    - A successful run whose measured peak is above `memory_limit_bytes` is kept (it ran) with a
      warning, once per search.
    """
    if result.error is not None:
        error = result.error if isinstance(result.error, str) else \
            f"exception: evaluator reported error {result.error!r}"
        return dataclasses.replace(result, throughput=0.0, error=error)
    throughput = finite_float(result.throughput)
    if throughput is None or throughput <= 0:
        return DryRunResult(0.0, result.peak_memory_bytes,
                            f"exception: evaluator reported throughput {result.throughput!r} "
                            f"({type(result.throughput).__name__}; expected a finite number > 0)")

    def drop(kind: str, what: str) -> None:
        if kind not in warned:
            warned.add(kind)
            logger.warning("the evaluator's %s for %s is unusable (%s); ignored: the run counts as one without %s",
                           kind, strategy.describe(), what,
                           "noise information" if kind != "step_time_s" else "a step time")

    steps: Tuple[float, ...] = ()
    if result.step_times_s is not None and not isinstance(result.step_times_s, (str, bytes)):
        try:
            steps = tuple(float(s) for s in result.step_times_s)
        except (TypeError, ValueError) as e:
            drop("step_times_s", f"{type(e).__name__}: {e}")
    elif result.step_times_s is not None:
        drop("step_times_s", f"a {type(result.step_times_s).__name__}, expected a sequence of seconds")
    ci = result.throughput_ci
    if ci is not None:
        bounds = tuple(ci) if isinstance(ci, (tuple, list)) else ()
        lo, hi = (finite_float(bounds[0]), finite_float(bounds[1])) if len(bounds) == 2 else (None, None)
        if lo is None or hi is None or not 0 < lo <= throughput <= hi:
            drop("throughput_ci", f"{ci!r} is not (lo, hi) with 0 < lo <= throughput {throughput:.4g} <= hi")
            ci = None
        else:
            ci = (lo, hi)
    step_time = finite_float(result.step_time_s) if result.step_time_s is not None else None
    if result.step_time_s is not None and (step_time is None or step_time <= 0):
        drop("step_time_s", f"{result.step_time_s!r}")
        step_time = None
    if ci is None:
        throughput, step_time = _robust_point(throughput, step_time, steps)
    peak = usable_peak(result.peak_memory_bytes)
    if memory_limit_bytes is not None and peak is not None and peak > memory_limit_bytes and "over_limit" not in warned:
        # It ran, so it fits the device; the limit (the device's memory less a margin, or the user's)
        # was below it. Kept as measured: a peak a few % over is within the tracker's noise.
        warned.add("over_limit")
        logger.warning("%s ran with a measured peak of %.3g GB, over the memory limit of %.3g GB: kept (it ran), "
                       "but it leaves less headroom than the limit asks", strategy.describe(), peak / 1e9,
                       memory_limit_bytes / 1e9)
    return dataclasses.replace(result, throughput=throughput, step_times_s=steps, throughput_ci=ci,
                               step_time_s=step_time)


def _robust_point(throughput: float, step_time: Optional[float], steps: Tuple[float, ...]
                  ) -> Tuple[float, Optional[float]]:
    """(throughput, step time) re-derived from the steps' outlier-free mean, the statistic the search's
    intervals use (`stats.log_throughput_of_steps`).

    An evaluator that reports the plain mean (as `DryRunResult` allows) gave a point estimate one
    load spike pulled far below the run's other steps, next to an interval from the spike-free steps
    that excluded the true rate: 8% of steps 3-10x slower made the search no better than random (a
    helper's landscapes, session 14). The samples per step are throughput x the evaluator's own mean
    step time (`step_time_s`, else the steps' plain mean); the dry runner's throughput, computed
    from the outlier-free mean already, is unchanged.
    """
    usable = [t for t in steps if math.isfinite(t) and t > 0]
    if len(usable) < 2 or len(usable) != len(steps):
        return throughput, step_time
    reference = step_time if step_time is not None else sum(usable) / len(usable)
    robust = summarize(usable).mean_s
    if not (math.isfinite(robust) and robust > 0) or robust == reference:
        return throughput, step_time
    return throughput * reference / robust, robust


def run_estimate(result: DryRunResult) -> Tuple[float, Optional[float], float]:
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


def interval(result: DryRunResult) -> Tuple[float, float]:
    """The trial table's (throughput_lo, throughput_hi): the evaluator's interval, else one from its steps."""
    if not result.ok:
        return float("nan"), float("nan")
    if result.throughput_ci is not None:
        return float(result.throughput_ci[0]), float(result.throughput_ci[1])
    log_tp, var, df = run_estimate(result)
    if var is None:
        return float("nan"), float("nan")
    from atorch.auto.search.stats import t_quantile

    half = (t_quantile(0.95, df) if math.isfinite(df) else 1.96) * math.sqrt(var)
    return math.exp(log_tp - half), math.exp(log_tp + half)


class TrialLog:
    """Every dry run, and each candidate's pooled measurement."""

    def __init__(self, candidates: List[Candidate], predictions: List[Any], batch_size: Optional[int]) -> None:
        self.candidates = candidates
        self.predictions = predictions
        self.batch_size = batch_size
        self.rows: List[Dict[str, Any]] = []
        self.row_candidates: List[int] = []     # the candidate of each row
        # (rows counted, median seconds per predicted step second) for expected_seconds
        self._per_step_cache: Tuple[int, Optional[float]] = (-1, None)
        self.runs: Dict[int, List[Tuple[DryRunResult, float, Optional[float], float]]] = {}   # ok runs only
        # The row of the process's first successful dry run (`cold_run`), and the rows of each ok run.
        self.cold_row: Optional[int] = None
        self.run_rows: Dict[int, List[int]] = {}
        self._between_cache: Tuple[int, Optional[Tuple[float, float]]] = (-1, None)
        self.failed: Dict[int, List[DryRunResult]] = {}     # every failed run of each candidate
        self.last_ok: Dict[int, bool] = {}                   # whether each candidate's latest run ran
        self.tried: Set[int] = set()
        self.order: List[int] = []                 # aligned with rows
        self.noise_reported = False
        # A successful run that timed steps, too few for a spread (ATORCH_DRYRUN_MAX_STEPS=1): said in the reason.
        self.too_few_steps = False
        self._best_mean = -math.inf

    @property
    def count(self) -> int:
        return len(self.rows)

    def add(self, index: int, result: DryRunResult, seconds: float, planner_s: float, source: str) -> bool:
        """Record one dry run; True when it raised the best pooled mean."""
        if index in self.tried and source not in ("remeasure", "retry"):
            raise AssertionError(f"candidate {index} suggested twice")   # the search's own invariant
        self.tried.add(index)
        self.order.append(index)
        self.last_ok[index] = result.ok
        if result.ok:
            est = run_estimate(result)
            self.runs.setdefault(index, []).append((result, *est))
            self.run_rows.setdefault(index, []).append(len(self.rows))
            if self.cold_row is None:
                self.cold_row = len(self.rows)
            # Identical step times (a deterministic evaluator: a table, a simulator) show no noise,
            # and re-measuring them would repeat the same number: only a variance above rounding
            # (a relative standard error of 1e-6; real timings are >= 1e-3) counts.
            self.noise_reported = self.noise_reported or (est[1] is not None and est[1] > NO_NOISE_VAR)
            self.too_few_steps = self.too_few_steps or (bool(result.step_times_s) and est[1] is None)
        else:
            self.failed.setdefault(index, []).append(result)
        pred = self.predictions[index]
        lo, hi = interval(result)
        self.row_candidates.append(index)
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

    def warm_runs(self, index: int) -> List[Tuple[DryRunResult, float, Optional[float], float]]:
        """Candidate `index`'s successful runs, less the process's first dry run once it has another.

        The first dry run of a process runs cold (allocator, thread pools, caches, CPU clocks not
        yet settled; the dry runner's warm-up steps do not absorb all of it): in `make demo` the
        first run of ddp measured 814 samples/s and its re-measurement 1050/s, while its challenger
        measured 835/s twice. Left in, that one run (29% below the next) made the between-run
        spread the interval rests on, and the verdict was "within noise (1.13x, 95% CI 0.25-5.00)".
        It is left out whatever it measured, not only when it disagrees: a rule that drops a run
        because it disagrees would shrink the spread it is judged by. As a candidate's only run it
        is still its only evidence, and kept."""
        runs = self.runs[index]
        rows = self.run_rows[index]
        if len(runs) < 2 or self.cold_row not in rows:
            return runs
        return [r for r, row in zip(runs, rows) if row != self.cold_row]

    def cold_run(self, index: int) -> Optional[DryRunResult]:
        """The process's first dry run when it is candidate `index`'s and left out (`warm_runs`), else None."""
        rows = self.run_rows.get(index, [])
        if len(rows) < 2 or self.cold_row not in rows:
            return None
        return self.runs[index][rows.index(self.cold_row)][0]

    def between(self) -> Optional[Tuple[float, float]]:
        """The between-run variance of one run's log-throughput and its df, pooled over every
        candidate with two or more warm runs (`stats.between_run_variance`); None before any."""
        if self._between_cache[0] != len(self.rows):
            groups = [[r[1] for r in self.warm_runs(i)] for i in self.runs]
            self._between_cache = (len(self.rows), between_run_variance(groups))
        return self._between_cache[1]

    def pooled(self, index: int) -> LogEstimate:
        """Candidate `index`'s warm runs pooled into one log-throughput estimate (`stats.pool_runs`),
        its variance the machine's between-run variance once a candidate was re-measured."""
        runs = self.warm_runs(index)
        est = pool_runs([r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs if r[2] is not None],
                        between=self.between())
        if est is None:     # no noise reported: the mean with an unknown variance
            est = LogEstimate(float(np.mean([r[1] for r in runs])), math.nan, math.inf, len(runs))
        return est

    def eligible(self) -> List[int]:
        """Candidates that can win: they ran, and outlived any failure of theirs (`feasibility.outlived`):
        each an exception or a timeout (never out of memory), no more of them than successful runs,
        and the latest run a success. A failure that does not repeat says nothing of the
        strategy; one that comes back in every other run would fail a long job. (Dropping any
        candidate that ever failed lost the leader to a one-off failure of its re-measurement in 10
        of 40 searches on an outside tester's landscapes where 20% of dry runs fail once:
        benchmarks/search_outside_s29.py, transient.)"""
        return [i for i in self.runs if self._outlived(i, self.last_ok[i])]

    def _outlived(self, index: int, last_ran: bool) -> bool:
        return outlived([f.status for f in self.failed.get(index, [])], len(self.runs[index]), last_ran)

    def needs_retry(self, index: int) -> bool:
        """Candidate `index` ran, then failed in a way one more successful run would outlive
        (`eligible`): one retry tells the machine's one-off failure from the strategy's own."""
        return index in self.runs and not self.last_ok[index] and self._outlived(index, last_ran=True)

    def ranked(self) -> List[int]:
        """Eligible candidates by pooled mean log-throughput, best first."""
        return sorted(self.eligible(), key=lambda i: (-self.pooled(i).mean, i))

    def best_mean_throughput(self) -> float:
        ranked = self.ranked()
        return self.mean_throughput(ranked[0]) if ranked else 0.0

    def mean_throughput(self, index: int) -> float:
        """The mean measured throughput of candidate `index`'s warm runs (`warm_runs`)."""
        return float(np.mean([r[0].throughput for r in self.warm_runs(index)]))

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

    def expected_seconds(self, index: Optional[int] = None) -> float:
        """What a trial of candidate `index` will probably take: the median trial so far, or more for
        a candidate predicted slower than those tried: its predicted step time times the median of
        the trials' seconds per predicted step second (a dry run times steps until its interval is
        narrow, so its length follows the step time). The median alone let a tensor-parallel
        candidate predicted 15x slower start with 4 s left: it took 10.7 s after trials of 1.1-1.4 s."""
        typical = self.typical_seconds()
        target = None if index is None else self._predicted_step(index)
        if target is None:
            return typical
        if self._per_step_cache[0] != len(self.rows):
            ratios = [row["seconds"] / step for row, step in
                      zip(self.rows, map(self._predicted_step, self.row_candidates)) if step is not None]
            self._per_step_cache = (len(self.rows), float(np.median(ratios)) if ratios else None)
        per_step = self._per_step_cache[1]
        return typical if per_step is None else max(typical, per_step * target)

    def _predicted_step(self, index: int) -> Optional[float]:
        prediction = self.predictions[index]
        step = None if prediction is None else float(prediction.step_time_s)
        return step if step is not None and math.isfinite(step) and step > 0 else None

    def _peak(self, index: int) -> Optional[float]:
        # Only peaks the memory model could use (an evaluator may report None, NaN or junk).
        peaks = [p for p in (usable_peak(r[0].peak_memory_bytes) for r in self.runs[index]) if p is not None]
        return float(np.mean(peaks)) if peaks else None

    def challenge(self, first: bool = False, posterior: Optional[Dict[int, Tuple[float, float]]] = None
                  ) -> Optional[Tuple[int, int]]:
        """(leader, challenger) to re-measure, or None when the leader is separated from every
        other candidate (`first`: never None with two candidates: one dry run's interval, from
        its own steps, does not see load changing between runs, so the first round happens
        unless the lead is beyond `CLEAR_LEAD`, which the search decides). The challenger is the
        candidate likeliest to be faster than the leader (normal approximation of the difference
        of their log-throughputs); re-measuring both is what most reduces the chance of
        declaring the slower one.

        `posterior` (the surrogate's mean and variance per candidate) replaces each one's own
        pooled measurement in that probability: the leader by measured mean is often the one
        whose single run was lucky, and a truly faster candidate measured a few % low is then
        not the likeliest challenger by the raw means; pooled with what similar candidates
        showed, it can be. (benchmarks/search.py: 7 of 22 misses on 270 development landscapes
        had the best candidate measured but not declared; this choice of challenger did not
        turn any of those 7 into a hit -- the best there was measured low in both of its runs.)
        Separation stays a matter of the measurements alone, at LOOK_CONFIDENCE: each round is
        another look at the data, and the reported comparison (`compare`) the last one at 95%."""
        ranked = self.ranked()
        if len(ranked) < 2:
            return None
        a = ranked[0]
        ea = self.pooled(a)
        best_p, challenger = -1.0, None
        for b in ranked[1:]:
            eb = self.pooled(b)
            if math.isnan(ea.var) or math.isnan(eb.var):
                p, separated = 0.5, False
            else:
                p = p_faster((ea.mean, ea.var), (eb.mean, eb.var))
                separated = ratio_ci(ea, eb, LOOK_CONFIDENCE).separated
            if posterior is not None and a in posterior and b in posterior:
                p = p_faster(posterior[a], posterior[b])
            if (first or not separated) and p > best_p:
                best_p, challenger = p, b
        return None if challenger is None else (a, challenger)

    def clearly_ahead(self, margin: float = CLEAR_LEAD) -> bool:
        """The leader's throughput over every other eligible candidate is above `margin` with
        95% confidence (by the measurements; False before two candidates ran, or without noise)."""
        ranked = self.ranked()
        if len(ranked) < 2:
            return False
        ea = self.pooled(ranked[0])
        if math.isnan(ea.var):
            return False
        for b in ranked[1:]:
            eb = self.pooled(b)
            if math.isnan(eb.var) or ratio_ci(ea, eb).lo <= margin:
                return False
        return True

    def compare(self, a: int, b: int) -> Optional[Comparison]:
        """A (the higher pooled mean) against B: separated by the interval, or a tie broken by
        memory (at least MEMORY_TIE_BREAK less: A when it is the leaner one and the means are
        within TIE_MAX_LOSS; B only when the throughput expected to be given up by choosing it is
        below TIE_MAX_EXPECTED_LOSS), else by the measured mean."""
        ea, eb = self.pooled(a), self.pooled(b)
        sa, sb = self.candidates[a].strategy, self.candidates[b].strategy
        if math.isnan(ea.var) or math.isnan(eb.var):
            return Comparison(sa, sb, math.exp(ea.mean - eb.mean), None, None, "measured mean", runs=(ea.n, eb.n))
        ci: RatioCI = ratio_ci(ea, eb)
        if ci.separated:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, "throughput", runs=(ea.n, eb.n), **self._notes(a, b))
        pa, pb = self._peak(a), self._peak(b)
        winner, chosen_by, saving = a, "measured mean", None
        close = abs(ea.mean - eb.mean) <= -math.log1p(-TIE_MAX_LOSS)
        if pa and pb and abs(pa - pb) >= MEMORY_TIE_BREAK * max(pa, pb):
            # B is leaner but measured slower: worth it only if little throughput is expected to
            # be lost (a 1% rule alone chose candidates truly 3-4% slower after two runs each at
            # 3% noise: benchmarks/search.py, 2 of 17 misses on 270 development landscapes).
            cheap = expected_loss(eb.mean - ea.mean, math.sqrt(max(ea.var + eb.var, 0.0))) < TIE_MAX_EXPECTED_LOSS
            if (pa < pb and close) or (pb < pa and close and cheap):
                winner, chosen_by = (a, "memory") if pa < pb else (b, "memory")
                saving = 1.0 - min(pa, pb) / max(pa, pb)
        # Otherwise the higher measured mean, still the best estimate: preferring the simpler
        # strategy here chose a 7% slower one on a benchmark landscape (3% noise per dry run).
        if chosen_by == "measured mean" and pa and pb and pa <= (1.0 - MEMORY_TIE_BREAK) * pb:
            saving = 1.0 - pa / pb      # the faster one is also the leaner: the report says both
        if winner == a:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, chosen_by, saving, (ea.n, eb.n), **self._notes(a, b))
        inv = ratio_ci(eb, ea)
        return Comparison(sb, sa, inv.ratio, inv.lo, inv.hi, chosen_by, saving, (eb.n, ea.n), **self._notes(b, a))

    def _notes(self, a: int, b: int) -> Dict[str, Any]:
        """What the comparison line says beside the ratio: whether the interval holds the pooled
        between-run variance, and the cold first dry run left out of A or B (`warm_runs`)."""
        cold = [(i, r) for i, r in ((a, self.cold_run(a)), (b, self.cold_run(b))) if r is not None]
        text = "".join(f"the first dry run ({self.candidates[i].strategy.describe()}, {r.throughput:.4g} samples/s) "
                       "left out as a cold start" for i, r in cold)
        between = self.between()
        return {"between_runs": between is not None, "cold_run": text,
                "between_df": between[1] if between is not None else None}

    def result(self, stop_reason: Optional[str], failure: Optional[str], pruned: pd.DataFrame, num_candidates: int,
               memory_limit_bytes: Optional[int], memory_limit_source: str = "") -> SearchResult:
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
                           stop_reason or failure or "", num_candidates, memory_limit_bytes, comparison=comparison,
                           too_few_steps=self.too_few_steps)
        out.reason = explain(out, memory_limit_source)
        return out


def p_faster(a: Tuple[float, float], b: Tuple[float, float]) -> float:
    """P(B's log-throughput > A's) for independent normal estimates (mean, variance) of each."""
    return float(normal_cdf((b[0] - a[0]) / math.sqrt(max(a[1] + b[1], 1e-300))))


def expected_loss(mean: float, sd: float) -> float:
    """E[max(0, -d)] for d ~ N(mean, sd^2): the log-throughput expected to be given up by
    choosing a candidate whose advantage over the other is d."""
    if sd <= 0:
        return max(0.0, -mean)
    z = mean / sd
    return sd * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) - mean * normal_cdf(-z)


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))
