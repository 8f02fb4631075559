"""The search's probability of fitting in memory, its learning predictor hook, and the leader vs
challenger re-measurement; each in milliseconds (a recording planner stands in for HEBO)."""

import math
from typing import Dict, List

import numpy as np
import pytest

from atorch.auto.cost_model import Estimate
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.search.bo import Suggestion
from atorch.auto.search.feasibility import PRUNE_BELOW, Feasibility
from atorch.auto.search.search import LearningPredictorLike
from atorch.auto.search.trials import TrialLog
from atorch.auto.search.space import Candidate, memory_saving_ranks
from atorch.auto.strategy import Strategy


def space16() -> SearchSpace:
    return SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
                        "amp": [None, "amp_native"]}, world_size=2)


class FitRecordingPlanner:
    """Suggests the remaining candidate with the highest log P(fit) it is given (ties: the first);
    records every call."""

    instances: List["FitRecordingPlanner"] = []

    def __init__(self, labels, choices, prior, seed):
        self.expected_seconds = 0.0
        self.calls: List[tuple] = []
        self.priors: List[List[float]] = [list(prior) if prior is not None else None]
        FitRecordingPlanner.instances.append(self)

    def update_prior(self, prior):
        self.priors.append(list(prior))

    def suggest(self, observed, remaining, log_fit=None):
        self.calls.append(([o.index for o in observed], list(remaining), dict(log_fit or {})))
        best = max(remaining, key=lambda i: ((log_fit or {}).get(i, 0.0), -i))
        return Suggestion(best, 0.0, "fit", len(remaining))


# -- the probability of fitting -----------------------------------------------------------------

def test_dominance_is_certain_both_ways():
    """No more saving than an OOM candidate: P = 0; at least the saving of one that ran: P = 1."""
    space = space16()
    cands = space.candidates()
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=100.0)
    index = {c.choices: i for i, c in enumerate(cands)}
    oom, ran = index[(1, 0, 0)], index[(2, 1, 0)]          # zero1 no-ckpt ran out; zero2+ckpt ran
    feas.observe(oom, "oom", None)
    feas.observe(ran, "ok", 90.0)
    assert feas.probability(index[(0, 0, 0)]).p == 0.0 and feas.probability(index[(0, 0, 0)]).other == oom
    assert feas.probability(index[(3, 1, 0)]).p == 1.0 and feas.probability(index[(3, 1, 0)]).why == "dominates"
    # Different amp (unordered): dominance says nothing; the model does (amp's effect is unknown).
    other_amp = feas.probability(index[(0, 0, 1)])
    assert other_amp.why == "model" and 0.0 < other_amp.p < 1.0
    assert "which ran out of memory" in feas.describe(index[(0, 0, 0)], [c.label() for c in cands])


def test_memory_model_learns_option_effects_from_measured_peaks_without_a_predictor():
    """Peaks exactly log-linear in the options: after a few of them the model predicts the rest."""
    space = space16()
    cands = space.candidates()
    ranks = memory_saving_ranks(space)

    def peak(c: Candidate) -> float:
        return 100.0 * 0.7 ** c.choices[0] * 0.6 ** c.choices[1] * (1.2 if c.choices[2] else 1.0)

    feas = Feasibility([c.choices for c in cands], ranks, limit=80.0)
    assert feas.probability(0).p == 1.0 and feas.probability(0).why == "unknown"   # nothing known yet
    for i in (0, 3, 5, 9, 12, 14):
        feas.observe(i, "ok" if peak(cands[i]) <= 80 else "oom", peak(cands[i]))
    mu, sd = feas.model()
    for i, c in enumerate(cands):
        assert abs(mu[i] - math.log(peak(c))) < 0.1, (c.choices, math.exp(mu[i]), peak(c))
        p = feas.probability(i).p
        margin = math.log(80.0) - math.log(peak(c))
        if margin > 0.25:
            assert p > 0.9
        if margin < -0.25:
            assert p < 0.1


def _saving_steps(c: Candidate) -> int:
    return c.choices[0] + c.choices[1]     # zero stage + checkpointing (amp is not ranked)


