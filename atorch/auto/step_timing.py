"""Step-time statistics of a dry run: when to stop timing, and the interval it reports.

Pure (floats in, floats out), so the stopping rule is tested in milliseconds; the dry runner
feeds it per-step times that every rank already agrees on, so every rank stops at the same step.

The rule is Stein's two-stage procedure (Stein 1945): the first `pilot` samples (the dry runner's
`profile_steps`, PILOT_SAMPLES by default) give the standard deviation s0; timing goes on until the
95% half-width t(k0 - 1) * s / sqrt(n) is at most `target` of the mean, or the budget is spent,
and that is the interval reported, with the pilot's k0 - 1 degrees of freedom and s = the larger
of s0 and the spread of all kept samples. s0 is fixed before the stopping point is chosen, so
Stein's interval holds its 95% whatever n was reached, and this one is never narrower. The rule
it replaces (stop the first time the interval over all samples so far is narrow enough, report
that interval) stopped when the sample variance happened to be low: its intervals held the true
mean in 0.89-0.96 of simulated runs, this rule's in 0.944-0.986, at 1.0-1.6x the steps (8 at
least instead of 5; benchmarks/dry_run_coverage.py, RESULTS.md "Dry-run measurement noise").
- Warm-up: the dry runner's untimed warm-up steps absorb the first-step costs (lazy init, the
  optimizer state's allocation); a later slow step is handled as an outlier.
- Outliers: a step that another process's burst of work preempted is not a property of the
  candidate. Samples above median + OUTLIER_SCALES robust standard deviations (1.4826 x MAD)
  are left out of the mean and the interval, the slowest first and at most MAX_OUTLIER_FRACTION
  of the samples: slowness beyond that is the candidate's own (or a lasting change of load) and
  stays in. The pilot's own outliers are judged within the pilot, so s0 never changes later.
- Short steps: `steps_per_sample` groups steps so that one timed sample lasts at least
  MIN_SAMPLE_SECONDS, far above the clock's resolution and the per-sample synchronization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

CONFIDENCE = 0.95
# 6, not 4: with the MAD of 8 samples as the scale, 4 cut the upper tail of plain normal step
# times often enough to bias the mean and the spread low (coverage 0.92-0.94 instead of 0.95);
# a preempted step (1.5-3x) is still 10+ robust standard deviations out at a few % of jitter.
OUTLIER_SCALES = 6.0
MAX_OUTLIER_FRACTION = 0.2
# perf_counter resolves ~100 ns; a cuda synchronize and the per-sample all-reduce cost 0.01-1 ms
# and sit outside the timed region, so 10 ms samples leave timer error below 1e-4 relative.
MIN_SAMPLE_SECONDS = 0.01
MAX_STEPS_PER_SAMPLE = 16
MIN_SAMPLES_FOR_INTERVAL = 3
# Samples whose spread fixes the interval (Stein's first stage). 8, not fewer: the half-width
# carries t(k0 - 1), and the samples needed grow as its square (t(4) = 2.78 asked for 1.9x the
# samples of a known spread; t(7) = 2.36 asks for 1.45x).
PILOT_SAMPLES = 8


@dataclass(frozen=True)
class StepTimeSummary:
    """Mean per-step seconds of the kept samples and its 95% confidence half-width."""

    mean_s: float
    half_width_s: float          # inf with fewer than MIN_SAMPLES_FOR_INTERVAL kept samples
    kept: int
    outliers: int
    spread_s: float = math.nan   # one sample's standard deviation: the pilot's s0, or all kept samples' if larger
    df: int = 0                  # the pilot's degrees of freedom (the half-width's t)

    @property
    def relative_half_width(self) -> float:
        return self.half_width_s / self.mean_s if self.mean_s > 0 else math.inf

    def throughput(self, samples_per_step: float) -> float:
        return samples_per_step / self.mean_s

    def throughput_interval(self, samples_per_step: float) -> Optional[Tuple[float, float]]:
        """95% interval of samples/s (the step-time interval inverted); None when it is unbounded."""
        low_s, high_s = self.mean_s - self.half_width_s, self.mean_s + self.half_width_s
        if not math.isfinite(self.half_width_s) or low_s <= 0:
            return None
        return samples_per_step / high_s, samples_per_step / low_s


@lru_cache(maxsize=256)
def t_quantile(degrees_of_freedom: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided Student t critical value (2.776 for 4 degrees of freedom at 95%)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, degrees_of_freedom))


def summarize(step_times_s: Sequence[float], pilot: int = PILOT_SAMPLES) -> StepTimeSummary:
    """Mean of the kept samples and the 95% half-width t(k0 - 1) * s / sqrt(n) of Stein's rule, s the
    larger of the first `pilot` samples' spread and all kept samples', rare high outliers left out
    (module docstring)."""
    times = [float(t) for t in step_times_s]
    if not times or any(not math.isfinite(t) or t <= 0 for t in times):
        raise ValueError(f"step times must be positive and finite, got {times}")
    if pilot < 1:
        raise ValueError(f"pilot={pilot} must be >= 1")
    kept = without_outliers(times)
    n = len(kept)
    mean = sum(kept) / n
    # A pilot below MIN_SAMPLES_FOR_INTERVAL (profile_steps=1) could never give an interval.
    first = without_outliers(times[:max(pilot, MIN_SAMPLES_FOR_INTERVAL)])
    k0 = len(first)
    if k0 < 2:
        return StepTimeSummary(mean, math.inf, n, len(times) - n)
    spread = _spread(first)
    if n > k0:
        # Never narrower than the spread of every kept sample: slow steps that stayed in (too
        # many to be outliers, or too mild to be called one) move the mean, and an interval from a
        # quiet pilot would not show it (10% of the steps 2-3x slower: coverage 0.90-0.91 with s0
        # alone). Only ever wider than Stein's interval, so its coverage holds.
        spread = max(spread, _spread(kept))
    half = t_quantile(k0 - 1) * spread / math.sqrt(n) if k0 >= MIN_SAMPLES_FOR_INTERVAL else math.inf
    return StepTimeSummary(mean, half, n, len(times) - n, spread, k0 - 1)


def _spread(samples: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); inf when the squares overflow a float (times that differ
    by more than ~1e154, which only a broken timer or evaluator reports: an unbounded interval)."""
    mean = sum(samples) / len(samples)
    try:
        return math.sqrt(sum((t - mean) ** 2 for t in samples) / (len(samples) - 1))
    except OverflowError:
        return math.inf


