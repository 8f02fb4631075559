"""The results cache under a new memory limit, damaged cache entries, and the reason line when
candidates were not run for memory (what an outside grader of the automatic search reported)."""

import functools
import json
import logging

import pandas as pd
import pytest
import torch

from atorch.auto.cost_model import Estimate
from atorch.auto.search import auto_search
from atorch.auto.search.bo import Suggestion
from atorch.auto.search.cache import SearchCache, SetupKey, result_to_json
from atorch.auto.search.report import explain
from atorch.auto.search.search import DryRunResult, SearchResult, search_strategy
from atorch.auto.search.space import SearchSpace
from atorch.auto.strategy import Strategy

KEY = SetupKey("abc", 1, "cpu: test x2", (("torch", "2.13.0"),), 8, 64)
DDP = Strategy(["parallel_mode"])
FSDP = Strategy(["parallel_mode", "amp_native", "fsdp"])
OK = DryRunResult(123.5, 5_594_000, None, 0.0648, (0.064, 0.066, 0.0644), (119.0, 128.3))


class FirstRemaining:
    """The first remaining candidate (these tests are about the cache and the report, not the planner)."""

    expected_seconds = 0.0

    def __init__(self, *args):
        pass

    def suggest(self, observed, remaining, log_fit=None):
        return Suggestion(list(remaining)[0], 0.0, "first", len(remaining))


# -- 1. a remembered success over the current limit -------------------------------------------------

def test_a_cached_success_over_the_enforced_limit_is_served_as_the_dry_runs_out_of_memory(tmp_path):
    """Measured under a 10 GB limit, served under ATORCH_DEVICE_MEMORY_LIMIT=5585000: a dry run would
    have raised out of memory there, so the cache answers the same (peak kept), without a dry run."""
    from atorch.auto.search.auto_search import _cached_evaluator

    cache = SearchCache.load(str(tmp_path / "cache.json"), KEY)
    cache.put(DDP, OK)
    cache.put(FSDP, DryRunResult(99.0, None, None, 0.08))           # no peak: nothing says it does not fit
    served, calls = [], []
    run = _cached_evaluator(lambda s: calls.append(s) or OK, cache, served, None, 5_585_000)
    answer = run(DDP)
    assert answer.status == "oom" and answer.throughput == 0.0 and answer.peak_memory_bytes == OK.peak_memory_bytes
    assert "5594000 bytes" in answer.error and "5585000 bytes (ATORCH_DEVICE_MEMORY_LIMIT)" in answer.error
    assert run(FSDP).ok and calls == [] and served == [True, True]
    assert cache.get(DDP) == OK                    # the measurement itself stays remembered, not overwritten
    # At or under the limit, and without one (the device's memory: not enforced by a dry run), as measured.
    assert _cached_evaluator(lambda s: OK, cache, [], None, 5_594_000)(DDP) == OK
    assert _cached_evaluator(lambda s: OK, cache, [], None, None)(DDP) == OK


def test_a_search_under_a_smaller_limit_does_not_choose_a_cached_success_that_no_longer_fits(tmp_path, monkeypatch):
    space = SearchSpace({"amp": [None, "amp_native"]}, world_size=1)
    fast, slow = (c.strategy for c in space.candidates())
    path = str(tmp_path / "search_cache.json")
    cache = SearchCache.load(path, KEY)
    cache.put(fast, DryRunResult(200.0, 5_594_000, None, 0.04, (0.04,) * 3, (190.0, 210.0)))
    cache.save()
    calls = []

    def evaluate(strategy):
        calls.append(strategy)
        return DryRunResult(100.0, 4_000_000, None, 0.08, (0.08,) * 3, (95.0, 105.0))

    monkeypatch.setattr(auto_search, "search_strategy", functools.partial(search_strategy,
                                                                          planner_factory=FirstRemaining))
    settings = auto_search.SearchSettings(max_trials=2, random_samples=0, patience=5, memory_limit_bytes=5_585_000)
    result = auto_search._search_or_confirm(space, evaluate, SearchCache.load(path, KEY), settings, None,
                                            5_585_000, 8)
    assert result.best == slow and calls == [slow]
    row = result.trials[result.trials["strategy"] == fast.describe()].iloc[0]
    assert row["status"] == "oom" and row["measured_memory"] == 5_594_000 and row["source"].endswith("(cached)")


# -- 2. a damaged entry is not a measurement --------------------------------------------------------

GOOD = result_to_json(OK)
DAMAGED = {
    "throughput 0 without an error": {**GOOD, "throughput": 0},
    "step time 0": {**GOOD, "step_time_s": 0},
    "a step of 0 s": {**GOOD, "step_times_s": [0.064, 0.0]},
    "interval from 0": {**GOOD, "throughput_ci": [0, 130.0]},
    "negative interval": {**GOOD, "throughput_ci": [-5.0, 130.0]},
    "NaN step time": {**GOOD, "step_time_s": float("nan")},
    "infinite peak": {**GOOD, "peak_memory_bytes": float("inf")},
}


@pytest.mark.parametrize("entry", list(DAMAGED.values()), ids=list(DAMAGED))
def test_a_success_that_is_not_a_measurement_makes_the_file_ignored_with_a_warning(tmp_path, caplog, entry):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"format": "atorch-search-cache", "version": 1, "setup": KEY.to_json(),
                                "results": {DDP.to_json(): GOOD, FSDP.to_json(): entry}, "last_search": None}))
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        cache = SearchCache.load(str(path), KEY)
    assert cache.results == {} and cache.get(FSDP) is None        # like any other corrupt content
    assert str(path) in caplog.text and "could not be read" in caplog.text


