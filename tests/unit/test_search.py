"""The planner without processes: search space validity, HEBO-driven search on table landscapes, report.

The evaluators are tables (strategy -> throughput), so every test runs in well under a second
of evaluator time; what costs time is HEBO's GP fit per suggestion.
"""

import math
import re
import struct
import time
from typing import Dict

import numpy as np
import pytest

from atorch.auto.cost_model import Estimate
from atorch.auto.opt_lib import base as opt_base
from atorch.auto.opt_lib import is_valid_strategy, registered_names
from atorch.auto.opt_lib.base import Optimization, register
from atorch.auto.search import DryRunResult, SearchResult, SearchSpace, search_strategy
from atorch.auto.search.report import explain, plot_trials, trials_table
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama

ZEROS = ("t_zero1", "t_zero2", "t_zero3")


@pytest.fixture(scope="module")
def dummy_opts():
    """Test-only optimizations with the metadata shapes of the real ones, removed afterwards."""
    registered_names()  # load the real ones first, so ours never shadow a name
    specs = {
        "t_amp": {},
        "t_zero1": {"conflicts": frozenset(ZEROS) - {"t_zero1"}},
        "t_zero2": {"conflicts": frozenset(ZEROS) - {"t_zero2"}},
        "t_zero3": {"conflicts": frozenset(ZEROS) - {"t_zero3"}, "distributed_only": True},
        "t_ckpt": {},
        "t_replace": {},
        "t_ddp": {"conflicts": frozenset({"t_zero2", "t_zero3"})},
        "t_tp": {"splits_over": frozenset({"tensor"})},
    }
    for name, attrs in specs.items():
        register(type(f"Dummy_{name}", (Optimization,), {"name": name, "order": 50, **attrs}))
    yield list(specs)
    for name in specs:
        opt_base._REGISTRY.pop(name, None)


def space32(**kwargs) -> SearchSpace:
    return SearchSpace({"amp": [None, "t_amp"], "zero": [None, "t_zero1", "t_zero2", "t_zero3"],
                        "checkpoint": [None, "t_ckpt"], "replace": [None, "t_replace"]},
                       world_size=kwargs.pop("world_size", 4), **kwargs)


def space8() -> SearchSpace:
    return SearchSpace({"amp": [None, "t_amp"], "zero": [None, "t_zero1", "t_zero2", "t_zero3"]}, world_size=4)


def landscape(space: SearchSpace, seed: int) -> Dict[Strategy, float]:
    """Throughput = product of per-choice effects x an amp/zero interaction: structured like real
    strategy spaces (each optimization helps or hurts by a factor, some pairs interact)."""
    rng = np.random.default_rng(100 + seed)
    effects = [rng.uniform(0.4, 1.6, size=len(c)) for c in space.dimensions.values()]
    interaction = rng.uniform(0.8, 1.25, size=(2, 4))
    table = {}
    for cand in space.candidates():
        value = 100.0 * interaction[cand.choices[0], cand.choices[1]]
        for effect, i in zip(effects, cand.choices):
            value *= effect[i]
        table[cand.strategy] = value
    ranked = sorted(table.values(), reverse=True)
    assert ranked[0] > ranked[1], "the test landscape must have a unique best"
    return table


class FirstRemaining:
    """A planner without a GP (suggests the first remaining candidate), for tests of everything
    around the planner: they stay milliseconds instead of one GP fit per trial."""

    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds = 0.0

    def suggest(self, observed, remaining, log_fit=None):
        from atorch.auto.search.bo import Suggestion

        return Suggestion(list(remaining)[0], 0.0, "first", len(remaining))


class Recorder:
    """A table evaluator that records every call."""

    def __init__(self, table: Dict[Strategy, float], failures: Dict[Strategy, str] = None,
                 raising: set = frozenset(), memory: Dict[Strategy, int] = None):
        self.table, self.failures, self.raising = table, failures or {}, raising
        self.memory = memory or {}
        self.calls = []

    def __call__(self, strategy: Strategy) -> DryRunResult:
        self.calls.append(strategy)
        if strategy in self.raising:
            raise RuntimeError("evaluator exploded")
        if strategy in self.failures:
            return DryRunResult(0.0, None, self.failures[strategy])
        return DryRunResult(self.table[strategy], self.memory.get(strategy, 1000))


