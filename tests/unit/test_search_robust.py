"""The search's robustness pieces, each in milliseconds: confidence intervals, failed trials,
out-of-memory learned as feasibility, interleaved re-measurement and its reason line, and the
bound on the planner's work. A recording planner stands in for HEBO (no GP fit) except in the
one `heavy` test of the real planner's work bound.
"""

import functools
import math
from typing import Dict, List

import numpy as np
import pytest
from scipy import stats as st

from atorch.auto.cost_model import Estimate
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.search.bo import Suggestion
from atorch.auto.search.search import Comparison
from atorch.auto.search.space import Candidate, memory_saving_ranks
from atorch.auto.search.stats import (LogEstimate, log_throughput_of_steps, mean_ci, pool_runs, ratio_ci,
                                      relative_half_width_to_log_var)
from atorch.auto.strategy import Strategy
from atorch.auto.user_errors import UserCodeError, UserTypeError, UserValueError


class LastPlanner:
    """Suggests the last remaining candidate (the enumeration's most memory-saving first)."""

    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds = 0.0

    def suggest(self, observed, remaining, log_fit=None):
        return Suggestion(list(remaining)[-1], 0.0, "last", len(remaining))


class RecordingPlanner:
    """Suggests the first remaining candidate; records what it was shown."""

    instances: List["RecordingPlanner"] = []

    def __init__(self, labels, choices, prior, seed):
        self.calls = []
        self.expected_seconds = 0.0
        RecordingPlanner.instances.append(self)

    def suggest(self, observed, remaining, log_fit=None):
        self.calls.append(([o.index for o in observed], list(remaining)))
        return Suggestion(list(remaining)[0], 0.0, "first", len(remaining))


def space16() -> SearchSpace:
    """Real optimizations: zero and checkpoint are memory-ordered, amp is not."""
    return SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
                        "amp": [None, "amp_native"]}, world_size=2)