def test_without_a_predictor_out_of_memory_runs_point_to_the_candidates_that_save_more():
    """Before anything ran, the runs out of memory are all the model knows: the leanest candidates
    must stay runnable and be the likeliest to fit (with a mean-0 prior a saving step was as likely
    to add memory, so two runs out of memory at 3.5x the limit pruned the candidates that fit)."""
    space = space16()
    cands = space.candidates()
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=40.0)
    plain = [i for i, c in enumerate(cands) if _saving_steps(c) == 0]
    for i, peak in zip(plain, (140.0, 150.0)):
        feas.observe(i, "oom", peak)
    leanest = max(range(len(cands)), key=lambda i: (_saving_steps(cands[i]), -cands[i].choices[2]))
    assert feas.probability(leanest).p >= PRUNE_BELOW
    assert feas.probability(leanest).p > feas.probability(plain[0] + 2).p   # zero1 only (amp off)


def test_runs_out_of_memory_without_a_peak_still_teach_the_level():
    """An out-of-memory run that reports no peak says the candidate needs at least the limit: the
    model is informed by it, and candidates saving more are likelier to fit than ones saving less."""
    space = space16()
    cands = space.candidates()
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=40.0)
    first = next(i for i, c in enumerate(cands) if _saving_steps(c) == 0)
    feas.observe(first, "oom", None)
    assert feas.informed
    by_steps = {}
    for i, c in enumerate(cands):
        if c.choices[2] != cands[first].choices[2] or feas.probability(i).why != "model":
            continue
        by_steps.setdefault(_saving_steps(c), []).append(feas.probability(i).p)
    means = [float(np.mean(by_steps[k])) for k in sorted(by_steps)]
    assert len(means) >= 3 and means == sorted(means), by_steps


def test_a_scattered_predictor_prunes_less_once_its_scatter_is_measured():
    """Per-candidate prediction errors of 20%: a candidate predicted just over the limit is
    pruned while the predictor is assumed accurate, and comes back once the peaks show its scatter."""
    rng = np.random.default_rng(0)
    n = 40
    choices = [(i,) for i in range(n)]                       # one unordered dimension: no dominance
    predicted = [100.0] * n
    predicted[-1] = 100.0 * 1.5                              # 50% over a limit of 100
    feas = Feasibility(choices, [None], limit=100.0, predicted_peaks=predicted)
    assert feas.probability(n - 1).p < PRUNE_BELOW
    for i in range(12):                                      # measured peaks scatter 20% around "100"
        feas.observe(i, "ok", 80.0 * math.exp(rng.normal(0, 0.2)))
    assert feas.probability(n - 1).p > PRUNE_BELOW      # back among the candidates that may run
    assert 0.6 < feas.scale() < 1.0                           # the global bias (about 0.8) is learned


def test_a_biased_predictor_is_rescaled_by_measured_peaks():
    choices = [(i,) for i in range(4)]
    feas = Feasibility(choices, [None], limit=100.0, predicted_peaks=[50, 60, 70, 150])
    assert feas.probability(3).p < PRUNE_BELOW and feas.probability(0).p > 0.99
    for i in range(3):
        feas.observe(i, "ok", 0.5 * [50, 60, 70][i])         # the cost model overestimates 2x
    assert feas.probability(3).p > 0.5 and feas.scale() == pytest.approx(0.5, rel=0.15)


def test_acquisition_is_weighted_by_the_probability_of_fitting():
    """The planner is given log P(fit) for exactly the remaining candidates it may choose from,
    and candidates below PRUNE_BELOW are never offered."""
    FitRecordingPlanner.instances.clear()
    space = space16()
    cands = space.candidates()
    index = {c.strategy: i for i, c in enumerate(cands)}

    def peak(c: Candidate) -> float:
        return 100.0 * 0.7 ** c.choices[0] * 0.6 ** c.choices[1] * (1.2 if c.choices[2] else 1.0)

    def evaluator(s):
        c = cands[index[s]]
        if peak(c) > 60:
            return DryRunResult(0.0, int(peak(c)), "oom")
        return DryRunResult(10.0 + c.choices[2], int(peak(c)))

    result = search_strategy(space, evaluator, max_trials=16, patience=16, random_samples=2,
                             memory_limit_bytes=60, planner_factory=FitRecordingPlanner, remeasure_rounds=0)
    # Out-of-memory runs before the budget left went to the candidates not run for memory.
    searched = result.trials[result.trials["source"] != "pruned-retry"]
    planner = FitRecordingPlanner.instances[-1]
    assert planner.calls
    for _, remaining, log_fit in planner.calls:
        assert set(log_fit) == set(remaining)
        assert all(math.log(PRUNE_BELOW) <= v <= 0.0 for v in log_fit.values())
    ooms = int((searched["status"] == "oom").sum())
    assert ooms <= 2, result.trials[["strategy", "status", "source"]]
    assert result.best is not None and peak(cands[index[result.best]]) <= 60


