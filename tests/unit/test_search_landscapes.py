"""Failure modes found on landscape shapes the search was not tuned on (benchmarks/search.py,
families microbatch-3%, failing-3%, spikes-3%, flat-3%, needle-3%); each test in milliseconds."""

import math

import numpy as np
import pytest
from transformers import LlamaConfig

from atorch.auto.cost_model import estimate
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.search.bo import Suggestion
from atorch.auto.search.feasibility import FailureModel, Feasibility
from atorch.auto.search.space import memory_saving_ranks
from atorch.auto.search.stats import log_throughput_of_steps, t_quantile
from atorch.auto.step_timing import summarize


def space16() -> SearchSpace:
    return SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
                        "amp": [None, "amp_native"]}, world_size=2)


class AmpFirstPlanner:
    """Suggests the remaining candidate with the highest log P(measures) it is given, amp first on
    ties: the acquisition's pull towards the region a failed run left unexplored."""

    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds, self.choices = 0.0, choices

    def suggest(self, observed, remaining, log_fit=None):
        best = max(remaining, key=lambda i: ((log_fit or {}).get(i, 0.0), self.choices[i][2], -i))
        return Suggestion(best, 0.0, "amp-first", len(remaining))


def micro_space() -> SearchSpace:
    return SearchSpace({"micro_batch": [None, ("gradient_accumulation", {"steps": 2}),
                                        ("gradient_accumulation", 4)],
                        "checkpoint": [None, "checkpoint"]}, world_size=2, global_batch_size=8)


def test_the_micro_batch_dimension_is_ordered_by_memory():
    """More micro-batches per step (fewer rows each) are declared to need no more memory: without a
    predictor saying otherwise, an out-of-memory run at a large micro-batch rules out the larger ones,
    and one that ran vouches for the smaller."""
    space = micro_space()
    assert memory_saving_ranks(space)[0] == [(0.0,), (1.0,), (2.0,)]
    cands = space.candidates()
    index = {c.choices: i for i, c in enumerate(cands)}
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=100.0)
    feas.observe(index[(1, 0)], "oom", None)           # 2 micro-batches of 4 rows ran out of memory
    feas.observe(index[(1, 1)], "ok", 90.0)            # ... and ran with checkpointing
    assert feas.probability(index[(0, 0)]).p == 0.0    # one micro-batch of 8 rows: no chance
    assert feas.probability(index[(2, 1)]).p == 1.0    # 4 micro-batches, checkpointed: fits


def test_accumulation_that_syncs_once_is_not_declared_a_saving_over_none():
    """Without its per-micro-step sync FSDP2 accumulates unsharded gradients, which can outweigh the
    activations saved: such a choice is declared to save memory only over fewer steps synced the same
    way and over nothing that syncs each micro-step."""
    once = {"sync_each_micro_step": False}
    space = SearchSpace({"micro_batch": [None, ("gradient_accumulation", 2),
                                         ("gradient_accumulation", {"steps": 2, **once}),
                                         ("gradient_accumulation", {"steps": 4, **once})]},
                        world_size=2, global_batch_size=8)
    cands = space.candidates()
    index = {c.choices[0]: i for i, c in enumerate(cands)}
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=100.0)
    none, two, two_once, four_once = (index[k] for k in range(4))
    assert feas.needs_at_least(none, two) and feas.needs_at_least(two_once, two)
    assert feas.needs_at_least(two_once, four_once)
    assert not feas.needs_at_least(none, two_once) and not feas.needs_at_least(none, four_once)


def test_a_predictor_that_reverses_a_declared_saving_turns_that_dominance_off():
    """Accumulation is declared a saving, but the cost model knows it can reverse (every micro-step's
    gradients stay alive). Predicted 30% over the candidate without it, its out-of-memory run says nothing
    certain about that one, which the log-memory model then finds likely to fit; where the predictor agrees
    with the declared order, or scatters more than the contradiction, dominance still decides."""
    space = micro_space()
    cands = space.candidates()
    index = {c.choices: i for i, c in enumerate(cands)}
    reversed_peaks = [100.0 * (1.3 if c.choices[0] else 1.0) * (0.6 if c.choices[1] else 1.0) for c in cands]
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=110.0,
                       predicted_peaks=reversed_peaks)
    feas.observe(index[(1, 0)], "oom", 130.0)
    none = feas.probability(index[(0, 0)])
    assert none.why == "model" and none.p > 0.5
    assert feas.needs_at_least(index[(0, 0)], index[(1, 0)])                # declared ...
    assert not feas.ruled_out_by(index[(0, 0)], index[(1, 0)])              # ... and contradicted
    agreeing = [100.0 * (0.8 if c.choices[0] else 1.0) for c in cands]
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=110.0, predicted_peaks=agreeing)
    feas.observe(index[(1, 0)], "oom", 130.0)
    assert feas.probability(index[(0, 0)]).p == 0.0 and feas.probability(index[(0, 0)]).why == "dominated"
    # A predictor whose measured errors are as large as the contradiction cannot overrule the order.
    rng = np.random.default_rng(0)
    choices = [(m, u) for m in (0, 1) for u in range(10)]            # accumulation x an unordered knob
    predicted = [100.0 * (1.3 if m else 1.0) for m, _ in choices]
    feas = Feasibility(choices, [[(0.0,), (1.0,)], None], limit=110.0, predicted_peaks=predicted)
    for k in range(2, 20):
        if k != 10:
            feas.observe(k, "ok", 0.7 * predicted[k] * math.exp(rng.normal(0, 0.3)))   # peaks scatter 30%
    feas.observe(10, "oom", 130.0)                                   # two steps of the first knob's option
    assert feas.probability(0).why == "dominated"


