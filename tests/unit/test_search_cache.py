"""The search results cache: JSON round trip, corrupt and mismatched files ignored with a warning naming
them, the setup key, and the rank-0 flow of `auto_search` (one confirming dry run on a hit)."""

import json
import logging
import os

import pytest
import torch

from atorch.auto.search.cache import (SearchCache, SetupKey, library_versions, model_config_hash,
                                      optimizer_description, setup_key, space_signature)
from atorch.auto.search.search import DryRunResult
from atorch.auto.strategy import Strategy

KEY = SetupKey("abc", 2, "cpu: test x2", (("torch", "2.13.0"),), 8, 64)
DDP = Strategy(["parallel_mode"])
FSDP = Strategy(["parallel_mode", "amp_native", "fsdp"])
OK = DryRunResult(123.5, 4_000_000, None, 0.0648, (0.064, 0.066, 0.0644), (119.0, 128.3))
OOM = DryRunResult(0.0, 9_000_000, "oom: rank 1: out of memory")


def test_round_trip(tmp_path):
    path = str(tmp_path / "cache.json")
    cache = SearchCache.load(path, KEY)
    assert cache.get(DDP) is None and cache.cached_best("space") is None
    cache.put(DDP, OK)
    cache.put(FSDP, OOM)
    cache.record_search(DDP, "space", [{"trial": 1, "strategy": DDP.describe()}], [], "why", "stopped", 2)
    cache.save()
    with open(path) as f:
        data = json.load(f)                       # plain JSON, no pickle
    assert data["format"] == "atorch-search-cache" and data["setup"]["world_size"] == 2

    again = SearchCache.load(path, KEY)
    assert again.get(DDP) == OK and again.get(FSDP) == OOM
    assert again.cached_best("space") == DDP
    assert again.cached_best("another space") is None         # a cached winner stands only for its space


def _file(**fields) -> str:
    """A cache file of KEY's setup with `fields` replacing its parts."""
    return json.dumps({"format": "atorch-search-cache", "version": 1, "setup": KEY.to_json(), "results": {},
                       "last_search": None, **fields})


# Damage a search must survive: each is ignored with a warning, never raised into the search.
CORRUPT = {
    "not json": "{not json",
    "a list": json.dumps([1, 2]),
    "another format": json.dumps({"format": "other"}),
    "empty setup": _file(setup={}),
    "result without throughput": _file(results={"x": {"bad": 1}}),
    "world size infinite": _file(setup={**KEY.to_json(), "world_size": float("inf")}),
    "batch NaN": _file(setup={**KEY.to_json(), "global_batch": float("nan")}),
    "versions a list": _file(setup={**KEY.to_json(), "versions": [1, 2]}),
    "results a string": _file(results="abc"),
    "throughput a string": _file(results={"x": {"throughput": "fast"}}),
    "result a list": _file(results={"x": [1]}),
    "interval of one bound": _file(results={"x": {"throughput": 1.0, "throughput_ci": [1]}}),
    "negative peak": _file(results={"x": {"throughput": 1.0, "peak_memory_bytes": -5}}),
    "winner not JSON": _file(last_search={"space": "s", "best": "garbage"}),
    "winner a list": _file(last_search={"space": "s", "best": [1, 2]}),
    "trials a string": _file(last_search={"space": "s", "best": None, "trials": "abc"}),
    # Each row valid as an object, but a number that is text broke the report (naming its directory).
    "trial throughput a string": _file(last_search={"space": "s", "best": None, "trials": [
        {"trial": 1, "strategy": "x", "status": "ok", "throughput": "abc"}]}),
    "trial seconds a bool": _file(last_search={"space": "s", "best": None, "trials": [{"trial": 1, "seconds": True}]}),
    "pruned memory a list": _file(last_search={"space": "s", "best": None, "pruned": [{"predicted_memory": [1]}]}),
    "nested 100000 deep": "[" * 100_000 + "]" * 100_000,
    "not UTF-8": b"\xff\xfe{".decode("latin-1"),
}


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_corrupt_cache_is_ignored_with_a_warning_naming_the_file(tmp_path, caplog, content):
    path = tmp_path / "cache.json"
    path.write_bytes(content.encode("latin-1") if content.startswith("\xff") else content.encode())
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        cache = SearchCache.load(str(path), KEY)
    assert cache.results == {} and cache.last_search is None
    assert str(path) in caplog.text and "could not be read" in caplog.text
    cache.put(DDP, OK)
    cache.save()                                  # replaced by a good file
    assert SearchCache.load(str(path), KEY).get(DDP) == OK