def steps_for(throughput: float, rel: float, n: int = 5, batch: float = 32.0, seed: int = 0) -> tuple:
    """n step times whose mean gives `throughput` and whose spread is `rel` (relative)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 1, size=n)
    z = (z - z.mean()) / z.std(ddof=1)
    step = batch / throughput
    return tuple(float(step * (1 + rel * v)) for v in z)


# -- statistics -----------------------------------------------------------------------------------

def test_mean_ci_is_student_t():
    x = [1.0, 2.0, 3.0, 4.0]
    m, lo, hi = mean_ci(x)
    half = st.t.ppf(0.975, 3) * np.std(x, ddof=1) / 2
    assert m == 2.5 and lo == pytest.approx(2.5 - half) and hi == pytest.approx(2.5 + half)
    with pytest.raises(ValueError, match="at least 2 samples"):
        mean_ci([1.0])
    with pytest.raises(ValueError, match="confidence=1.5"):
        mean_ci(x, confidence=1.5)


def test_log_throughput_of_steps_and_half_width():
    est = log_throughput_of_steps([2.0, 2.0, 2.0])
    assert est.mean == pytest.approx(-math.log(2.0)) and est.var == 0 and est.df == 2
    est = log_throughput_of_steps([1.0, 3.0])
    assert est.var == pytest.approx(2.0 / (2 * 4.0))          # s^2 / (k mean^2)
    assert log_throughput_of_steps([1.0]) is None
    assert log_throughput_of_steps([1.0, float("nan"), -2.0]) is None
    # Steps 1e300 apart (a broken timer) overflow the squares: the noise is unknown, not an error.
    assert log_throughput_of_steps([1.0, 1.0, 1.0, 1e300]) is None
    assert log_throughput_of_steps([1e-300, 1e300, 1.0]) is None
    # The spread of a long run is the pilot's (the first 8 steps), never below all the steps'.
    pilot = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95]
    est = log_throughput_of_steps(pilot * 2 + [1.02, 0.98] * 2)
    assert est.df == 7 and est.var == pytest.approx(np.var(pilot, ddof=1) / 20, rel=1e-9)
    # +-3% at 95% (normal) is a log standard error of log(1.03)/1.96.
    assert relative_half_width_to_log_var(0.03) == pytest.approx((math.log(1.03) / 1.959964) ** 2)


def test_ratio_ci_delta_method():
    a = LogEstimate(math.log(112.0), 0.0002, math.inf, 2)
    b = LogEstimate(math.log(100.0), 0.0002, math.inf, 2)
    ci = ratio_ci(a, b)
    half = 1.959964 * math.sqrt(0.0004)
    assert ci.ratio == pytest.approx(1.12)
    assert ci.lo == pytest.approx(1.12 * math.exp(-half)) and ci.hi == pytest.approx(1.12 * math.exp(half))
    assert ci.separated
    # Few degrees of freedom widen it (Welch-Satterthwaite: 2 x 4 -> 8).
    narrow_df = ratio_ci(LogEstimate(a.mean, a.var, 4, 1), LogEstimate(b.mean, b.var, 4, 1))
    assert narrow_df.hi - narrow_df.lo == pytest.approx(ci.ratio * 2 * math.sinh(st.t.ppf(0.975, 8) * 0.02), rel=1e-6)
    tie = ratio_ci(LogEstimate(math.log(101.0), 0.001, 8, 2), b)
    assert not tie.separated and tie.lo < 1 < tie.hi
    exact = ratio_ci(LogEstimate(0.5, 0.0, math.inf, 1), LogEstimate(0.0, 0.0, math.inf, 1))
    assert exact.lo == exact.hi == exact.ratio == pytest.approx(math.exp(0.5))


def test_pool_runs_between_and_within():
    # One run: its own variance. Unknown variance: no estimate.
    assert pool_runs([1.0], [0.01], [4]) == LogEstimate(1.0, 0.01, 4.0, 1)
    assert pool_runs([1.0], [None]) is None
    # Two runs agreeing with their steps: the per-run variance is the larger of the between-run
    # spread and the steps' (never pooled with the steps' df: 1 df, as much as the runs give).
    est = pool_runs([1.00, 1.01], [0.0004, 0.0004], [4, 4])
    assert est.mean == pytest.approx(1.005) and est.df == 1 and est.var == pytest.approx(0.0004 / 2)
    # Two runs 30% apart while each claims 1%: the between-run spread wins, with its 1 df.
    far = pool_runs([1.0, 1.3], [0.0001, 0.0001], [4, 4])
    assert far.df == 1 and far.var == pytest.approx(0.3 ** 2 / 2 / 2)
    # No step variance at all: between-run only.
    assert pool_runs([1.0, 1.2], [None, None]).df == 1


# -- failed trials and feasibility ----------------------------------------------------------------

def test_failed_trials_never_reach_the_planner_and_are_retried_at_most_once():
    RecordingPlanner.instances.clear()
    space = space16()
    strategies = space.strategies()
    table = {s: 10.0 + i for i, s in enumerate(strategies)}
    raising, timing_out = strategies[3], strategies[5]

    def evaluator(s):
        if s == raising:
            raise RuntimeError("boom")
        if s == timing_out:
            return DryRunResult(0.0, None, "timeout")
        return DryRunResult(table[s], 100)

    result = search_strategy(space, evaluator, max_trials=18, patience=18, random_samples=1,
                             planner_factory=RecordingPlanner)
    planner = RecordingPlanner.instances[-1]
    bad = {strategies.index(raising), strategies.index(timing_out)}
    tried = [s for s in result.evaluated]
    # A timeout may be the machine's: one retry (`FailureModel.p_retry_runs`), never a third run; "boom" reads
    # like the strategy's own and no failure was seen not to repeat: not retried.
    assert tried.count(raising) == 1 and tried.count(timing_out) == 2
    for observed, remaining in planner.calls:
        assert not bad & set(observed), "a failed trial was given to the surrogate"
        assert len(set(observed)) == len(observed)
    # A candidate already tried is never offered again, unless its only dry run failed.
    index = {st_: i for i, st_ in enumerate(strategies)}
    rows = [k for k, src in enumerate(result.trials["source"]) if src in ("hebo-first", "retry")]
    assert len(rows) == len(planner.calls)
    for k, (_, remaining) in zip(rows, planner.calls):
        offered_again = {index[x] for x in result.evaluated[:k]} & set(remaining)
        assert offered_again <= {i for i in bad if result.evaluated[:k].count(strategies[i]) == 1}
    assert result.best == max(table, key=table.get)


def test_out_of_memory_before_anything_ran_does_not_use_up_patience():
    """A model that needs a leaner strategy than any tried first: the search goes on down to one
    that fits (it stopped after `patience` out-of-memory runs, with nothing found)."""
    space = space16()
    lean = {c.strategy for c in space.candidates() if "fsdp" in c.label() and "checkpoint" in c.label()}

    def evaluator(s):
        if s in lean:
            return DryRunResult(100.0, 10, None, 0.32, (0.32, 0.33, 0.31))
        return DryRunResult(0.0, 10**9, "oom: rank 0: out of memory")

    result = search_strategy(space, evaluator, max_trials=16, patience=2, random_samples=0,
                             planner_factory=RecordingPlanner)
    assert result.best in lean and (result.trials["status"] == "oom").sum() > 2


def test_the_same_error_everywhere_stops_at_patience_and_is_in_the_reason():
    """A loss or model that raises under every strategy: `patience` dry runs, and the one line the
    user reads says what the error was."""
    def evaluator(s):
        raise TypeError("linear(): argument 'input' (position 1) must be Tensor, not list")

    result = search_strategy(space16(), evaluator, max_trials=16, patience=3, random_samples=0,
                             planner_factory=RecordingPlanner)
    assert result.best is None and len(result.trials) == 3
    assert "3x \"exception: TypeError: linear(): argument 'input' (position 1) must be Tensor, not list\"" \
        in result.reason
    assert "3 dry runs failed (not out of memory) before any ran" in result.reason


@pytest.mark.parametrize("error", [
    "user: rank 1: ValueError: loss_func <lambda> returned a loss of shape (60,); it must return a scalar",
    UserTypeError("loss_func <lambda> returned a dict; it must return a scalar torch.Tensor"),
])
def test_an_error_in_the_users_code_stops_the_search_at_the_first_dry_run(error):
    """A loss of the wrong shape fails every candidate alike: the search raises it at once (it used to charge it
    to `patience` candidates, each built in full, and end with "no strategy runs")."""
    calls = []

    def evaluator(s):
        calls.append(s)
        if isinstance(error, Exception):
            raise error
        return DryRunResult(0.0, None, error)

    expected = UserTypeError if isinstance(error, TypeError) else ValueError
    with pytest.raises(expected, match=r"loss_func <lambda> returned a .* \(the dry run of .* raised it"
                                       r"( on rank 1)?; the search stopped there: no strategy changes an error in "
                                       r"the code or data it was given\)") as raised:
        search_strategy(space16(), evaluator, max_trials=16, patience=3, random_samples=0,
                        planner_factory=RecordingPlanner)
    assert len(calls) == 1 and isinstance(raised.value, UserCodeError)


def test_the_dry_runner_reports_a_user_error_before_any_other_ranks():
    from atorch.auto.dry_runner import _classify, _LocalOutcome, merge_outcomes

    outcomes = [_LocalOutcome(rank=r) for r in range(3)]
    _classify(outcomes[0], RuntimeError("CUDA out of memory"))
    _classify(outcomes[1], UserValueError("train_step: batch['input_ids'] holds token id 70000"))
    _classify(outcomes[2], ValueError("some candidate's own error"))
    merged = merge_outcomes(outcomes)
    assert merged.status == "user"
    assert merged.error == "user: rank 1: ValueError: train_step: batch['input_ids'] holds token id 70000"


def test_oom_is_learned_by_dominance_without_a_predictor():
    """OOM at (zero=none, checkpoint=none, amp=a) skips every candidate saving no more memory with the same amp."""
    space = space16()
    cands = space.candidates()
    ranks = memory_saving_ranks(space)
    assert ranks[0] == [(0.0,), (1.0,), (2.0,), (3.0,)] and ranks[1] == [(0.0,), (1.0,)] and ranks[2] is None
    # True memory: zero saves, checkpoint saves, amp on costs 10%: OOM below zero2 without checkpoint.
    def memory(c: Candidate) -> float:
        return 100.0 * (0.7 ** c.choices[0]) * (0.6 ** c.choices[1]) * (1.1 if c.choices[2] else 1.0)
    limit = 60.0
    by_strategy = {c.strategy: c for c in cands}

    def evaluator(s):
        m = memory(by_strategy[s])
        return DryRunResult(0.0, int(m), "oom") if m > limit else DryRunResult(10.0 + by_strategy[s].choices[0], int(m))

    result = search_strategy(space, evaluator, max_trials=16, patience=16, random_samples=0,
                             planner_factory=LastPlanner, remeasure_rounds=0)
    ooms = [by_strategy[s] for s, st_ in zip(result.evaluated, result.trials["status"]) if st_ == "oom"]
    assert ooms, "the landscape must have out-of-memory candidates"
    # No candidate needing at least the memory of an earlier OOM was run while others were left
    # (then the budget left goes to them, last).
    retried = int((result.trials["source"] == "pruned-retry").sum())
    assert retried and (result.trials["source"].iloc[len(cands) - retried:] == "pruned-retry").all()
    for k, s in enumerate(result.evaluated[:len(cands) - retried]):
        c = by_strategy[s]
        for earlier in result.evaluated[:k]:
            e = by_strategy[earlier]
            if e in ooms:
                dominated = (c.choices[0] <= e.choices[0] and c.choices[1] <= e.choices[1]
                             and c.choices[2] == e.choices[2])
                assert not dominated, (c.strategy.describe(), e.strategy.describe())
    assert len(result.trials) == len(cands) and result.pruned.empty


# -- re-measurement and the reason line -----------------------------------------------------------

def remeasure_search(table: Dict[Strategy, float], rel: float, memory: Dict[Strategy, int], max_trials=10):
    calls = []

    def evaluator(s):
        calls.append(s)
        k = len(calls)
        return DryRunResult(table[s], memory.get(s, 1000), step_times_s=steps_for(table[s], rel, seed=k))

    result = search_strategy(space16(), evaluator, max_trials=max_trials, patience=99, random_samples=1,
                             planner_factory=RecordingPlanner)
    return result, calls


def test_top_two_are_remeasured_interleaved_and_separated():
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    a, b = strategies[-1], strategies[-2]
    table[a], table[b] = 106.0, 100.0      # apart, but not by more than CLEAR_LEAD: re-measured
    result, calls = remeasure_search(table, 0.01, {}, max_trials=20)
    remeasured = result.trials[result.trials["source"] == "remeasure"]["strategy"].tolist()
    assert remeasured[:2] == [a.describe(), b.describe()]          # A, B (then A, B if still unresolved)
    assert len(calls) == len(result.trials) <= 20
    cmp_ = result.comparison
    assert isinstance(cmp_, Comparison) and cmp_.winner == a and cmp_.runner_up == b and cmp_.separated
    assert cmp_.ratio == pytest.approx(1.06, rel=0.01) and cmp_.lo > 1.0 and cmp_.chosen_by == "throughput"
    assert result.best == a and result.best_throughput == pytest.approx(106.0, rel=0.01)
    assert result.reason.startswith(f"{a.describe()}: 1.06x {b.describe()} (95% CI ")
    assert (result.trials["throughput_lo"] < result.trials["throughput"]).all()
    assert (result.trials["throughput_hi"] > result.trials["throughput"]).all()


def test_within_noise_the_smaller_memory_wins_and_says_so(tmp_path):
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    a, b = strategies[-1], strategies[-2]
    table[a], table[b] = 100.5, 100.0
    memory = {a: 1000, b: 700}
    # Measured too loosely to tell what choosing the leaner one costs: the higher mean wins.
    result, calls = remeasure_search(table, 0.10, memory, max_trials=20)
    assert not result.comparison.separated and result.comparison.chosen_by == "measured mean"
    # Precisely enough that the expected cost is small: the leaner one wins, and the report says why.
    result, calls = remeasure_search(table, 0.02, memory, max_trials=20)
    cmp_ = result.comparison
    assert not cmp_.separated and cmp_.chosen_by == "memory" and cmp_.winner == b
    assert cmp_.memory_saving == pytest.approx(0.3)
    assert result.best == b
    assert f"{b.describe()} and {a.describe()} within noise (" in result.reason
    assert f"chose {b.describe()}: 30% less memory" in result.reason
    # 2 rounds (A, B, A, B) when the first does not separate them, all within max_trials.
    assert (result.trials["source"] == "remeasure").sum() == 4 and len(calls) <= 20
    # The report shows the intervals: table columns and error bars in the plot.
    from atorch.auto.search.report import plot_trials, trials_table

    assert "throughput_lo" in trials_table(result)
    with open(plot_trials(result, str(tmp_path / "search.png")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_remeasure_without_reported_noise_or_budget():
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    plain = search_strategy(space16(), lambda s: DryRunResult(table[s]), max_trials=8, patience=99,
                            planner_factory=RecordingPlanner)
    assert "remeasure" not in plain.trials["source"].tolist() and len(plain.trials) == 8
    assert plain.comparison.lo is None and plain.comparison.chosen_by == "measured mean"
    tiny = search_strategy(space16(), lambda s: DryRunResult(table[s], step_times_s=steps_for(table[s], 0.01)),
                           max_trials=3, patience=99, planner_factory=RecordingPlanner)
    assert len(tiny.trials) == 3


def test_a_last_dry_run_no_round_fits_goes_to_the_search():
    """The reserve for re-measuring is kept only while the leader is not clearly ahead; when a
    close rival shows up with one dry run left, that run cannot hold a round (two runs), so it
    goes to the search instead of being left unused."""
    first_seen: Dict[Strategy, float] = {}
    calls = []

    def evaluator(s):
        calls.append(s)
        if s not in first_seen:   # the 1st candidate leads by 2x, the 9th comes within 3% of it
            first_seen[s] = 200.0 if not first_seen else 195.0 if len(first_seen) == 8 else 100.0
        tp = first_seen[s]
        return DryRunResult(tp, 1000, step_times_s=steps_for(tp, 0.01, seed=len(calls)))

    result = search_strategy(space16(), evaluator, max_trials=10, patience=99, random_samples=1,
                             planner_factory=RecordingPlanner)
    assert len(calls) == len(result.trials) == 10
    assert result.trials["source"].tolist()[-1] == "hebo-first"     # a search trial, not half a round
    assert result.stop_reason == "max_trials=10 reached"


# -- the planner's work is bounded ----------------------------------------------------------------

def test_planner_sees_only_feasible_untried_candidates():
    RecordingPlanner.instances.clear()
    space = space16()
    strategies = space.strategies()
    table = {s: 10.0 + i for i, s in enumerate(strategies)}
    result = search_strategy(space, lambda s: DryRunResult(table[s]), max_trials=12, patience=99,
                             random_samples=2, planner_factory=RecordingPlanner)
    planner = RecordingPlanner.instances[-1]
    for observed, remaining in planner.calls:
        assert not set(observed) & set(remaining) and len(remaining) <= len(strategies)
    assert len(planner.calls) == len(result.trials) - (result.trials["source"] != "hebo-first").sum()


@pytest.mark.heavy
def test_hebo_planner_work_is_bounded_on_large_spaces():
    """One suggestion on 2000 candidates: one GP fit on the observed trials, at most MAX_SCORED scored."""
    from atorch.auto.search.bo import MAX_SCORED, CandidatePlanner, Observation

    rng = np.random.default_rng(0)
    labels = [[f"o{k}" for k in range(n)] for n in (4, 5, 10, 10)]
    choices = [tuple(int(rng.integers(len(c))) for c in labels) for _ in range(2000)]
    prior = [float(v) for v in rng.normal(size=2000)]
    planner = CandidatePlanner(labels, choices, prior=prior, seed=0)
    observed = [Observation(i, float(rng.normal()), 0.001) for i in range(10)]
    suggestion = planner.suggest(observed, list(range(10, 2000)))
    assert planner.fits == 1 and suggestion.scored == MAX_SCORED == planner.max_scored
    assert 10 <= suggestion.index < 2000 and suggestion.how == "acquisition"


def test_hebo_planner_posterior_pools_measurements_and_refits_on_a_new_prior():
    """The posterior at measured candidates follows their measurements; one fit serves the next
    suggestion and posterior on the same trials; a new predictor feature forces a new fit."""
    from atorch.auto.search.bo import CandidatePlanner, Observation

    labels = [["a", "b"], ["x", "y", "z"], ["p", "q"]]
    choices = [(i, j, k) for i in range(2) for j in range(3) for k in range(2)]
    truth = {c: 1.0 * c[0] - 0.5 * c[1] + 0.3 * c[2] for c in choices}     # additive log-throughput
    prior = [truth[c] for c in choices]
    planner = CandidatePlanner(labels, choices, prior=prior, seed=0)
    seen = [0, 3, 5, 6, 9, 11]
    observed = [Observation(i, truth[choices[i]], 1e-4) for i in seen]
    suggestion = planner.suggest(observed, [i for i in range(len(choices)) if i not in seen])
    post = planner.posterior(observed, seen)
    assert planner.fits == 1 and suggestion.how == "acquisition"
    assert all(abs(post[i][0] - truth[choices[i]]) < 0.2 and post[i][1] >= 0 for i in seen)
    best, worst = max(seen, key=lambda i: truth[choices[i]]), min(seen, key=lambda i: truth[choices[i]])
    assert post[best][0] > post[worst][0]
    planner.update_prior([-v for v in prior])
    planner.posterior(observed, seen)
    assert planner.fits == 2


class PosteriorPlanner(RecordingPlanner):
    """RecordingPlanner with a surrogate posterior: a measured candidate at its pooled
    measurement; the untried candidate last in the enumeration at the leader's mean with a wide
    variance when `promising`, every other untried one far below."""

    def __init__(self, labels, choices, prior, seed, promising=True):
        super().__init__(labels, choices, prior, seed)
        self.promising = promising

    def posterior(self, observed, indices):
        seen = {o.index: (o.log_throughput, o.noise_var or 1e-4) for o in observed}
        top = max(m for m, _ in seen.values())
        promising = max((i for i in indices if i not in seen), default=None)
        return {i: seen[i] if i in seen else (top, 0.05) if i == promising and self.promising else (top - 1, 1e-4)
                for i in indices}


def newcomer_search(promising: bool, newcomer_fails: bool = False):
    """16 candidates, 10 dry runs: 8 searched, then one round of re-measurement (`newcomer_fails`:
    the 10th dry run raises)."""
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    calls = []

    def evaluator(s):
        calls.append(s)
        if newcomer_fails and len(calls) == 10:
            raise RuntimeError("the newcomer cannot run")
        return DryRunResult(table[s], 1000, step_times_s=steps_for(table[s], 0.01, seed=len(calls)))

    result = search_strategy(space16(), evaluator, max_trials=10, patience=99, random_samples=0,
                             planner_factory=functools.partial(PosteriorPlanner, promising=promising))
    searched = calls[:8]
    leader = max(searched, key=table.get)
    return result, calls, leader, sorted(searched, key=table.get)[-2]


def test_the_leader_is_remeasured_against_an_untried_candidate_likelier_to_beat_it():
    """An untried candidate that the surrogate gives a better chance of beating the leader than
    the measured runner-up has (x its chance to run) is the round's challenger, measured right
    after the leader's repeat; otherwise the round is the leader and the runner-up."""
    result, calls, leader, runner_up = newcomer_search(promising=True)
    assert len(calls) == len(result.trials) == 10
    assert list(result.trials["source"])[-2:] == ["remeasure", "challenger"]
    assert calls[8] == leader and calls[9] not in calls[:8]
    assert calls[9] == max(set(space16().strategies()) - set(calls[:8]), key=space16().strategies().index)
    assert result.best == max(calls, key=lambda s: 50.0 + space16().strategies().index(s))
    # Nothing likelier than the runner-up: the usual round.
    result, calls, leader, runner_up = newcomer_search(promising=False)
    assert list(result.trials["source"])[-2:] == ["remeasure", "remeasure"] and calls[8:] == [leader, runner_up]
    # A newcomer that fails costs its dry run only: the leader, re-measured, is compared with the
    # measured runner-up as before.
    result, calls, leader, runner_up = newcomer_search(promising=True, newcomer_fails=True)
    assert list(result.trials["status"])[-1] == "exception" and list(result.trials["source"])[-1] == "challenger"
    assert result.best == leader and result.comparison.runner_up == runner_up
    assert result.comparison.runs == (2, 1)