@pytest.mark.parametrize("two_steps", [("gradient_accumulation", 2),
                                       ("gradient_accumulation", {"steps": 2, "sync_each_micro_step": False})])
def test_the_cost_model_reverses_accumulation_under_sharding_and_the_search_follows_it(two_steps):
    """On a 1B Llama over 8 GPUs with checkpointed blocks, FSDP2 accumulating without its per-micro-step
    reduce-scatter keeps unsharded fp32 gradients: the cost model predicts two accumulation steps above
    one, and an out-of-memory run with two steps must not rule out the candidate with one, which is
    predicted to fit. With the default sync the accumulated gradients are shards, the prediction agrees
    with the declared order, and the out-of-memory run rules the candidate with one step out."""
    config = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000)
    space = SearchSpace({"micro_batch": [None, two_steps], "checkpoint": ["checkpoint"],
                         "amp": ["amp_native"], "zero": ["zero2", ("fsdp", {"cpu_offload": True})]},
                        world_size=8, model_config=config, device_type="cuda", global_batch_size=64)
    cands = space.candidates()
    peaks = [estimate(config, c.strategy, 64, 1024, 8, "cuda").peak_memory_bytes for c in cands]
    index = {c.choices: i for i, c in enumerate(cands)}
    one, two = index[(0, 0, 0, 1)], index[(1, 0, 0, 1)]
    synced = isinstance(two_steps[1], int)
    limit = (peaks[one] + peaks[two]) / 2
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=limit, predicted_peaks=peaks)
    feas.observe(two, "oom", None)
    if synced:
        assert peaks[two] < peaks[one]
        assert feas.probability(one).why == "dominated" and feas.probability(one).p == 0.0
    else:
        assert peaks[two] > 1.2 * peaks[one]
        assert not feas.needs_at_least(one, two)       # not declared a saving over none ...
        assert feas.probability(one).why == "model" and feas.probability(one).p > 0.5


def test_an_option_that_raises_is_learned_and_avoided():
    """Every amp candidate raises (half the space): after two or three failures the search stops
    trying amp, instead of running every candidate of the region the failures left unmeasured."""
    space = space16()
    cands = space.candidates()
    amp = {c.strategy for c in cands if c.choices[2] == 1}
    table = {c.strategy: 10.0 + c.choices[0] + 2 * c.choices[1] for c in cands}

    def evaluator(s):
        if s in amp:
            raise RuntimeError("amp cannot run on this model")
        return DryRunResult(table[s], 100)

    result = search_strategy(space, evaluator, max_trials=10, patience=10, random_samples=0,
                             planner_factory=AmpFirstPlanner, remeasure_rounds=0)
    assert (result.trials["status"] == "exception").sum() <= 3
    assert result.best == max((s for s in table if s not in amp), key=table.get)


def test_failure_causes_are_ruled_out_by_a_run_and_confirmed_by_repeats():
    model = FailureModel([(a, b) for a in range(2) for b in range(3)])    # 6 candidates: a x b
    index = {(a, b): 3 * a + b for a in range(2) for b in range(3)}
    model.observe(index[(1, 0)], "exception")
    once = model.p_runs(index[(1, 2)])                  # shares a=1 only
    assert 0.3 < once < 1.0 and model.p_runs(index[(0, 1)]) == 1.0    # shares nothing
    model.observe(index[(1, 1)], "exception")
    twice = model.p_runs(index[(1, 2)])
    assert twice < 0.5 < once                           # a=1 is now the likely cause
    assert model.posterior((0, 1)) > 0.5 > 2.5 * max(model.posterior(k) for k in [(1, 0), (1, 1), (0, 1, 1, 0)])
    model.observe(index[(0, 0)], "ok")                  # b=0 ran without a=1
    assert model.posterior((1, 0)) == 0.0
    model.observe(index[(1, 2)], "timeout")             # no evidence either way
    assert model.posterior((0, 1)) > 0.5