def test_a_remembered_winner_outside_the_space_is_not_confirmed(tmp_path, caplog):
    path = str(tmp_path / "cache.json")
    cache = SearchCache(path, KEY)
    cache.record_search(DDP, "space", [], [], "why", "stopped", 2)
    cache.save()
    again = SearchCache.load(path, KEY)
    assert again.cached_best("space", {DDP, FSDP}) == DDP
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        assert again.cached_best("space", {FSDP}) is None       # e.g. a hand-edited winner
    assert path in caplog.text and "not a candidate" in caplog.text


def test_unknown_numbers_in_a_trial_row_are_kept(tmp_path):
    path = str(tmp_path / "cache.json")
    cache = SearchCache(path, KEY)
    row = {"trial": 1, "strategy": DDP.describe(), "status": "ok", "throughput": 5.0, "throughput_lo": None,
           "seconds": float("nan"), "planner_seconds": None}
    cache.record_search(DDP, "space", [row], [], "why", "stopped", 2)
    cache.save()
    assert SearchCache.load(path, KEY).cached_best("space") == DDP


def _row(strategy, throughput, lo, hi):
    return {"trial": 1, "strategy": strategy.describe(), "status": "ok", "throughput": throughput,
            "throughput_lo": lo, "throughput_hi": hi}


def test_a_remembered_winner_slower_than_another_of_its_search_is_not_confirmed(tmp_path, caplog):
    # A well-formed file whose winner was swapped for a slower strategy of the same search was trusted.
    path = str(tmp_path / "cache.json")
    cache = SearchCache(path, KEY)
    cache.record_search(FSDP, "space", [_row(FSDP, 40.2, 38.0, 42.0), _row(DDP, 862.9, 800.0, 900.0)], [], "why",
                        "stopped", 2)
    cache.save()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        assert SearchCache.load(path, KEY).cached_best("space", {DDP, FSDP}) is None
    assert path in caplog.text and f"{FSDP.describe()} is not the fastest of the search that chose it" in caplog.text
    # Within noise of the fastest (chosen for its memory), or never measured beside another: trusted.
    cache.record_search(FSDP, "space", [_row(FSDP, 850.0, 790.0, 905.0), _row(DDP, 862.9, 800.0, 900.0)], [], "why",
                        "stopped", 2)
    cache.save()
    assert SearchCache.load(path, KEY).cached_best("space", {DDP, FSDP}) == FSDP
    # A winner without a successful dry run in its own search's table is not trusted either.
    cache.record_search(FSDP, "space", [_row(DDP, 862.9, 800.0, 900.0)], [], "why", "stopped", 2)
    cache.save()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        assert SearchCache.load(path, KEY).cached_best("space") is None
    assert "has no successful dry run in the trial table" in caplog.text


def test_a_cache_that_cannot_be_written_is_warned_about_once_and_the_search_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = str(blocker / "cache.json")              # its directory is a file: every write fails
    cache = SearchCache(path, KEY)
    cache.put(DDP, OK)
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        cache.save()
        cache.save()
    assert caplog.text.count("could not write the search cache") == 1 and path in caplog.text
    assert cache.write_failed and cache.get(DDP) == OK           # still serves what it holds


def test_mismatched_setup_is_ignored_with_the_differences(tmp_path, caplog):
    path = str(tmp_path / "cache.json")
    cache = SearchCache(path, KEY)
    cache.put(DDP, OK)
    cache.save()
    other = SetupKey("abc", 4, "cpu: test x2", (("torch", "2.14.0"),), 8, 64)
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.cache"):
        assert SearchCache.load(path, other).results == {}
    assert path in caplog.text and "another setup" in caplog.text
    assert "world_size: cached 2, now 4" in caplog.text and "2.13.0" in caplog.text