def test_a_failure_keeps_its_throughput_of_0(tmp_path):
    cache = SearchCache.load(str(tmp_path / "cache.json"), KEY)
    oom = DryRunResult(0.0, 9_000_000, "oom: rank 1: out of memory")
    cache.put(DDP, oom)
    cache.save()
    assert SearchCache.load(cache.path, KEY).get(DDP) == oom


# -- 3. the reason line names the leanest candidate not run, and where the limit came from -------------

def test_the_reason_names_the_leanest_candidate_not_run_and_the_limits_source():
    pruned = pd.DataFrame([
        {"strategy": "parallel_mode(data=2)+ddp", "predicted_memory": 15_900_000,
         "reason": "predicted 15.9 MB > 100.0 KB limit (P(fit) 0.000 < 0.05)"},
        {"strategy": "parallel_mode(data=2)+fsdp", "predicted_memory": 2_400_000,
         "reason": "predicted 2.4 MB > 100.0 KB limit (P(fit) 0.000 < 0.05)"},
        {"strategy": "parallel_mode(data=2)+zero1", "predicted_memory": 9_000_000,
         "reason": "needs at least the memory of parallel_mode(data=2)+ddp, which ran out of memory"},
    ])
    result = SearchResult(None, 0.0, pd.DataFrame(columns=["strategy", "status", "reason"]), pruned,
                          stop_reason="every candidate is predicted over the memory limit", num_candidates=3,
                          memory_limit_bytes=100_000)
    line = explain(result, "ATORCH_DEVICE_MEMORY_LIMIT=100000")
    assert ("3 candidates not run for memory, the leanest: parallel_mode(data=2)+fsdp predicted 2.4 MB > 100.0 KB "
            "limit (P(fit) 0.000 < 0.05) (the limit: ATORCH_DEVICE_MEMORY_LIMIT=100000)") in line
    assert "15.9 MB" not in line and line.startswith("no strategy ran")
    assert "the limit:" not in explain(result)                    # a caller that does not know the source
    # The leanest pruned for dominance: its predicted memory is said.
    one = SearchResult(None, 0.0, result.trials, pruned.iloc[[2]], num_candidates=3)
    assert ("1 candidate not run for memory: parallel_mode(data=2)+zero1 (predicted 9.0 MB) needs at least the "
            "memory of parallel_mode(data=2)+ddp") in explain(one)


def test_without_predicted_memory_the_reason_does_not_call_the_first_pruned_the_leanest():
    """No predictor: the pruned table's rows have no predicted memory, and its first row is plain data
    parallelism, the largest candidate; the line gives it as an example."""
    pruned = pd.DataFrame([{"strategy": "parallel_mode(data=4)+ddp", "predicted_memory": None,
                            "reason": "needs at least the memory of B, which ran out of memory"}] * 2)
    result = SearchResult(None, 0.0, pd.DataFrame(columns=["strategy", "status", "reason"]), pruned,
                          num_candidates=3)
    line = explain(result)
    assert "the leanest" not in line
    assert "2 candidates not run for memory, for example: parallel_mode(data=4)+ddp needs at least" in line


def test_the_ratio_to_plain_data_parallel_has_two_decimals():
    """1.02x was printed "1x" (format .2g), which reads as no gain at all."""
    space = SearchSpace({"amp": [None, "amp_native"]}, world_size=2)
    table = {c.strategy: 102.0 if c.choices[0] else 100.0 for c in space.candidates()}
    result = search_strategy(space, lambda s: DryRunResult(table[s], 100), max_trials=2, random_samples=0,
                             planner_factory=FirstRemaining, remeasure_rounds=0)
    assert "1.02x plain data-parallel" in result.reason


def test_a_search_where_nothing_fits_says_the_limit_is_atorch_device_memory_limit(tmp_path):
    space = SearchSpace({"amp": [None, "amp_native"], "zero": [None, "zero1", "fsdp"]}, world_size=1)
    need = {c.label(): 1_000_000 * (i + 2) for i, c in enumerate(space.candidates())}
    leanest = min(need, key=need.get)
    settings = auto_search.SearchSettings(memory_limit_bytes=100_000)
    source = auto_search.memory_limit_source(settings, torch.device("cpu"))
    assert source == "ATORCH_DEVICE_MEMORY_LIMIT=100000"
    result = auto_search._search_or_confirm(space, lambda s: OK, None, settings,
                                            lambda s: Estimate(need[s.describe()], 0.1), 100_000, 8, source)
    assert result.best is None
    assert f"the leanest: {leanest} predicted 2.0 MB > 100.0 KB limit" in result.reason
    assert result.reason.count("(the limit: ATORCH_DEVICE_MEMORY_LIMIT=100000)") == 1
    # Without the variable, the limit is the device's memory, and the line says so.
    assert "the device's memory" in auto_search.memory_limit_source(auto_search.SearchSettings(),
                                                                      torch.device("cuda"))
    assert "host RAM" in auto_search.memory_limit_source(auto_search.SearchSettings(), torch.device("cpu"))