# -- the learning predictor hook ------------------------------------------------------------------

class Learner:
    """A predictor that learns: it predicts the measured step time once it has seen one."""

    def __init__(self, table: Dict[Strategy, float]):
        self.table = table
        self.seen: Dict[Strategy, float] = {}
        self.calls = 0

    def __call__(self, strategy):
        self.calls += 1
        step = self.seen.get(strategy, 1.0)                   # before learning: everything alike
        return Estimate(1000, step)

    def observe(self, strategy, measured_step_time_s):
        self.seen[strategy] = measured_step_time_s


def test_a_learning_predictor_observes_every_successful_dry_run_and_is_predicted_again():
    FitRecordingPlanner.instances.clear()
    space = space16()
    strategies = space.strategies()
    table = {s: 10.0 + i for i, s in enumerate(strategies)}
    raising = strategies[4]
    learner = Learner(table)
    assert isinstance(learner, LearningPredictorLike)

    def evaluator(s):
        if s == raising:
            raise RuntimeError("boom")
        return DryRunResult(table[s], 500, step_time_s=32.0 / table[s])

    result = search_strategy(space, evaluator, max_trials=8, patience=8, random_samples=2, predictor=learner,
                             planner_factory=FitRecordingPlanner, remeasure_rounds=0)
    ok = [s for s, st in zip(result.evaluated, result.trials["status"]) if st == "ok"]
    assert set(learner.seen) == set(ok) and raising not in learner.seen
    assert learner.seen[ok[0]] == pytest.approx(32.0 / table[ok[0]])
    # Every candidate predicted once at the start and once after each observation.
    assert learner.calls == len(strategies) * (1 + len(ok))
    # The planner's feature followed the refit, and the trial table shows the refitted prediction.
    planner = FitRecordingPlanner.instances[-1]
    assert len(planner.priors) >= 2 and planner.priors[-1] != planner.priors[1]


def test_a_predictor_whose_observe_raises_is_kept_as_it_was():
    class Broken(Learner):
        def observe(self, strategy, measured_step_time_s):
            raise ValueError("cannot learn")

    space = space16()
    table = {s: 10.0 + i for i, s in enumerate(space.strategies())}
    learner = Broken(table)
    result = search_strategy(space, lambda s: DryRunResult(table[s], 500, step_time_s=1.0 / table[s]),
                             max_trials=4, predictor=learner, planner_factory=FitRecordingPlanner)
    assert len(result.trials) == 4 and learner.calls == len(table)


def test_the_calibration_learning_predictor_satisfies_the_protocol():
    from atorch.auto.calibration import LearningPredictor

    assert isinstance(LearningPredictor(lambda s: Estimate(1, 1.0)), LearningPredictorLike)


# -- final selection: the leader against its likeliest challenger ----------------------------------

def _log(space, runs):
    cands = space.candidates()
    log = TrialLog(cands, [None] * len(cands), None)
    for index, throughput, rel in runs:
        step = 32.0 / throughput
        steps = tuple(step * (1 + rel * z) for z in (-1.2, -0.4, 0.0, 0.4, 1.2))
        log.add(index, DryRunResult(throughput, 100, step_times_s=steps), 1.0, float("nan"),
                "remeasure" if index in log.tried else "random")
    return log


def test_challenger_is_the_likeliest_to_beat_the_leader():
    space = space16()
    # Leader 100 (precise), 99 (noisy: may well be faster), 97 (precise: clearly slower), 60.
    log = _log(space, [(0, 100.0, 0.005), (1, 99.0, 0.10), (2, 97.0, 0.002), (3, 60.0, 0.01)])
    assert log.challenge() == (0, 1)
    # Separated from everyone: no further round, except the first one, which always happens.
    log = _log(space, [(0, 100.0, 0.002), (1, 80.0, 0.002)])
    assert log.challenge() is None and log.challenge(first=True) == (0, 1)