def test_setup_key_follows_what_changes_the_cost():
    from atorch.testing import tiny_llama

    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    assert model_config_hash(a) == model_config_hash(b)             # weights do not matter
    assert model_config_hash(a) != model_config_hash(tiny_llama(num_hidden_layers=3))
    a.lm_head.weight.requires_grad_(False)
    assert model_config_hash(a) != model_config_hash(b)             # frozen weights have no optimizer state
    assert model_config_hash(a.to(torch.bfloat16)) != model_config_hash(b)
    key = setup_key(b, 2, torch.device("cpu"), 8, 64)
    assert key.device.startswith("cpu: ") and dict(key.versions)["torch"] == torch.__version__
    assert key == SetupKey.from_json(json.loads(json.dumps(key.to_json())))
    assert setup_key(b, 2, torch.device("cpu"), 16, 64) != key
    # The optimizer: its state is memory, its step time.
    adamw = setup_key(b, 2, torch.device("cpu"), 8, 64, optimizer_description(torch.optim.AdamW, {"lr": 1e-3}))
    assert adamw != key and adamw == SetupKey.from_json(json.loads(json.dumps(adamw.to_json())))
    # Nodes: times measured on one node do not stand for a job whose collectives cross the network.
    nodes = setup_key(b, 16, torch.device("cpu"), 8, 64, ranks_per_node=8)
    assert nodes.ranks_per_node == 8 and nodes != setup_key(b, 16, torch.device("cpu"), 8, 64)
    assert nodes == SetupKey.from_json(json.loads(json.dumps(nodes.to_json())))
    assert "ranks_per_node: cached 0, now 8" in nodes.differences(setup_key(b, 16, torch.device("cpu"), 8, 64))
    # A cache written before the field was kept: one node.
    old = key.to_json()
    del old["ranks_per_node"]
    assert SetupKey.from_json(old) == key
    assert adamw != setup_key(b, 2, torch.device("cpu"), 8, 64, optimizer_description(torch.optim.SGD, {"lr": 1e-3}))
    assert "torch.optim.adamw.AdamW" in adamw.optimizer and "AdamW" in "; ".join(
        setup_key(b, 2, torch.device("cpu"), 8, 64, optimizer_description(torch.optim.SGD, {})).differences(adamw))
    assert "python" in dict(library_versions())
    assert space_signature(["a", "b"], 10) == space_signature(["b", "a"], 10) != space_signature(["a", "b"], 11)


def test_optimizer_factories_that_are_functions_are_told_apart_by_their_code():
    import functools

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05)

    def sgd_with_momentum(params):       # the same name once edited, another optimizer
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    sgd_with_momentum.__qualname__ = sgd.__qualname__
    lambdas = [lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.05)]
    assert lambdas[0].__qualname__ == lambdas[1].__qualname__
    described = [optimizer_description(f, {}) for f in (sgd, sgd_with_momentum, *lambdas)]
    assert len(set(described)) == 4, described
    # The same code gives the same key (a new process defines the factory anew).
    again = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    assert optimizer_description(again, {}).split(" code:")[1] == described[2].split(" code:")[1]
    # A partial's arguments count; a class is keyed by its name only.
    assert optimizer_description(functools.partial(torch.optim.SGD, momentum=0.9), {}) != \
        optimizer_description(functools.partial(torch.optim.SGD, momentum=0.0), {})
    assert "code:" not in optimizer_description(torch.optim.AdamW, {})


def test_an_optimizer_factory_is_described_alike_in_every_process():
    """Nothing in the description may hold an object's address or a set's order (PYTHONHASHSEED):
    the cache compares it across processes. Two factories built alike around different objects
    stand for a new process building the factory again."""
    import functools

    class Hyper:
        lr = 1e-3

    def make(hyper):
        def factory(params, kind="adamw"):
            return torch.optim.AdamW(params, lr=hyper.lr if kind in {"adamw", "adam", "sgd", "lion"} else 0.1)
        return factory

    def build(params, settings):
        return torch.optim.SGD(params, lr=0.1)

    first, second = make(Hyper()), make(Hyper())
    assert optimizer_description(first, {}) == optimizer_description(second, {})
    assert optimizer_description(functools.partial(build, settings=Hyper()), {"opts": {"b", "a"}}) == \
        optimizer_description(functools.partial(build, settings=Hyper()), {"opts": {"a", "b"}})