# -- what an evaluator reports, read leniently -----------------------------------------------------

def _table_search(report, max_trials=8, memory_limit_bytes=None):
    """A search on space16 whose evaluator answers `report(strategy, throughput)` from a fixed table."""
    space = space16()
    table = {s: 100.0 + 10 * i for i, s in enumerate(space.strategies())}
    result = search_strategy(space, lambda s: report(s, table[s]), max_trials=max_trials,
                             planner_factory=RecordingPlanner, memory_limit_bytes=memory_limit_bytes)
    return result, table


@pytest.mark.parametrize("kind", [np.float32, np.float64, np.int64])
def test_a_numpy_throughput_is_a_throughput(kind):
    result, table = _table_search(lambda s, tp: DryRunResult(kind(tp), 100))
    assert (result.trials["status"] == "ok").all() and result.best is not None
    assert result.best_throughput == pytest.approx(max(table[s] for s in result.evaluated), rel=1e-6)


def test_a_bool_throughput_is_a_failed_trial_naming_its_type():
    result, _ = _table_search(lambda s, tp: DryRunResult(True, 100))
    assert result.best is None and (result.trials["status"] == "exception").all()
    assert "throughput True (bool" in result.trials["reason"].iloc[0]


def test_step_times_as_a_numpy_array_are_read_and_junk_ones_are_dropped(caplog):
    ok, _ = _table_search(lambda s, tp: DryRunResult(tp, 100, step_times_s=np.array(steps_for(tp, 0.02))))
    assert (ok.trials["status"] == "ok").all() and ok.trials["throughput_lo"].notna().all()
    with caplog.at_level("WARNING", logger="atorch.auto.search.trials"):
        junk, _ = _table_search(lambda s, tp: DryRunResult(tp, 100, step_times_s=[1.0, "x"]))
    assert (junk.trials["status"] == "ok").all() and junk.best is not None
    assert sum("step_times_s" in r.getMessage() for r in caplog.records) == 1     # once per search