def test_remeasurement_continues_until_separated_within_the_budget():
    space = space16()
    strategies = space.strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    a, b = strategies[-1], strategies[-2]
    table[a], table[b] = 104.0, 100.0
    calls = []

    def evaluator(s):
        calls.append(s)
        rng = np.random.default_rng(len(calls))
        step = 32.0 / table[s]
        return DryRunResult(table[s], 100, step_times_s=tuple(step * (1 + 0.04 * z) for z in rng.normal(size=5)))

    result = search_strategy(space, evaluator, max_trials=30, patience=99, random_samples=1,
                             planner_factory=FitRecordingPlanner, remeasure_rounds=3)
    sources = result.trials["source"].tolist()
    assert len(calls) <= 30 and 2 <= sources.count("remeasure") <= 6 and sources.count("remeasure") % 2 == 0
    # Every re-measurement round pairs the leader of that moment with another candidate.
    pairs = [tuple(result.evaluated[k:k + 2]) for k, s in enumerate(sources) if s == "remeasure"][::2]
    assert all(x != y for x, y in pairs)


def test_the_surrogate_posterior_picks_the_challenger():
    space = space16()
    # Measured: 0 leads by a lucky run (100), 1 is close (99, the model thinks it is slower),
    # 2 measured lower (96) but the surrogate, pooling similar candidates, puts it above 0.
    log = _log(space, [(0, 100.0, 0.08), (1, 99.0, 0.08), (2, 96.0, 0.08)])
    assert log.challenge() == (0, 1)
    posterior = {0: (math.log(97.0), 1e-4), 1: (math.log(95.0), 1e-4), 2: (math.log(99.0), 1e-4)}
    assert log.challenge(posterior=posterior) == (0, 2)
    # A candidate the posterior does not cover keeps its measured probability.
    assert log.challenge(posterior={0: posterior[0], 2: posterior[2]}) == (0, 2)


def test_identical_step_times_reserve_nothing_for_remeasuring():
    space = space16()
    table = {s: 10.0 + i for i, s in enumerate(space.strategies())}

    def deterministic(s):
        step = 32.0 / table[s]
        return DryRunResult(table[s], 100, step_time_s=step, step_times_s=(step,) * 5)

    result = search_strategy(space, deterministic, max_trials=14, patience=14, planner_factory=FitRecordingPlanner)
    assert (result.trials["source"] != "remeasure").all() and len(result.trials) == 14
    assert result.trials["strategy"].nunique() == 14


def test_log_expected_improvement_matches_the_closed_form_and_ranks_the_far_tail():
    from scipy.stats import norm

    from atorch.auto.search.bo import log_expected_improvement

    mean = np.array([0.0, 0.5, 1.0, 3.0])
    var = np.array([1.0, 0.25, 0.04, 0.01])
    sd = np.sqrt(var)
    z = (0.2 - mean) / sd
    closed = (0.2 - mean) * norm.cdf(z) + sd * norm.pdf(z)
    got = log_expected_improvement(0.2, mean, var)
    assert np.allclose(np.exp(got[:3]), closed[:3], rtol=1e-9)
    # z = -28: the closed form underflows to 0, the log still orders the tail by distance.
    far = log_expected_improvement(0.2, np.array([3.0, 3.5]), np.array([0.01, 0.01]))
    assert np.all(np.isfinite(far)) and far[0] > far[1] and got[3] < got[2]


def test_a_clear_lead_is_not_remeasured_and_its_reserve_goes_to_the_search():
    space = space16()
    strategies = space.strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    table[strategies[0]] = 400.0          # far ahead of everyone (the seeding measures it first)

    def evaluator(s):
        step = 32.0 / table[s]
        steps = tuple(step * (1 + 0.01 * z) for z in (-1.2, -0.4, 0.0, 0.4, 1.2))
        return DryRunResult(table[s], 100, step_time_s=step, step_times_s=steps)

    result = search_strategy(space, evaluator, max_trials=12, patience=12, planner_factory=FitRecordingPlanner)
    assert len(result.trials) == 12 and result.trials["strategy"].nunique() == 12
    assert result.best == strategies[0] and result.comparison.separated
    # A close race is re-measured: the same space with a runner-up 2% behind.
    table[strategies[0]], table[strategies[5]] = 102.0, 100.0
    result = search_strategy(space, evaluator, max_trials=12, patience=12, planner_factory=FitRecordingPlanner)
    assert (result.trials["source"] == "remeasure").sum() >= 2