def test_second_search_runs_one_confirming_dry_run(tmp_path, monkeypatch):
    """auto_search's rank-0 flow with a fake evaluator: a full search, then one dry run on a hit,
    then a full search again (reusing remembered results) when the confirmation fails."""
    from atorch.auto.search import auto_search
    from atorch.auto.search.space import SearchSpace

    space = SearchSpace({"amp": [None, "amp_native"], "zero": [None, "zero1", "fsdp"]}, world_size=1)
    speed = {c.label(): 100.0 + 10 * i for i, c in enumerate(space.candidates())}
    calls = []

    def evaluate(strategy):
        calls.append(strategy.describe())
        return DryRunResult(speed[strategy.describe()], 1000, None, 0.1, (0.1, 0.1, 0.1), (99.0, 101.0))

    settings = auto_search.SearchSettings(max_trials=len(speed), random_samples=1, patience=10)
    path = str(tmp_path / "search_cache.json")
    monkeypatch.setattr(auto_search, "search_strategy", _search_without_hebo)

    first = auto_search._search_or_confirm(space, evaluate, SearchCache.load(path, KEY), settings, None, 10**9, 8)
    assert len(calls) == len(speed) and first.best.describe() == max(speed, key=speed.get)

    calls.clear()
    second = auto_search._search_or_confirm(space, evaluate, SearchCache.load(path, KEY), settings, None, 10**9, 8)
    assert calls == [first.best.describe()]                         # exactly one confirming dry run
    assert second.best == first.best and "confirmed by 1 dry run" in second.reason and path in second.reason
    assert second.trials.iloc[-1]["source"] == "cache-confirm" and len(second.trials) == len(first.trials) + 1
    confirm_row = second.trials.iloc[-1]      # the confirming run's interval and time, like a searched trial's
    assert (confirm_row["throughput_lo"], confirm_row["throughput_hi"]) == (99.0, 101.0)
    assert confirm_row["seconds"] >= 0
    assert "the machine or setup changed" not in second.reason           # the same speed: no drift note

    # The machine got 3x slower: still one dry run, and the reason says the measurement moved.
    calls.clear()
    slow = auto_search._search_or_confirm(
        space, lambda s: DryRunResult(speed[s.describe()] / 3, 1000, None, 0.3, (0.3,) * 3, (30.0, 40.0)),
        SearchCache.load(path, KEY), settings, None, 10**9, 8)
    assert slow.best == first.best and "the machine or setup changed" in slow.reason
    # ... and that it is now below the remembered runner-up, whose comparison with it is the old search's.
    runner_up = sorted(speed, key=speed.get)[-2]
    assert f"now below the remembered {runner_up} ({speed[runner_up]:.4g} samples/s" in slow.reason, slow.reason
    assert "now below" not in second.reason

    # The remembered winner now fails: searched again, the other candidates served from the cache.
    speed_before = dict(speed)
    calls.clear()

    def evaluate_failing_best(strategy):
        calls.append(strategy.describe())
        if strategy == first.best:
            return DryRunResult(0.0, None, "oom: rank 0: out of memory")
        return evaluate(strategy)

    third = auto_search._search_or_confirm(space, evaluate_failing_best, SearchCache.load(path, KEY), settings,
                                           None, 10**9, 8)
    assert calls[0] == first.best.describe() and len(calls) == 1       # only the confirmation was run
    assert third.best != first.best and third.best_throughput == max(v for k, v in speed_before.items()
                                                                      if k != first.best.describe())
    # The failed confirmation was measured now: every other trial came from the cache, not that one.
    assert f"{len(speed) - 1} of {len(speed)} trial(s) served from the results cache" in third.reason


def _search_without_hebo(space, evaluate, **kwargs):
    """Exhaustive stand-in for search_strategy (this test is about the cache, not the planner)."""
    import pandas as pd

    from atorch.auto.search.search import SearchResult

    rows, best, best_tp = [], None, 0.0
    for i, c in enumerate(space.candidates()):
        r = evaluate(c.strategy)
        rows.append({"trial": i + 1, "strategy": c.label(), "status": r.status, "throughput": r.throughput})
        if r.ok and r.throughput > best_tp:
            best, best_tp = c.strategy, r.throughput
    return SearchResult(best, best_tp, pd.DataFrame(rows), pd.DataFrame(), [c.strategy for c in space.candidates()],
                        "exhausted", len(rows), kwargs.get("memory_limit_bytes"), "fastest")


def test_a_re_measurement_is_a_new_dry_run_never_the_remembered_one(tmp_path):
    # The search asks for a strategy again only to re-measure it (A, B, A, B): serving the cached
    # numbers then would count one measurement twice and fake the interval.
    from atorch.auto.search.auto_search import _cached_evaluator

    cache = SearchCache.load(str(tmp_path / "cache.json"), KEY)
    cache.put(DDP, OK)
    fresh = DryRunResult(120.0, 4_000_000, None, 0.0667, (0.066, 0.067, 0.0671), (118.0, 122.0))
    calls = []

    def evaluate(strategy):
        calls.append(strategy)
        return fresh

    run = _cached_evaluator(evaluate, cache, [])
    assert run(DDP) == OK and calls == []                 # first ask in this search: remembered, no dry run
    assert run(DDP) == fresh and calls == [DDP]           # second ask: measured again
    assert run(FSDP) == fresh and run(FSDP) == fresh and calls == [DDP, FSDP, FSDP]
    assert SearchCache.load(str(tmp_path / "cache.json"), KEY).get(DDP) == fresh   # the newest is remembered