@pytest.mark.parametrize("ci", [(120.0, 80.0), (1.0, 2.0, 3.0), (1e6, 2e6), (float("nan"), 1e9), "wide"])
def test_an_interval_that_does_not_hold_its_throughput_is_dropped_and_the_report_still_plots(ci, tmp_path):
    from atorch.auto.search.report import write_report

    result, _ = _table_search(lambda s, tp: DryRunResult(tp, 100, throughput_ci=ci))
    assert (result.trials["status"] == "ok").all() and result.best is not None
    assert result.trials["throughput_lo"].isna().all() and result.trials["throughput_hi"].isna().all()
    write_report(result, str(tmp_path))
    assert (tmp_path / "best_strategy.json").exists()


@pytest.mark.parametrize("error", ["OOM", "CUDA out of memory. Tried to allocate 2 GiB", "RuntimeError: out of memory",
                                   "oom: simulated"])
def test_an_out_of_memory_error_is_recognised_however_it_is_worded(error):
    assert DryRunResult(0.0, None, error).status == "oom"
    assert DryRunResult(0.0, None, "Timeout: 600 s").status == "timeout"
    assert DryRunResult(0.0, None, "segfault").status == "failed"


def test_a_run_over_the_memory_limit_is_kept_with_one_warning(caplog):
    with caplog.at_level("WARNING", logger="atorch.auto.search.trials"):
        result, _ = _table_search(lambda s, tp: DryRunResult(tp, 5000), memory_limit_bytes=1000)
    assert (result.trials["status"] == "ok").all() and result.best is not None
    assert sum("over the memory limit" in r.getMessage() for r in caplog.records) == 1


