"""A failure that does not repeat (the machine's: a collective timed out under load) against one that does
(the strategy's own): what the search retries, what it declares, and what the reason line says."""

from typing import Dict, List

import pytest

from atorch.auto.search.bo import Suggestion
from atorch.auto.search.feasibility import TRANSIENT_PRIOR, FailureModel
from atorch.auto.search.results import DryRunResult
from atorch.auto.search.search import search_strategy
from atorch.auto.search.space import SearchSpace
from atorch.auto.strategy import Strategy

from tests.unit.test_search_robust import RecordingPlanner, space16, steps_for


def _flaky_leader_search(failures_of_the_leader: List[str], max_trials: int = 20):
    """A space16 search on a table whose fastest candidate fails its dry runs number 2, 3, ... with the
    given errors (its first run succeeds); every run reports step times, so the leader is re-measured."""
    strategies = space16().strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    leader = strategies[-1]
    table[leader] = 80.0          # ahead, but not by CLEAR_LEAD: re-measured
    table[strategies[-2]] = 75.0
    calls: List[Strategy] = []

    def evaluator(s):
        calls.append(s)
        n = calls.count(s)
        if s == leader and 2 <= n < 2 + len(failures_of_the_leader):
            return DryRunResult(0.0, None, failures_of_the_leader[n - 2])
        return DryRunResult(table[s], 1000, step_times_s=steps_for(table[s], 0.01, seed=len(calls)))

    result = search_strategy(space16(), evaluator, max_trials=max_trials, patience=99, random_samples=1,
                             planner_factory=RecordingPlanner)
    return result, calls, leader


def test_a_leader_whose_remeasurement_raised_once_is_retried_and_declared():
    result, calls, leader = _flaky_leader_search(["exception: RuntimeError: NCCL timeout"])
    sources = result.trials[result.trials["strategy"] == leader.describe()]["source"].tolist()
    assert sources[:3] == ["hebo-first", "remeasure", "retry"], sources   # the retry took its challenger's run
    statuses = result.trials[result.trials["strategy"] == leader.describe()]["status"].tolist()
    assert statuses[:3] == ["ok", "exception", "ok"] and result.best == leader
    assert (f"{leader.describe()} failed 1 of its {len(statuses)} dry runs (exception) and ran in the others: "
            "declared, as a failure that did not repeat") in result.reason


@pytest.mark.parametrize("errors", [["exception: RuntimeError: NCCL timeout"] * 2, ["oom: CUDA out of memory"]])
def test_a_failure_that_repeats_or_is_out_of_memory_rules_the_leader_out(errors):
    result, calls, leader = _flaky_leader_search(errors)
    assert result.best is not None and result.best != leader
    # Out of memory is not retried (the job near its limit would run out again); a second exception ends it.
    assert calls.count(leader) == 1 + len(errors)
    assert f"{leader.describe()} measured 80 samples/s but failed when run again" in result.reason


def test_the_share_of_failures_that_do_not_repeat_is_learned():
    model = FailureModel([(a, b) for a in range(3) for b in range(3)])      # 9 candidates
    a, b = TRANSIENT_PRIOR
    assert model.p_retry_runs(0) == 0.0               # never failed: nothing to retry
    model.observe(0, "exception", "exception: rank 1: RuntimeError: NCCL error: unhandled system error")
    model.observe(2, "exception", "exception: rank 0: RuntimeError: torch.compile found no compiled frames")
    prior_share = a / (a + b)
    assert model.transient_share() == pytest.approx(prior_share)
    assert 0 < model.p_retry_runs(0) <= prior_share   # x P(the failure was its own, not an option's)
    assert model.p_retry_runs(2) == 0.0               # the strategy's own error: no retry before evidence
    model.observe(1, "timeout", "timeout: rank 1: Timed out waiting 30000ms for recv operation to complete")
    assert model.p_retry_runs(1) == pytest.approx(prior_share)   # timeouts are never blamed on options
    model.observe(3, "timeout", "timeout: exceeded 300 s")       # the whole dry run too slow: slow again
    assert model.p_retry_runs(3) == 0.0
    model.observe(4, "ok")
    model.observe(4, "timeout")                       # ran, then failed: a failure that did not repeat
    model.observe(1, "ok")                            # failed, then ran: another
    assert model.transient_share() == pytest.approx((a + 2) / (a + b + 2))
    assert model.p_retry_runs(1) == 0.0 and model.p_retry_runs(4) == 0.0   # they got past: no retry
    assert model.p_retry_runs(2) > 0.0 and model.p_retry_runs(3) > 0.0   # failures here do not all repeat
    model.observe(0, "exception", "exception: RuntimeError: NCCL error")   # failed again: it repeats, no third try
    assert model.transient_share() == pytest.approx((a + 2) / (a + b + 3))
    assert model.p_retry_runs(0) == 0.0
    model.observe(7, "oom")
    model.observe(8, "user")
    assert model.p_retry_runs(7) == model.p_retry_runs(8) == 0.0


class RetryPlanner(RecordingPlanner):
    """Suggests a candidate that already failed when it is offered, else the first remaining one."""

    failed: set = set()
    tried: set = set()

    def suggest(self, observed, remaining, log_fit=None):
        again = [i for i in remaining if i in self.failed and i in self.tried]
        pick = (again or list(remaining))[0]
        self.calls.append((pick, dict(log_fit or {})))
        self.tried.add(pick)
        return Suggestion(pick, 0.0, "first", len(remaining))


def test_a_candidate_whose_only_run_failed_is_offered_again_weighted_by_its_chance_to_run():
    """Once a failure was seen not to repeat, a candidate whose one dry run raised is offered to the planner
    with log P(fit) + log P(a retry runs); one that failed twice, ran out of memory or raised for an option
    that raised everywhere is not."""
    space = SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "amp": [None, "amp_native"]}, world_size=2)
    strategies = space.strategies()
    index = {s: i for i, s in enumerate(strategies)}
    flaky, broken = strategies[1], strategies[2]
    calls: Dict[Strategy, int] = {}
    RetryPlanner.failed, RetryPlanner.tried = {index[flaky], index[broken]}, set()
    RetryPlanner.instances.clear()

    def evaluator(s):
        calls[s] = calls.get(s, 0) + 1
        if s == broken or (s == flaky and calls[s] == 1):
            return DryRunResult(0.0, None, "exception: RuntimeError: connection reset")
        return DryRunResult(10.0 + index[s], 1000)

    result = search_strategy(space, evaluator, max_trials=8, patience=99, random_samples=2,
                             planner_factory=RetryPlanner)
    assert calls[flaky] == 2 and calls[broken] == 2          # each retried once, never a third time
    assert "retry" in result.trials["source"].tolist()
    picks = [pick for pick, _ in RetryPlanner.instances[-1].calls]
    retry = picks.index(index[flaky], picks.index(index[flaky]) + 1)
    assert RetryPlanner.instances[-1].calls[retry][1][index[flaky]] < -0.5     # weighted: P(runs) < 0.6
    assert result.best is not None and result.best not in (broken,)
