"""The dry runner's stopping rule and interval (`atorch.auto.step_timing`), on synthetic step times."""

import math

import numpy as np
import pytest

from atorch.auto.step_timing import (MAX_OUTLIER_FRACTION, is_precise_enough, steps_per_sample, summarize,
                                     t_quantile)


def test_interval_is_student_t_over_the_mean():
    times = [0.10, 0.11, 0.09, 0.10, 0.12, 0.08]
    s = summarize(times)
    n, mean = len(times), float(np.mean(times))
    assert s.mean_s == pytest.approx(mean, rel=1e-12)
    # Student t with n - 1 = 5 degrees of freedom: 2.5706 at 95% (standard tables).
    assert t_quantile(5) == pytest.approx(2.5706, abs=1e-4)
    assert s.half_width_s == pytest.approx(2.5706 * np.std(times, ddof=1) / math.sqrt(n), rel=1e-4)
    low, high = s.throughput_interval(8)
    assert low == pytest.approx(8 / (mean + s.half_width_s)) and high == pytest.approx(8 / (mean - s.half_width_s))
    assert low < s.throughput(8) < high


def test_too_few_samples_have_no_interval():
    s = summarize([0.1, 0.2])
    assert math.isinf(s.half_width_s) and s.throughput_interval(8) is None
    assert not is_precise_enough([0.1, 0.1], 0.03, min_samples=1)    # an interval needs 3 samples
    with pytest.raises(ValueError, match="positive and finite"):
        summarize([0.1, 0.0])
    with pytest.raises(ValueError, match="positive and finite"):
        summarize([])


def test_stops_when_half_width_reaches_target():
    rng = np.random.default_rng(0)
    steady = list(0.1 * (1 + 0.01 * rng.standard_normal(5)))     # 1% jitter: precise after 5 samples
    assert is_precise_enough(steady, 0.03, min_samples=5)
    assert not is_precise_enough(steady[:4], 0.03, min_samples=5)     # the minimum comes first
    noisy = list(0.1 * (1 + 0.3 * rng.standard_normal(5)))       # 30% jitter: not yet
    assert not is_precise_enough(noisy, 0.03, min_samples=5)


def test_rare_slow_steps_are_left_out_frequent_ones_kept():
    base = [0.100, 0.101, 0.099, 0.102, 0.098, 0.100, 0.101, 0.099, 0.100, 0.100]
    preempted = base + [0.5]                 # one step another process stole the core from
    s = summarize(preempted)
    assert s.outliers == 1 and s.mean_s == pytest.approx(np.mean(base))
    # 6 of 16 steps slow: the candidate's own behaviour (or a lasting load change); at most 20% dropped.
    frequent = base + [0.3] * 6
    s = summarize(frequent)
    assert s.outliers == int(MAX_OUTLIER_FRACTION * len(frequent)) == 3
    assert s.mean_s == pytest.approx(np.mean(base + [0.3] * 3))
    # Identical times: nothing is an outlier, the half-width is 0.
    s = summarize([0.05] * 6)
    assert s.outliers == 0 and s.half_width_s == pytest.approx(0, abs=1e-15) and s.relative_half_width < 1e-12


def test_short_steps_are_grouped_into_samples():
    assert steps_per_sample(0.5) == 1
    assert steps_per_sample(0.004) == 3                # 3 x 4 ms >= 10 ms
    assert steps_per_sample(1e-6) == 16                # capped
    assert steps_per_sample(0.0) == 16


def test_dry_run_config_reads_the_budget_from_the_environment():
    from atorch.auto.dry_runner import DryRunConfig

    config = DryRunConfig.from_env({"ATORCH_DRYRUN_PROFILE_STEP": "4", "ATORCH_DRYRUN_MAX_STEPS": "12",
                                    "ATORCH_DRYRUN_MAX_SECONDS": "9.5", "ATORCH_DRYRUN_TARGET_CI": "0.05",
                                    "ATORCH_DRYRUN_SCRATCH_DIR": "/scratch"})
    assert (config.profile_steps, config.max_profile_steps, config.max_profile_seconds) == (4, 12, 9.5)
    assert config.target_relative_ci == 0.05 and config.scratch_dir == "/scratch"
    assert DryRunConfig.from_env({}) == DryRunConfig()
    # A minimum above the default budget raises the budget instead of failing.
    assert DryRunConfig.from_env({"ATORCH_DRYRUN_PROFILE_STEP": "50"}).max_profile_steps == 50
    with pytest.raises(ValueError, match="max_profile_steps=2 must be >= profile_steps=3"):
        DryRunConfig(profile_steps=3, max_profile_steps=2).validate()
    with pytest.raises(ValueError, match="ATORCH_DRYRUN_TARGET_CI"):
        DryRunConfig.from_env({"ATORCH_DRYRUN_TARGET_CI": "1.5"})
    with pytest.raises(ValueError, match="ATORCH_DRYRUN_MAX_SECONDS"):
        DryRunConfig(max_profile_seconds=0).validate()