def test_a_leader_that_fails_its_remeasurement_is_named_in_the_reason():
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    calls = []

    def evaluator(s):
        calls.append(s)
        if calls.count(s) == 2 and table[s] == max(table[c] for c in calls):
            return DryRunResult(0.0, None, "oom: flaky")
        return DryRunResult(table[s], 1000, step_times_s=steps_for(table[s], 0.01, seed=len(calls)))

    result = search_strategy(space16(), evaluator, max_trials=10, patience=99, random_samples=0,
                             planner_factory=RecordingPlanner)
    flaky = max(calls, key=table.get)
    assert calls.count(flaky) == 2 and result.best != flaky
    assert f"{flaky.describe()} measured {table[flaky]:.4g} samples/s but failed when run again (oom)" in result.reason


def test_a_separated_claim_on_a_single_run_says_what_its_interval_leaves_out():
    a, b = Strategy(["amp_native"]), Strategy(["fsdp"])
    once = Comparison(a, b, 1.2, 1.1, 1.3, "throughput", runs=(1, 2)).line()
    assert once.endswith("; one dry run of the winner: the interval holds the noise within a run, not load changes "
                         "between runs")
    assert "one dry run of each" in Comparison(a, b, 1.2, 1.1, 1.3, "throughput", runs=(1, 1)).line()
    assert "one dry run" not in Comparison(a, b, 1.2, 1.1, 1.3, "throughput", runs=(2, 3)).line()
    assert "one dry run" not in Comparison(a, b, 1.01, 0.95, 1.07, "measured mean", runs=(1, 1)).line()