def test_blame_of_a_shared_option_is_weak_when_failures_are_common_and_unrelated():
    """Two failures share option 35 of dimension 0. Among rare failures that is a suspect; among
    many failures sharing nothing (30% of candidates raising for reasons of their own) it is chance;
    three failures concentrated on it, next to runs that succeed, still make it the cause."""
    choices = [(i,) * 4 for i in range(30)] + [(35, j, j, j) for j in range(31, 35)]

    def blame(ran, raised):
        model = FailureModel(choices)
        for i in ran:
            model.observe(i, "ok")
        for i in raised:
            model.observe(i, "exception")
        return model.posterior((0, 35)), model.rate

    rare, rare_rate = blame(range(10), [30, 31])
    common, common_rate = blame(range(10), [*range(10, 20), 30, 31])
    concentrated, _ = blame(range(10, 30), [30, 31, 32])
    assert common_rate > 0.3 > rare_rate
    assert common < 0.05 < 0.15 < rare
    # Three failures on option 35 and none elsewhere: 35 (0.90), or all three the candidates' own (rate^3),
    # or two separate causes (prior^2 each); the fourth candidate with 35 runs with P ~0.1.
    assert concentrated > 0.85



def test_explanations_of_the_same_failures_share_the_blame():
    """Two failures of a=0 with b=0 (the cause: that pair) are explained by a=0, or by the pair, or by two causes
    of their own: a candidate with a=0 and b=1 keeps about even odds of running. Weighed each alone (before),
    a=0 was a suspect of 0.82 and that candidate ran with P 0.18, so a search never tried the half of the space
    with a=0 (benchmarks/search.py failing-3%)."""
    choices = [(a, b, c) for a in range(2) for b in range(2) for c in range(3)]
    index = {c: i for i, c in enumerate(choices)}
    model = FailureModel(choices)
    for ran in [(1, 0, 0), (1, 0, 1), (1, 1, 2), (1, 1, 0)]:
        model.observe(index[ran], "ok")
    for raised in [(0, 0, 0), (0, 0, 1)]:
        model.observe(index[raised], "exception")
    assert model.posterior((0, 0)) == pytest.approx(model.posterior((0, 0, 1, 0)))
    assert model.posterior((0, 0)) < 0.5
    assert model.p_runs(index[(0, 1, 2)]) > 0.5          # a=0 without b=0
    assert model.p_runs(index[(0, 0, 2)]) < 0.2          # a=0 with b=0: both explanations block it
    assert model.p_runs(index[(1, 0, 2)]) == 1.0         # shares only what ran
    model.observe(index[(0, 1, 2)], "ok")                # a=0 ran: the pair is left
    assert model.posterior((0, 0)) == 0.0 and model.posterior((0, 0, 1, 0)) > 0.7
    assert model.p_runs(index[(0, 0, 2)]) < 0.3 < 0.8 < model.p_runs(index[(0, 1, 0)])


class LeanestFirstPlanner:
    """Suggests the candidate that saves the most memory first."""

    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds, self.choices = 0.0, choices

    def suggest(self, observed, remaining, log_fit=None):
        return Suggestion(max(remaining, key=lambda i: (sum(self.choices[i]), -i)), 0.0, "leanest", len(remaining))


def test_budget_left_when_nothing_may_fit_goes_to_the_candidates_not_run_for_memory():
    """Memory that is not monotone: the leanest candidate runs out of memory, which rules out every
    other by dominance, though they all fit. The search used to stop after that one dry run with the
    budget unspent and no strategy; it now tries the pruned ones and says so."""
    space = SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"]}, world_size=2)
    cands = space.candidates()
    leanest = max(cands, key=lambda c: sum(c.choices)).strategy
    table = {c.strategy: 10.0 + c.choices[0] + 2 * c.choices[1] for c in cands}
    calls = []

    def evaluator(s):
        calls.append(s)
        return DryRunResult(0.0, None, "oom") if s == leanest else DryRunResult(table[s], 50)

    result = search_strategy(space, evaluator, max_trials=6, patience=6, random_samples=0, memory_limit_bytes=100,
                             planner_factory=LeanestFirstPlanner, remeasure_rounds=0)
    assert calls[0] == leanest and len(calls) == 6 and len(set(calls)) == 6
    assert result.best is not None and result.best != leanest
    assert result.trials["source"].iloc[1] == "pruned-retry"
    assert result.trials["status"].iloc[1:].eq("ok").all()
    assert "5 dry run(s) went to candidates predicted not to fit in memory (5 ran)" in result.stop_reason
    assert "max_trials=6 reached" in result.stop_reason