# -- search space ---------------------------------------------------------------------------------

def test_space_candidates_follow_registry_rules(dummy_opts):
    space = space32()
    assert space.size == 32
    cands = space.candidates()
    assert len(cands) == 32 and len({c.strategy for c in cands}) == 32
    ctx = space.validation_context()
    for c in cands:
        assert is_valid_strategy(c.strategy, ctx)
        assert c.strategy.names()[0] == "parallel_mode"     # resolve adds it and sorts by order
    # distributed_only t_zero3 is refused at world size 1 by the same rule auto_accelerate applies.
    single = space32(world_size=1)
    assert len(single.candidates()) == 24
    assert all("t_zero3" not in c.strategy for c in single.candidates())
    # Conflicts across dimensions are removed (t_ddp conflicts with t_zero2 and t_zero3).
    mixed = SearchSpace({"zero": [None, *ZEROS], "ddp": [None, "t_ddp"]}, world_size=2)
    names = [set(c.strategy.names()) for c in mixed.candidates()]
    assert len(names) == 6
    assert not any({"t_ddp", "t_zero2"} <= n or {"t_ddp", "t_zero3"} <= n for n in names)
    assert any("cannot be combined" in why for why in mixed.rejected.values())


def test_space_issue_example_and_bundles(dummy_opts):
    # A tensor split needs an optimization that splits over "tensor" (t_tp, always in).
    space = SearchSpace({"amp": [None, "t_amp"], "parallel_mode": [
        ("parallel_mode", ([("data", 4)], None)), ("parallel_mode", ([("tensor", 2), ("data", 2)], None))],
        "tp": ["t_tp"]})
    assert space.world_size == 4
    assert len(space.candidates()) == 4
    labels = space.labels()["parallel_mode"]
    assert labels == ["parallel_mode(data=4)", "parallel_mode(tensor=2,data=2)"]
    # A list choice applies several items together.
    bundle = SearchSpace({"x": [None, ["t_amp", "t_ckpt"]]}, world_size=1)
    assert [set(c.strategy.names()) for c in bundle.candidates()] == [
        {"parallel_mode"}, {"parallel_mode", "t_amp", "t_ckpt"}]


def test_space_rejects_bad_input(dummy_opts):
    with pytest.raises(ValueError, match="no choices"):
        SearchSpace({"amp": []})
    with pytest.raises(ValueError, match="repeats a choice"):
        SearchSpace({"amp": [None, "t_amp", "t_amp"]})
    with pytest.raises(ValueError, match="must be None, an optimization name"):
        SearchSpace({"amp": [None, 3]})
    with pytest.raises(ValueError, match="different world sizes"):
        SearchSpace({"p": [("parallel_mode", ([("data", 2)], None)), ("parallel_mode", ([("data", 4)], None))]})
    with pytest.raises(ValueError, match="both excluded and included"):
        space32().restricted(excluded=["t_amp"], included=["t_amp"])
    # Unknown names are not candidates: the registry refuses them.
    assert SearchSpace({"x": [None, "no_such_opt"]}).strategies() == [Strategy(["parallel_mode"])]


def test_space_excluded_and_included(dummy_opts):
    space = space32()
    no_amp = space.restricted(excluded=["t_amp", "t_zero3"])
    assert len(no_amp.candidates()) == 12
    assert all("t_amp" not in c.strategy and "t_zero3" not in c.strategy for c in no_amp.candidates())
    with_ckpt = space.restricted(included=["t_ckpt", "t_ddp"])   # t_ddp is offered by no dimension
    cands = with_ckpt.candidates()
    assert cands and all("t_ckpt" in c.strategy and "t_ddp" in c.strategy for c in cands)
    assert len(cands) == 2 * 2 * 2                                # zero: None/zero1 only (ddp conflicts)