def test_a_plain_mean_throughput_is_rederived_from_the_outlier_free_steps():
    """An evaluator reporting batch / plain mean: one 8x spike made the point estimate 13 samples/s next to an
    interval (from the spike-free steps) around it, excluding the true 32."""
    from atorch.auto.search.trials import checked_result

    steps = (1.0, 1.01, 0.99, 1.0, 8.0)
    mean = sum(steps) / len(steps)
    spiky = DryRunResult(32 / mean, 10, None, mean, steps)
    checked = checked_result(spiky, None, Strategy(["fsdp"]), set())
    assert checked.throughput == pytest.approx(32.0, rel=0.01) and checked.step_time_s == pytest.approx(1.0, rel=0.01)
    without_mean = checked_result(DryRunResult(32 / mean, 10, None, None, steps), None, Strategy(["fsdp"]), set())
    assert without_mean.throughput == pytest.approx(32.0, rel=0.01)
    # The evaluator's own interval means its own statistic: kept as reported.
    own = checked_result(DryRunResult(32 / mean, 10, None, mean, steps, (5.0, 20.0)), None, Strategy(["fsdp"]), set())
    assert own.throughput == 32 / mean
    quiet = DryRunResult(32.0, 10, None, 1.0, (1.0, 1.02, 0.98, 1.0))      # nothing left out: unchanged
    assert checked_result(quiet, None, Strategy(["fsdp"]), set()).throughput == 32.0


