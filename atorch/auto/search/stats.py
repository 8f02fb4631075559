"""Confidence intervals for dry-run measurements: a mean (Student t) and a throughput ratio (log delta method).

The search uses them to say whether its winner is really faster than the runner-up, and to
give the surrogate each trial's measurement noise. Pure numpy/scipy, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import stats as _st

from atorch.auto.step_timing import summarize


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


def pool_runs(log_means: Sequence[float], within_vars: Sequence[Optional[float]],
              within_dfs: Sequence[float] = ()) -> Optional[LogEstimate]:
    """Pool several dry runs of one strategy into one LogEstimate.

    `within_vars[i]`: the variance of run i's mean from its own steps (None: unknown), with
    `within_dfs` degrees of freedom (one per known variance). With one run, its own variance.
    With several, the spread *between* runs is compared with the spread the steps predict (an F
    test at 5%): when runs disagree beyond it (load changed between them), the between-run
    variance is the honest one, with its few degrees of freedom; otherwise both estimates are
    pooled, so 2 runs of 5 steps each give a usable interval instead of a t with 1 degree of freedom.
    """
    x = np.asarray(log_means, dtype=float)
    if x.size == 0:
        return None
    known = [v for v in within_vars if v is not None]
    within = float(np.mean(known)) if known else None
    df_w = float(sum(within_dfs)) if within_dfs else (math.inf if known else 0.0)
    if x.size == 1:
        if within is None:
            return None
        return LogEstimate(float(x[0]), within, df_w, 1)
    between = float(x.var(ddof=1))
    df_b = float(x.size - 1)
    if within is None or within <= 0 or not math.isfinite(df_w):
        var_one, df = (between, df_b) if within is None else (max(between, within), df_b)
    elif between / within > float(_st.f.ppf(0.95, df_b, df_w)):
        var_one, df = between, df_b
    else:
        var_one, df = (df_b * between + df_w * within) / (df_b + df_w), df_b + df_w
    return LogEstimate(float(x.mean()), var_one / x.size, df, int(x.size))


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
    Welch-Satterthwaite (the t interval is wider than the normal one when few runs back it).
    """
    diff = a.mean - b.mean
    var = a.var + b.var
    if var <= 0:
        r = math.exp(diff)
        return RatioCI(r, r, r, confidence)
    terms = [(v, d) for v, d in ((a.var, a.df), (b.var, b.df)) if v > 0]
    denom = sum(v * v / d for v, d in terms if math.isfinite(d) and d > 0)
    df = (var * var / denom) if denom > 0 else math.inf
    q = float(_st.norm.ppf(0.5 + confidence / 2.0)) if math.isinf(df) else t_quantile(confidence, df)
    half = q * math.sqrt(var)
    return RatioCI(math.exp(diff), math.exp(diff - half), math.exp(diff + half), confidence)