def test_default_space_offers_registered_valid_strategies():
    model = tiny_llama()
    space = SearchSpace.default_for(model, world_size=2, device_type="cpu")
    names = set(registered_names())
    offered = {i.name for cs in space.dimensions.values() for c in cs for i in _items(c)}
    assert offered <= names and "parallel_mode" in offered
    assert [label for label in space.labels()["parallel"]][0] == "parallel_mode(data=2)"
    cands = space.candidates()
    assert cands
    for c in cands:
        assert is_valid_strategy(c.strategy, space.validation_context())
    if "tensor_parallel" in names:
        assert "parallel_mode(tensor=2,data=1)+tensor_parallel" in space.labels()["parallel"]


def _items(choice):
    from atorch.auto.search.space import choice_items

    return choice_items(choice)


# -- search ---------------------------------------------------------------------------------------

@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(8))
def test_finds_unique_best_of_32_within_12_calls_without_predictor(dummy_opts, seed):
    space = space32()
    table = landscape(space, seed)
    best = max(table, key=table.get)
    evaluator = Recorder(table)
    result = search_strategy(space, evaluator, max_trials=12, patience=12, seed=seed)
    assert result.best == best, result.trials[["strategy", "throughput", "source"]]
    assert result.best_throughput == pytest.approx(table[best])
    assert len(evaluator.calls) <= 12
    # The search phase never repeats a strategy (re-measurements happen only for an evaluator
    # that reports per-step times, which this table does not).
    assert len(set(evaluator.calls)) == len(evaluator.calls), "a strategy was evaluated twice"
    assert len(result.trials) == len(evaluator.calls)


@pytest.mark.heavy
def test_predictor_finds_best_in_few_calls(dummy_opts):
    """A cost model off by ~30% per candidate (log-normal noise) puts the search on the best at once,
    except where the noise hides the best deep in its ranking; then the GP still finds it within 12."""
    found = []
    for seed in range(8):
        space = space32()
        table = landscape(space, seed)
        rng = np.random.default_rng(seed)
        noise = {s: math.exp(rng.normal(0, 0.3)) for s in table}
        evaluator = Recorder(table)
        result = search_strategy(space, evaluator, max_trials=12, patience=12, seed=seed,
                                 predictor=lambda s: Estimate(1000, 1.0 / (table[s] * noise[s])))
        assert result.best == max(table, key=table.get), f"landscape {seed}"
        assert result.trials["source"].iloc[0] == "predicted-top"
        found.append(evaluator.calls.index(result.best) + 1)
    assert max(found) <= 12 and np.median(found) <= 3, found


