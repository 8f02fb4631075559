"""Confidence intervals for dry-run measurements: a mean (Student t), a throughput ratio (log delta method),
and the variance between dry runs of one candidate that the ratio's interval rests on.

The search uses them to say whether its winner is really faster than the runner-up, and to
give the surrogate each trial's measurement noise. Pure numpy/scipy, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import stats as _st

from atorch.auto.step_timing import summarize


@lru_cache(maxsize=1024)
def t_quantile(confidence: float, df: float) -> float:
    """Two-sided Student t quantile: half-width multiplier of a `confidence` interval with `df` degrees of freedom."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if df <= 0 or df != df:
        raise ValueError(f"degrees of freedom df={df} must be > 0")
    return float(_st.t.ppf(0.5 + confidence / 2.0, df))


def mean_ci(samples: Sequence[float], confidence: float = 0.95) -> Tuple[float, float, float]:
    """(mean, lo, hi): the Student t interval of the mean of `samples` (at least 2 of them)."""
    x = np.asarray(samples, dtype=float)
    if x.size < 2:
        raise ValueError(f"a confidence interval needs at least 2 samples, got {x.size}")
    m = float(x.mean())
    half = t_quantile(confidence, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - half, m + half


@dataclass(frozen=True)
class LogEstimate:
    """A throughput measured as log(samples/s): the mean, the variance of that mean, and its degrees of freedom."""

    mean: float
    var: float          # variance of `mean` (not of one sample)
    df: float           # degrees of freedom of `var`; inf when the variance is taken as known
    n: int              # measurements (dry runs) pooled
    # `var` rests on the between-run variance every re-measured candidate shares (`pool_runs`): the
    # variance of a difference of two such estimates has that one estimate's df, not Welch's sum.
    shared: bool = False


def log_throughput_of_steps(step_times_s: Sequence[float]) -> Optional[LogEstimate]:
    """One dry run's log-throughput (up to the constant log(batch)) and the variance of its mean step time.

    Throughput = batch / mean step time, so log-throughput = log(batch) - log(mean); the delta
    method gives var(log mean) = s0^2 / (n mean^2) for n kept steps. The statistic is the dry
    runner's own (`step_timing.summarize`): a load spike is left out of the mean and the spread
    (with the spikes in, one step in ten at 2-3x made this standard error 5x the dry runner's
    interval: median over 300 runs, benchmarks/search.py family spikes-3%), and the spread is the
    pilot's (never below that of all kept steps), with the pilot's degrees of freedom, so that it
    is not biased low by where the runner chose to stop (Stein's rule, `step_timing`).
    Steps timed by another evaluator (a fixed count) are all pilot up to PILOT_SAMPLES. None below
    2 positive steps.
    """
    t = [float(s) for s in step_times_s if s is not None and math.isfinite(s) and s > 0]
    if len(t) < 2:
        return None
    summary = summarize(t)
    m = summary.mean_s
    if summary.df < 1 or not (math.isfinite(m) and math.isfinite(summary.spread_s)):
        return None         # no usable spread: the run's noise is unknown, not zero or infinite
    # Finite: a spread of positive times is at most sqrt(n) times their mean.
    return LogEstimate(-math.log(m), (summary.spread_s / m) ** 2 / summary.kept, float(summary.df), 1)


def relative_half_width_to_log_var(rel_half_width: float, confidence: float = 0.95, df: float = math.inf) -> float:
    """Variance of a log-throughput whose `confidence` interval is +-rel_half_width (relative) around it."""
    q = float(_st.norm.ppf(0.5 + confidence / 2.0)) if math.isinf(df) else t_quantile(confidence, df)
    return (math.log1p(rel_half_width) / q) ** 2


def between_run_variance(groups: Sequence[Sequence[float]]) -> Optional[Tuple[float, float]]:
    """(variance of one run's log-throughput around its candidate's mean, degrees of freedom), pooled
    over every candidate measured at least twice (`groups`: each candidate's log-throughputs); None
    when none was.

    Runs of one candidate differ by more than their steps predict (a load change between them,
    thermal throttling, another job): repeated dry runs of one candidate on an idle machine
    differed by up to 1.12x (benchmarks/real_landscape.json, median 1.05x), at a per-run interval
    of +-2-3%. That spread is a property of the machine, not of a candidate, so the search
    estimates it once from every re-measured candidate: sum of squared deviations from each
    one's own mean over sum(n_i - 1). A ratio then uses the t quantile at those pooled degrees of
    freedom (2 after one round of A, B re-measured once each: 4.3, not 12.7 at df 1 per candidate),
    and a candidate measured once borrows it (its own interval cannot see a change between runs).
    """
    squares, df = 0.0, 0
    for values in groups:
        x = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
        if x.size >= 2:
            squares += float(((x - x.mean()) ** 2).sum())
            df += int(x.size) - 1
    return (squares / df, float(df)) if df else None


def pool_runs(log_means: Sequence[float], within_vars: Sequence[Optional[float]],
              within_dfs: Sequence[float] = (), between: Optional[Tuple[float, float]] = None
              ) -> Optional[LogEstimate]:
    """Pool several dry runs of one strategy into one LogEstimate.

    `within_vars[i]`: the variance of run i's mean from its own steps (None: unknown), with
    `within_dfs` degrees of freedom (one per known variance). `between`: the pooled
    (variance of one run, df) of `between_run_variance` over every re-measured candidate; without
    it, this candidate's own runs give it (with one run: its own variance, within only).

    With a between-run variance, the variance of one run is the larger of it and the runs' mean
    within variance (a candidate noisier step by step than those re-measured), at the between
    estimate's degrees of freedom, and the mean's is that over n. There is no test of whether
    runs disagree before pooling them with the steps' variance: with a between-run spread of
    1-2% per run (steps +-0.9%) the F test at 5% that decided it before could not see it at 1-2
    df, and pooling made 20% of simulated searches over identical candidates declare one faster
    (benchmarks/search_compare_noise.py; this rule: 0.4-6%).
    """
    x = np.asarray(log_means, dtype=float)
    if x.size == 0:
        return None
    known = [v for v in within_vars if v is not None]
    within = float(np.mean(known)) if known else None
    df_w = float(sum(within_dfs)) if within_dfs else (math.inf if known else 0.0)
    if between is None and x.size >= 2:
        between = between_run_variance([list(x)])
    if between is None:
        if within is None:
            return None
        return LogEstimate(float(x.mean()), within / x.size, df_w, int(x.size))
    per_run = max(between[0], within if within is not None else 0.0)
    return LogEstimate(float(x.mean()), per_run / x.size, between[1], int(x.size), shared=True)


@dataclass(frozen=True)
class RatioCI:
    """Throughput of A over B with a confidence interval."""

    ratio: float
    lo: float
    hi: float
    confidence: float = 0.95

    @property
    def separated(self) -> bool:
        """True when the interval excludes 1 (A and B differ beyond the noise)."""
        return self.lo > 1.0 or self.hi < 1.0


def ratio_ci(a: LogEstimate, b: LogEstimate, confidence: float = 0.95) -> RatioCI:
    """Throughput ratio A/B and its interval, by the delta method on log-throughput.

    log(A/B) = log A - log B with variance var_A + var_B; degrees of freedom by
    Welch-Satterthwaite (the t interval is wider than the normal one when few runs back it), or,
    when both rest on the same pooled between-run variance (`LogEstimate.shared`), its df.
    """
    diff = a.mean - b.mean
    var = a.var + b.var
    if var <= 0:
        r = math.exp(diff)
        return RatioCI(r, r, r, confidence)
    if a.shared and b.shared:
        df = min(a.df, b.df)
    else:
        terms = [(v, d) for v, d in ((a.var, a.df), (b.var, b.df)) if v > 0]
        denom = sum(v * v / d for v, d in terms if math.isfinite(d) and d > 0)
        df = (var * var / denom) if denom > 0 else math.inf
    q = float(_st.norm.ppf(0.5 + confidence / 2.0)) if math.isinf(df) else t_quantile(confidence, df)
    half = q * math.sqrt(var)
    return RatioCI(math.exp(diff), math.exp(diff - half), math.exp(diff + half), confidence)