def test_a_load_spike_is_left_out_of_a_runs_variance_as_the_dry_runner_leaves_it_out_of_the_mean():
    """One step in ten at 2.5x: the dry runner's mean and interval leave it out; the search's
    variance of that run must describe the same mean, not be 5x wider."""
    steps = [1.0, 1.01, 0.99, 1.0, 2.5, 1.02, 0.98, 1.0, 1.01, 0.99]
    est = log_throughput_of_steps(steps)
    dry_runner = summarize(steps)
    assert dry_runner.outliers == 1
    assert est is not None and math.isclose(est.mean, -math.log(dry_runner.mean_s))
    half = t_quantile(0.95, est.df) * math.sqrt(est.var)
    assert math.isclose(half, dry_runner.relative_half_width, rel_tol=0.05)


class FirstPlanner:
    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds = 0.0

    def suggest(self, observed, remaining, log_fit=None):
        return Suggestion(sorted(remaining)[0], 0.0, "first", len(remaining))


def test_budget_kept_for_re_measuring_goes_back_to_the_search_once_the_leader_is_separated():
    """20 dry runs keep 4 for re-measuring; the leader (5% ahead, 0.5% noise) is separated from
    everyone after one round, and the 2 dry runs left search on instead of going unused."""
    space = SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
                         "amp": [None, "amp_native"], "module_replace": [None, "module_replace"]}, world_size=2)
    strategies = space.strategies()
    table = {s: 105.0 if k == 5 else 100.0 for k, s in enumerate(strategies)}
    rng = np.random.default_rng(0)

    def evaluator(s):
        steps = tuple(float(32.0 / table[s] * (1 + 0.005 * z)) for z in rng.normal(size=5))
        return DryRunResult(32.0 / float(np.mean(steps)), 100, step_times_s=steps)

    result = search_strategy(space, evaluator, max_trials=20, patience=20, random_samples=0,
                             planner_factory=FirstPlanner)
    sources = list(result.trials["source"])
    assert sources.count("remeasure") == 2 and len(sources) == 20
    assert sources[-2:] == ["hebo-first", "hebo-first"]
    assert result.best == strategies[5] and result.comparison is not None and result.comparison.separated


def test_uncovered_triples_counts_combinations_of_three_options_never_measured_together():
    from atorch.auto.search.bo import uncovered_triples

    codes = np.asarray([(i, j, k, m) for i in range(2) for j in range(2) for k in range(2) for m in range(2)])
    assert uncovered_triples(codes, [], [0, 15]).tolist() == [4, 4]          # C(4, 3) triples each
    # Measured (0,0,0,0): candidate (0,0,0,1) shares one triple (dims 0-2), (1,1,1,1) none.
    assert uncovered_triples(codes, [0], [1, 15]).tolist() == [3, 4]
    assert uncovered_triples(codes, list(range(16)), list(range(16))).tolist() == [0] * 16
    # Two dimensions: nothing a two-way model does not describe.
    assert uncovered_triples(codes[:, :2], [0], [0, 12]).tolist() == [0, 0]


def test_a_three_way_combination_whose_options_each_look_worse_is_still_tried():
    """The outside probe's "trap" (session 23): three options together +0.5 in log-throughput, each
    alone and each pair -0.08. A model of per-option effects and pairs is led away from it, and a
    search trusting it declared 0.83 of the best on average where random search reached 0.91. Once
    no candidate promises a gain a dry run could resolve, a suggestion goes to the combination of
    three options least measured together (`COVERAGE_EI`)."""
    from atorch.auto.search.bo import CandidatePlanner, Observation

    labels = [["a", "b"]] * 5
    choices = [tuple((n >> d) & 1 for d in range(5)) for n in range(32)]

    def truth(c):
        hits = c[0] + c[1] + c[2]
        return -0.08 * hits + 0.5 * (hits == 3) + 0.01 * c[3]

    planner = CandidatePlanner(labels, choices, seed=0)
    # Measured: everything with at most one of the three options (their effects well known).
    seen = [i for i, c in enumerate(choices) if c[0] + c[1] + c[2] <= 1][:12]
    observed = [Observation(i, truth(choices[i]), 1e-5) for i in seen]
    rest = [i for i in range(32) if i not in seen]
    suggestion = planner.suggest(observed, rest)
    assert suggestion.how == "coverage"
    picked = choices[suggestion.index]
    assert picked[0] + picked[1] + picked[2] >= 2     # a combination the trials have not shown
    # With a clear gain in sight the acquisition decides as before.
    steep = [Observation(i, 0.5 * choices[i][3] - 0.5 * choices[i][4], 1e-5) for i in (0, 8, 16)]
    assert planner.suggest(steep, [i for i in range(32) if i not in (0, 8, 16)]).how == "acquisition"