@pytest.mark.parametrize("bad", [Estimate(float("nan"), 1.0), Estimate(100, float("nan")), Estimate(100, 0.0),
                                 Estimate(-5, 1.0), Estimate(100, float("inf")), "not an estimate"])
def test_an_unusable_prediction_is_searched_without_one_and_warned_once(bad, caplog):
    space = space16()
    strategies = space.strategies()
    table = {s: 10.0 + i for i, s in enumerate(strategies)}
    half = set(strategies[::2])

    def predictor(s):
        return bad if s in half else Estimate(100, 1.0 / table[s])

    with caplog.at_level("WARNING", logger="atorch.auto.search.predictions"):
        result = search_strategy(space, lambda s: DryRunResult(table[s], 50, step_time_s=1.0 / table[s]),
                                 max_trials=6, predictor=predictor, memory_limit_bytes=1000,
                                 planner_factory=FitRecordingPlanner)
    assert len(result.trials) == 6 and result.best is not None
    warnings = [r.getMessage() for r in caplog.records if "no usable prediction" in r.getMessage()]
    assert len(warnings) == 1 and f"for {len(half)} of {len(strategies)} candidates" in warnings[0]
    # Nothing unusable reaches the table: the unpredicted rows have no predicted memory.
    assert result.trials["predicted_memory"].dropna().eq(100).all()


def test_a_measured_peak_that_is_not_a_positive_number_teaches_the_memory_model_nothing():
    from atorch.auto.search.results import usable_peak

    assert usable_peak(1234) == 1234.0 and usable_peak(2.5e9) == 2.5e9
    assert all(usable_peak(v) is None for v in (None, float("nan"), float("inf"), 0, -5, "x"))


@pytest.mark.parametrize("peak", ["lots", float("nan"), -5, None])
def test_a_close_race_with_unusable_measured_peaks_is_still_decided(peak):
    """The memory tie-break reads the winners' measured peaks: an evaluator reporting junk there
    (a string crashed the search in numpy) leaves the choice to the measured throughput."""
    space = space16()
    strategies = space.strategies()
    table = {s: 50.0 + i for i, s in enumerate(strategies)}
    table[strategies[0]], table[strategies[5]] = 100.0, 100.0     # a tie: within noise, memory consulted

    def evaluator(s):
        step = 32.0 / table[s]
        steps = tuple(step * (1 + 0.01 * z) for z in (-1.2, -0.4, 0.0, 0.4, 1.2))
        return DryRunResult(table[s], peak, step_time_s=step, step_times_s=steps)

    result = search_strategy(space, evaluator, max_trials=12, patience=12, planner_factory=FitRecordingPlanner)
    assert result.best in (strategies[0], strategies[5]) and result.comparison is not None
    assert not result.comparison.separated and result.comparison.chosen_by == "measured mean"


def test_savings_that_may_trade_off_are_never_compared():
    """Each optimization declares its memory saving per kind (`Optimization.memory_saving`): deeper
    ZeRO stages save more within a backend, but zero2 with CPU offload and fsdp, or torch's and
    DeepSpeed's stages, are not ordered, so one running out of memory rules out only what it
    dominates (zero2 offloaded may need less than fsdp: ranking it as zero2 pruned it after zero2
    ran out of memory)."""
    space = SearchSpace({"zero": [None, "zero1", "zero2", ("zero2", {"cpu_offload": True}), "fsdp",
                                  ("fsdp", {"cpu_offload": True}), ("zero2", {"use_ds_zero": True})]},
                        world_size=2, device_type="cuda")
    cands = space.candidates()
    label = {c.label(): i for i, c in enumerate(cands)}
    assert len(cands) == 7, list(label)
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=1.0)
    zero1, zero2, zero2_off, fsdp, fsdp_off, ds_zero2 = (label[f"parallel_mode+{s}"] for s in (
        "zero1+ddp", "zero2", "zero2(cpu_offload=True)", "fsdp", "fsdp(cpu_offload=True)", "zero2(deepspeed stage 2)"))
    feas.observe(zero2, "oom", None)
    assert feas.probability(zero1).p == 0.0 and feas.probability(zero1).why == "dominated"
    assert feas.probability(zero2_off).why != "dominated" and feas.probability(ds_zero2).why != "dominated"
    feas.observe(fsdp_off, "ok", 0.5)
    assert feas.probability(fsdp_off).p == 1.0 and feas.probability(fsdp).why != "dominates"