def test_the_comparison_line_prints_ratios_to_two_decimals_and_every_reason():
    """"1.00x (95% CI 0.97-1.04)", not "1x (95% CI 0.965-1.04)"; a winner chosen by its higher mean
    that is also the leaner one says both."""
    from atorch.auto.search.results import Comparison

    a, b = Strategy(["amp_native", "fsdp"]), Strategy(["amp_native"])
    separated = Comparison(a, b, 1.1, 1.1, 1.1, "throughput", runs=(2, 2)).line()
    assert separated == f"{a.describe()}: 1.10x {b.describe()} (95% CI 1.10-1.10)"
    tie = Comparison(a, b, 1.0, 0.965, 1.04, "measured mean", 0.5, (2, 2)).line()
    assert tie == (f"{a.describe()} and {b.describe()} within noise (1.00x, 95% CI 0.96-1.04); "
                   f"chose {a.describe()}: higher measured mean and 50% less memory")
    assert Comparison(a, b, 1.0, 0.97, 1.05, "memory", 0.3, (2, 2)).line().endswith(": 30% less memory")


def test_a_wide_within_noise_interval_says_it_rests_on_few_repeats():
    """At one repeated dry run the between-run variance has 1 degree of freedom (t = 12.7): `make demo` read
    "within noise (1.02x, 95% CI 0.66-1.58)" with nothing saying why. Said up to 2 repeats, not from 3, and
    only of an interval wider than 1.1x end to end."""
    from atorch.auto.search.results import Comparison

    a, b = Strategy(["amp_native", "fsdp"]), Strategy(["amp_native"])
    one = Comparison(a, b, 1.02, 0.66, 1.58, "measured mean", runs=(1, 2), between_runs=True, between_df=1.0).line()
    assert one.endswith("; the interval is wide: the noise between dry runs rests on 1 repeated run (a larger "
                        "max_trials re-measures more)")
    two = Comparison(a, b, 1.02, 0.8, 1.3, "measured mean", runs=(2, 2), between_runs=True, between_df=2.0).line()
    assert "rests on 2 repeated runs" in two
    assert "is wide" not in Comparison(a, b, 1.02, 0.95, 1.1, "measured mean", runs=(2, 3), between_runs=True,
                                       between_df=3.0).line()
    assert "is wide" not in Comparison(a, b, 1.0, 0.97, 1.05, "measured mean", runs=(1, 2), between_runs=True,
                                       between_df=1.0).line()
    assert "is wide" not in Comparison(a, b, 1.3, 1.1, 1.5, "throughput", runs=(2, 2), between_runs=True,
                                       between_df=1.0).line()


def test_the_comparison_reports_the_degrees_of_freedom_of_its_between_run_variance():
    """The comparison carries the degrees of freedom its between-run variance rests on (the repeats of
    re-measured candidates, the cold first dry run left out)."""
    calls: List[Strategy] = []

    def evaluator(s: Strategy) -> DryRunResult:     # every candidate alike: the leader is never clearly ahead
        calls.append(s)
        return DryRunResult(100.0, 1000, step_times_s=steps_for(100.0, 0.01, seed=len(calls)))

    result = search_strategy(space16(), evaluator, max_trials=10, patience=99, random_samples=0,
                             planner_factory=RecordingPlanner)
    # Each candidate's warm runs (the process's first dry run left out where its candidate ran again) less one.
    warm = {s: calls.count(s) - (1 if s == calls[0] and calls.count(s) > 1 else 0) for s in set(calls)}
    expected = sum(n - 1 for n in warm.values() if n > 1)
    assert expected >= 1, calls
    assert result.comparison is not None and result.comparison.between_df == expected