def test_a_report_that_cannot_be_written_is_a_warning_on_rank_0_not_an_error(tmp_path, caplog):
    """The other ranks already left for training when rank 0 writes the report: raising there alone
    would leave them waiting in a collective."""
    from atorch.auto.search import auto_search
    from atorch.auto.search.bo import Suggestion
    from atorch.auto.search.search import search_strategy
    from atorch.auto.search.space import SearchSpace

    class First:                 # the first remaining candidate (this test is about the report)
        expected_seconds = 0.0

        def __init__(self, *args):
            pass

        def suggest(self, observed, remaining, log_fit=None):
            return Suggestion(list(remaining)[0], 0.0, "first", len(remaining))

    space = SearchSpace({"amp": [None, "amp_native"]}, world_size=1)
    result = search_strategy(space, lambda s: OK, max_trials=2, random_samples=0, planner_factory=First)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="atorch.auto.search.auto_search"):
        assert auto_search._write_report_or_warn(result, str(blocker / "report"), "search.png") is None
    assert "could not write the search report" in caplog.text and result.reason in caplog.text
    paths = auto_search._write_report_or_warn(result, str(tmp_path / "report"), "search.png")
    assert paths is not None and all(os.path.exists(p) for p in paths.values())


def test_a_remembered_failure_is_measured_again_and_served_trials_are_named(tmp_path):
    """A failure's cause (a loss function that raised, a memory limit) is not in the cache's key: a
    second search runs it again. Trials the cache answered say so, in the table and the reason."""
    from atorch.auto.search.auto_search import _cached_evaluator, _mark_served
    from atorch.auto.search.search import SearchResult

    import pandas as pd

    cache = SearchCache.load(str(tmp_path / "cache.json"), KEY)
    cache.put(DDP, OK)
    cache.put(FSDP, OOM)
    served, calls = [], []
    run = _cached_evaluator(lambda s: calls.append(s) or OK, cache, served)
    assert run(DDP) == OK and run(FSDP) == OK and calls == [FSDP] and served == [True, False]
    result = SearchResult(DDP, 123.5, pd.DataFrame({"source": ["random", "ei"]}), pd.DataFrame(), [DDP, FSDP],
                          reason="parallel_mode: fastest")
    _mark_served(result, served, cache.path)
    assert list(result.trials["source"]) == ["random (cached)", "ei"]
    assert result.reason.endswith(f"1 of 2 trial(s) served from the results cache {cache.path}")


def test_an_inverted_interval_in_the_cache_is_refused_and_a_short_table_still_reports(tmp_path):
    from atorch.auto.search.auto_search import _confirmed_result
    from atorch.auto.search.cache import result_from_json, result_to_json
    from atorch.auto.search.report import write_report

    entry = result_to_json(OK)
    entry["throughput_ci"] = [130.0, 110.0]
    with pytest.raises(ValueError, match="not a \\[low, high\\] pair"):
        result_from_json(entry)
    cache = SearchCache.load(str(tmp_path / "cache.json"), KEY)
    cache.put(DDP, OK)
    cache.record_search(DDP, "sig", [{"trial": 1, "strategy": DDP.describe()}], [], "fastest", "done", 2)
    result = _confirmed_result(cache, DDP, OK, OK, 10**9)
    write_report(result, str(tmp_path / "report"))      # a table missing columns does not break the report
    assert (tmp_path / "report" / "best_strategy.json").exists()


def test_a_read_only_cache_is_read_and_not_updated(tmp_path, monkeypatch, caplog):
    """A shared cache file where nothing can be written is used with a warning; a cache that can be
    neither written nor read is refused before any dry run."""
    import os

    from atorch.auto.search import auto_search
    from atorch.utils import env

    path = tmp_path / "search_cache.json"
    path.write_text("{}")
    real_access = os.access
    monkeypatch.setattr(env.os, "access", lambda p, mode: mode != os.W_OK and real_access(p, mode))
    with caplog.at_level("WARNING"):
        auto_search._check_cache_location(str(path))
    assert "is not writable" in caplog.text and "read, not updated" in caplog.text
    with pytest.raises(ValueError, match="is not writable"):
        auto_search._check_cache_location(str(tmp_path / "other.json"))