def test_predicted_infeasible_candidates_are_never_run(dummy_opts):
    space = space32()
    table = landscape(space, 0)
    limit = 10_000
    # The best two candidates do not fit: the search must settle for the best that does.
    ranked = sorted(table, key=table.get, reverse=True)
    too_big = set(ranked[:2]) | {s for s in table if "t_zero1" in s}
    # Predicted 2x over the limit: far beyond the memory model's uncertainty (a candidate predicted
    # just over is only made unlikely, see test_search_feasibility.py).
    predictor = lambda s: Estimate(2 * limit if s in too_big else limit // 2, 1.0 / table[s])  # noqa: E731
    fits = 32 - len(too_big)
    evaluator = Recorder(table, memory={s: predictor(s).peak_memory_bytes for s in table},   # an accurate model
                         failures={s: "oom" for s in too_big})
    result = search_strategy(space, evaluator, max_trials=fits, patience=40, predictor=predictor,
                             memory_limit_bytes=limit, planner_factory=FirstRemaining)
    assert not set(evaluator.calls) & too_big
    assert len(evaluator.calls) == fits
    assert result.best == max((s for s in table if s not in too_big), key=table.get)
    assert len(result.pruned) == len(too_big)
    assert result.pruned["reason"].str.contains("> 10.0 KB limit").all()
    assert "limit" in result.reason and "\n" not in result.reason
    # With budget left once every candidate that may fit ran, the pruned ones are tried, after them.
    evaluator.calls.clear()
    result = search_strategy(space, evaluator, max_trials=fits + 3, patience=40, predictor=predictor,
                             memory_limit_bytes=limit, planner_factory=FirstRemaining)
    assert not set(evaluator.calls[:fits]) & too_big and set(evaluator.calls[fits:]) <= too_big
    assert len(evaluator.calls) == fits + 3 and len(result.pruned) == len(too_big) - 3
    assert result.best == max((s for s in table if s not in too_big), key=table.get)
    assert "3 dry run(s) went to candidates predicted not to fit in memory (0 ran)" in result.stop_reason


def test_memory_predictions_are_corrected_by_measured_peaks(dummy_opts):
    space = space8()
    table = {s: 10.0 + i for i, s in enumerate(space.strategies())}
    big = {s for s in table if "t_zero1" in s}                     # predicted 150, the rest 50
    predictor = lambda s: Estimate(150 if s in big else 50, 1.0 / table[s])  # noqa: E731

    def run(factor, limit=100, budget=10, oom=True):
        memory = {s: int(predictor(s).peak_memory_bytes * factor) for s in table}
        evaluator = Recorder(table, memory=memory, failures={s: "oom" for s in table if oom and memory[s] > limit})
        result = search_strategy(space, evaluator, max_trials=budget, patience=10, predictor=predictor,
                                 memory_limit_bytes=limit, planner_factory=FirstRemaining)
        # The budget left once every candidate that may fit ran goes to the others (they run out of memory).
        retried = int((result.trials["source"] == "pruned-retry").sum())
        assert all(s in evaluator.failures or not oom for s in evaluator.calls[len(evaluator.calls) - retried:])
        return evaluator.calls[:len(evaluator.calls) - retried], result

    # The cost model overestimates every peak 2x: after the first trial "150" means 75 and fits.
    calls, result = run(0.5)
    assert len(calls) == 8 and result.pruned.empty and calls[0] not in big
    # It underestimates 1.6x: "50" means 80 (fits), "150" stays out, and the reason says why.
    calls, result = run(1.6)
    assert len(calls) == 6 and not set(calls) & big and len(result.evaluated) == 8
    assert "2 dry run(s) went to candidates predicted not to fit in memory (0 ran)" in result.stop_reason
    calls, result = run(1.6, budget=6)
    assert len(result.pruned) == 2
    assert result.pruned["reason"].str.contains(r"cost model x 1\.[56]\d, the measured/predicted ratio").all()
    # 2.5x: the measured peaks (125 for "50", reported by runs that succeed) soon say that nothing
    # else fits a 99 limit.
    calls, result = run(2.5, limit=99, oom=False)
    assert len(calls) <= 3 and result.stop_reason.startswith("every candidate evaluated") and len(result.evaluated) == 8


def test_survives_raising_and_failing_evaluators(dummy_opts):
    space = space8()
    table = {s: 10.0 + i for i, s in enumerate(space.strategies())}
    ranked = sorted(table, key=table.get, reverse=True)
    failures = {ranked[0]: "oom", ranked[2]: "timeout", ranked[3]: "exception: boom"}
    evaluator = Recorder(table, failures=failures, raising={ranked[1]})
    # 8 candidates and a retry of the timeout, a failure that may be the machine's (this planner takes the first
    # candidate offered, whatever its chance to run); the exceptions read like the strategy's own: not retried.
    result = search_strategy(space, evaluator, max_trials=10, patience=10, seed=1, planner_factory=FirstRemaining)
    assert len(evaluator.calls) == 9 and len(set(evaluator.calls)) == 8
    assert evaluator.calls.count(ranked[2]) == 2
    assert result.best == ranked[4]
    status = dict(zip(result.trials["strategy"], result.trials["status"]))
    assert status[ranked[0].describe()] == "oom"
    assert status[ranked[1].describe()] == "exception"
    assert status[ranked[2].describe()] == "timeout"
    reasons = dict(zip(result.trials["strategy"], result.trials["reason"]))
    assert "RuntimeError: evaluator exploded" in reasons[ranked[1].describe()]
    assert (result.trials.loc[result.trials["status"] != "ok", "throughput"] == 0).all()
    assert "5 trial(s) failed" in result.reason


def test_all_failed_and_bad_returns(dummy_opts):
    space = space32()
    result = search_strategy(space, lambda s: DryRunResult(0.0, None, "oom"), max_trials=5, patience=10)
    assert result.best is None and result.best_throughput == 0
    assert len(result.trials) == 5 and "no strategy ran (5 oom)" in result.reason
    # A "successful" result with a nonsense throughput, or a wrong return type, is a failed trial.
    odd = search_strategy(space, lambda s: DryRunResult(float("nan")), max_trials=2, patience=10)
    assert odd.best is None and (odd.trials["status"] == "exception").all()
    wrong = search_strategy(space, lambda s: 3.0, max_trials=2, patience=10)
    assert "expected DryRunResult" in wrong.trials["reason"].iloc[0]


def test_time_limit_is_honoured(dummy_opts):
    space = space32()
    table = landscape(space, 2)
    now = [0.0]

    def slow(strategy):   # every dry run takes 10 (fake) seconds
        now[0] += 10.0
        return DryRunResult(table[strategy])

    result = search_strategy(space, slow, max_trials=30, patience=30, time_limit_s=35.0, clock=lambda: now[0],
                             planner_factory=FirstRemaining)
    # After 3 trials (30 s) a fourth would end at 40 s > 35 s: the search stops before it.
    assert len(result.trials) == 3 and now[0] <= 35.0
    assert "time_limit_s=35" in result.stop_reason


def test_a_time_limit_spent_before_the_first_dry_run_says_so(dummy_opts):
    """A limit smaller than the search's own start (the cost model, the planner's import and first fit) said
    "a trial took longer than expected" of a search where no trial ran (an outside probe, session 30)."""
    space = space32()
    ticks = iter([0.0] + [2.0] * 100)
    result = search_strategy(space, lambda s: DryRunResult(10.0), max_trials=5, time_limit_s=0.5,
                             clock=lambda: next(ticks), planner_factory=FirstRemaining)
    assert result.best is None and len(result.trials) == 0
    assert result.stop_reason == ("time_limit_s=0.5 exceeded before the first dry run: 2.0 s went to predicting the "
                                  "candidates and starting the planner; allow more (ATORCH_SEARCH_TIME_LIMIT)")


def test_time_limit_counts_a_candidate_predicted_slow(dummy_opts):
    """A dry run's length follows its step time: a candidate predicted 15x slower than those tried is
    not started with time for a typical trial left (one overran time_limit_s=5 threefold) while
    quicker ones still fit; without predictions an overrun is reported as one, not as "would be"."""
    space = space32()
    table = landscape(space, 2)
    step = {s: 15.0 if "t_zero3" in s.names() else 1.0 for s in table}
    now = [0.0]

    def timed(strategy):   # a dry run lasts 1 (fake) second, 15 for the slow candidates
        now[0] += step[strategy]
        return DryRunResult(table[strategy])

    result = search_strategy(space, timed, max_trials=30, patience=30, time_limit_s=12.0, clock=lambda: now[0],
                             predictor=lambda s: Estimate(1000, step[s] / 100.0), planner_factory=FirstRemaining)
    assert now[0] <= 12.0 and (result.trials["seconds"] == 1.0).all(), list(result.trials["seconds"])
    assert len(result.trials) == 12 and "time_limit_s=12 would be exceeded" in result.stop_reason
    now[0] = 0.0
    result = search_strategy(space, timed, max_trials=30, patience=30, time_limit_s=12.0, clock=lambda: now[0],
                             planner_factory=FirstRemaining)
    assert list(result.trials["seconds"]) == [1.0, 1.0, 1.0, 15.0]   # the slow one unforeseen
    assert result.stop_reason == "time_limit_s=12 exceeded: 18.0 s spent (a trial took longer than expected)"


def test_time_limit_with_the_real_clock(dummy_opts):
    space = space32()
    table = landscape(space, 2)

    def slow(strategy):
        time.sleep(0.3)
        return DryRunResult(table[strategy])

    start = time.monotonic()
    # The cheap planner: a GP fit's duration varies several-fold on a loaded machine, which the
    # search can only estimate from the previous one; the time accounting itself is what is tested.
    result = search_strategy(space, slow, max_trials=30, patience=30, time_limit_s=5.0,
                             planner_factory=FirstRemaining)
    elapsed = time.monotonic() - start
    # Every trial sleeps 0.3 s, so the search can tell whether one more fits: it stops by itself,
    # before 30 trials (9 s). On a loaded machine a trial can take longer than the ones before
    # it (the search's own work between sleeps waits for a core), so the overrun allowed is the
    # slowest trial measured, not a fixed margin (a bare `elapsed <= 5.0` failed once at load 11).
    slowest = float(result.trials["seconds"].max() + result.trials["planner_seconds"].fillna(0).max())
    assert 1 <= len(result.trials) <= 16 and elapsed <= 5.0 + slowest, (len(result.trials), elapsed, slowest)
    assert "time_limit_s=5" in result.stop_reason


def test_stops_on_patience_and_max_trials(dummy_opts):
    space = space32()
    table = {s: 1.0 for s in space.strategies()}
    table[space.strategies()[0]] = 2.0
    flat = search_strategy(space, Recorder(table), max_trials=30, patience=3, random_samples=0,
                           predictor=lambda s: Estimate(1, 1.0 / table[s]))
    # The best first, the second predicted seed (a seed is not a trial without gain), then 3 without gain.
    assert len(flat.trials) == 5 and "patience" in flat.stop_reason
    assert flat.trials["source"].tolist()[:2] == ["predicted-top"] * 2
    # Seeds that ran never use up patience: the surrogate gets its turn (`make demo` stopped after
    # 7 seeds with patience 6 before its first surrogate-picked trial).
    seeded = search_strategy(space, Recorder(table), max_trials=30, patience=2, random_samples=4,
                             planner_factory=FirstRemaining)
    assert (seeded.trials["source"] == "random").sum() == 4 and seeded.trials["source"].iloc[-1] != "random"
    # Nor do seeds that ran out of memory, once something ran (a 7B model's default space at 64
    # ranks: 8 seeds out of memory stopped a 30-run search after 15 dry runs, all of them seeds).
    calls = []

    def two_to_four_run_out(strategy: Strategy) -> DryRunResult:
        calls.append(strategy)
        return DryRunResult(0.0, None, "oom") if 2 <= len(calls) <= 4 else DryRunResult(1.0)

    covering = search_strategy(space, two_to_four_run_out, max_trials=30, patience=2, random_samples=4,
                               planner_factory=FirstRemaining)
    assert covering.trials["status"].tolist()[:4] == ["ok", "oom", "oom", "oom"]
    assert covering.trials["source"].tolist()[:4] == ["random"] * 4
    assert covering.trials["source"].iloc[4] == "hebo-first"
    capped = search_strategy(space, Recorder(landscape(space, 3)), max_trials=2, patience=30,
                             planner_factory=FirstRemaining)
    assert len(capped.trials) == 2 and "max_trials=2" in capped.stop_reason
    with pytest.raises(ValueError, match="max_trials=0"):
        search_strategy(space, Recorder(table), max_trials=0)
    # Counts are ints: NaN ran without limit, 1.5 ran 2 trials, True ran 1, "3" and None raised deep inside.
    never = Recorder(table)
    for name, bad in (("max_trials", float("nan")), ("max_trials", 1.5), ("max_trials", True), ("max_trials", "3"),
                      ("max_trials", None), ("patience", 2.0), ("random_samples", None), ("remeasure_rounds", False)):
        with pytest.raises(TypeError, match=rf"search_strategy: {name}={bad!r} must be an int, got "):
            search_strategy(space, never, **{name: bad})
    assert never.calls == []     # refused before any dry run
    with pytest.raises(TypeError, match=r"SearchSpace: world_size='2' must be an int \(or None"):
        SearchSpace({"amp": [None, "amp_native"]}, world_size="2")
    for bad_size in (True, 2.0):
        with pytest.raises(TypeError, match=r"world_size=.* must be an int"):
            SearchSpace({"amp": [None, "amp_native"]}, world_size=bad_size)
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        SearchSpace({"amp": [None, "amp_native"]}, world_size=0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"time_limit_s=.* must be > 0"):
            search_strategy(space, Recorder(table), time_limit_s=bad)
    for bad_memory in (0, -5, float("nan")):
        with pytest.raises(ValueError, match=r"memory_limit_bytes=.* must be > 0"):
            search_strategy(space, Recorder(table), memory_limit_bytes=bad_memory)
    with pytest.raises(ValueError, match="no valid candidate"):
        search_strategy(SearchSpace({"x": ["no_such_opt"]}), Recorder(table))


def test_trial_table_and_result_fields(dummy_opts):
    space = space32()
    table = landscape(space, 4)
    # 2 predicted-top + 3 covering the space (the widest dimension has 4 options, but the seeds take
    # at most a third of the 7 dry runs, or random_samples=3 if more), then HEBO.
    result = search_strategy(space, Recorder(table, memory={s: 123 for s in table}), max_trials=7,
                             predictor=lambda s: Estimate(456, 1.0 / table[s]), batch_size=8)
    assert isinstance(result, SearchResult)
    assert list(result.trials.columns) == ["trial", "strategy", "status", "throughput", "throughput_lo",
                                           "throughput_hi", "predicted_throughput",
                                           "predicted_memory", "measured_memory", "reason", "seconds",
                                           "planner_seconds", "source"]
    assert result.trials["throughput_lo"].isna().all()     # a table evaluator reports no interval
    assert result.trials["trial"].tolist() == list(range(1, 8))
    assert result.trials["source"].tolist()[:5] == ["predicted-top"] * 2 + ["random"] * 3
    assert (result.trials["measured_memory"] == 123).all() and (result.trials["predicted_memory"] == 456).all()
    assert result.trials["predicted_throughput"].iloc[0] == pytest.approx(8 * table[result.evaluated[0]])
    suggested = result.trials[result.trials["source"].str.startswith("hebo")]
    assert len(suggested) == 2 and (suggested["planner_seconds"] > 0).all()
    assert result.evaluated[0].describe() == result.trials["strategy"].iloc[0]


# -- report ---------------------------------------------------------------------------------------

def test_report_table_plot_and_reason(dummy_opts, tmp_path):
    space = space32()
    table = landscape(space, 5)
    plain = Strategy(["parallel_mode", "ddp"])   # resolve_strategy adds DDP to plain data parallelism
    ranked = sorted((s for s in table if "t_zero1" not in s), key=table.get, reverse=True)   # the ones that fit
    predictor = lambda s: Estimate(2 * 10**9 if "t_zero1" in s else 10**9, 1.0 / table[s])  # noqa: E731
    evaluator = Recorder(table, failures={ranked[1]: "oom"}, memory={s: predictor(s).peak_memory_bytes for s in table})
    # 17 fit (ranked[1] runs out of memory): no budget is left for the 16 predicted not to fit.
    result = search_strategy(space, evaluator, max_trials=17, patience=32, predictor=predictor,
                             memory_limit_bytes=int(1.5e9), planner_factory=FirstRemaining)
    text = trials_table(result)
    assert result.best.describe() in text and "oom" in text and "mem_MB" in text
    assert result.best == ranked[0]
    line = explain(result)
    assert line == result.reason and "\n" not in line
    ratio = table[ranked[0]] / table[plain]
    assert line.startswith(f"{ranked[0].describe()}: {ratio:.2f}x plain data-parallel")
    # The out-of-memory run (its peak under the limit: it needed at least the limit) nudges the scale.
    assert re.search(r"predicted 2.0 GB (\(cost model x 1.0\d, the measured/predicted ratio\) )?> 1.5 GB limit", line)
    assert "1 trial(s) failed (1 oom)" in line
    path = plot_trials(result, str(tmp_path / "sub" / "search.png"))
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width >= 400 and height >= 200



def test_a_ranking_from_single_timed_steps_says_it_has_no_interval(dummy_opts):
    """ATORCH_DRYRUN_MAX_STEPS=1: every dry run times one step, so no run has a spread; the line read
    "A: 1.23x the runner-up B" as if that were a measured difference."""
    space = space8()
    table = landscape(space, 3)

    def one_step(strategy):
        return DryRunResult(table[strategy], 1000, step_time_s=8 / table[strategy], step_times_s=(8 / table[strategy],))

    line = search_strategy(space, one_step, max_trials=4, batch_size=8).reason
    assert "no interval: dry runs timed too few steps to measure their noise" in line
    assert "at least 3 timed steps give an interval" in line
    # A table evaluator reports no step times at all: its ratios are exact, no such note.
    assert "no interval" not in search_strategy(space, Recorder(table), max_trials=4).reason
    # Enough steps for a spread: an interval, and no note.
    rng = np.random.default_rng(0)

    def timed(strategy):
        steps = tuple(8 / table[strategy] * (1 + 0.01 * rng.standard_normal(10)))
        return DryRunResult(table[strategy], 1000, step_time_s=float(np.mean(steps)), step_times_s=steps)

    assert "no interval" not in search_strategy(space, timed, max_trials=4, batch_size=8).reason


def test_dry_run_result_status():
    assert DryRunResult(5.0).status == "ok"
    assert DryRunResult(0.0, None, "oom: rank 1: out of memory").status == "oom"
    assert DryRunResult(0.0, None, "timeout").status == "timeout"
    assert DryRunResult(0.0, None, "exception: ValueError: x").status == "exception"
    assert DryRunResult(0.0, None, "weird").status == "failed"
    # An allocation failure however worded is learned as memory, not as a candidate that raises.
    assert DryRunResult(0.0, None, "exception: RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                   "`cublasCreate(handle)`").status == "oom"
    assert DryRunResult(0.0, None, "exception: rank 1: RuntimeError: CUDA out of memory. Tried to allocate 2.00 "
                                   "GiB").status == "oom"
    assert DryRunResult(0.0, None, "timeout: rank 0: out of memory while waiting").status == "timeout"


def test_allocation_failures_are_out_of_memory_errors():
    from atorch.utils.peak_memory import is_out_of_memory

    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(ValueError("out of memory"))          # an argument check, not an allocation


def test_auto_search_predicts_with_a_cost_model_that_learns_from_its_dry_runs():
    import torch

    from atorch.auto.search.auto_search import make_predictor
    from atorch.auto.search.search import LearningPredictorLike

    predictor = make_predictor(tiny_llama(), 8, 64, 2, torch.device("cpu"))
    assert isinstance(predictor, LearningPredictorLike)
    amp = Strategy([("parallel_mode", ([("data", 2)], None)), ("amp_native", {"dtype": torch.bfloat16})])
    plain = Strategy([("parallel_mode", ([("data", 2)], None))])
    before_amp, before_plain = predictor(amp).step_time_s, predictor(plain).step_time_s
    # Both measured 3x slower than predicted: the bias learns the scale, every prediction follows.
    predictor.observe(amp, 3 * before_amp)
    predictor.observe(plain, 3 * before_plain)
    assert predictor(amp).step_time_s > 2 * before_amp and predictor(plain).step_time_s > 2 * before_plain


def test_a_model_the_cost_model_cannot_describe_is_searched_on_dry_runs_alone(caplog):
    """Mamba's config has no attention heads, so the cost model has no formula for it: the automatic mode
    failed outright ("MambaConfig has none of ['num_attention_heads', 'n_head']"). Now the search runs without
    predictions (said once), as benchmarks/search.py's `none` predictor. A vision config without a vocabulary
    (ViT) is described: no token embedding."""
    import logging

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification

    from atorch.auto.cost_model import shape_of
    from atorch.auto.search.auto_search import make_predictor

    mamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mamba", vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2))
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.auto_search"):
        assert make_predictor(mamba, 8, 16, 2, torch.device("cpu")) is None
    assert "the cost model cannot describe MambaForCausalLM" in caplog.text and "num_attention_heads" in caplog.text
    vit = AutoModelForImageClassification.from_config(AutoConfig.for_model(
        "vit", image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=4))
    shape = shape_of(vit)
    assert shape.vocab_size == 0 and shape.num_layers == 2 and shape.hidden_size == 32
    assert make_predictor(vit, 8, 1, 2, torch.device("cpu")) is not None