def without_outliers(times: Sequence[float]) -> list:
    """The samples the mean is taken over: all but the rare high outliers (module docstring).
    The search computes a dry run's variance from the same samples (`search/stats.py`)."""
    median = _median(times)
    mad = _median([abs(t - median) for t in times])
    # A floor of 1% of the median: with identical times (MAD 0) nothing is an outlier by a hair.
    scale = max(1.4826 * mad, 0.01 * median)
    limit = median + OUTLIER_SCALES * scale
    # The slowest first, and never more than MAX_OUTLIER_FRACTION of the samples: a rule with a
    # cliff (drop all outliers, or none once there are too many) flips on one borderline sample.
    droppable = sorted((i for i, t in enumerate(times) if t > limit), key=lambda i: -times[i])
    dropped = set(droppable[:int(MAX_OUTLIER_FRACTION * len(times))])
    return [t for i, t in enumerate(times) if i not in dropped]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def is_precise_enough(step_times_s: Sequence[float], target_relative: float, min_samples: int) -> bool:
    """True once the `min_samples` pilot samples are in and the relative half-width (with the
    pilot's spread, `summarize(..., pilot=min_samples)`) is <= `target_relative`."""
    if len(step_times_s) < max(min_samples, MIN_SAMPLES_FOR_INTERVAL):
        return False
    return summarize(step_times_s, pilot=min_samples).relative_half_width <= target_relative


def steps_per_sample(step_s: float, min_sample_s: float = MIN_SAMPLE_SECONDS,
                     cap: int = MAX_STEPS_PER_SAMPLE) -> int:
    """How many steps one timed sample groups so that it lasts at least `min_sample_s`."""
    if not math.isfinite(step_s) or step_s <= 0:
        return cap
    return max(1, min(cap, math.ceil(min_sample_s / step_s)))
