"""`search_strategy`: find the fastest strategy of a space with few dry runs, and say how sure it is.

Pure: it takes a `SearchSpace`, an evaluator callable (one dry run per call) and an optional
predictor (the cost model); it never imports training code. Order of work:

1. Predict every candidate, and give each a probability of fitting in memory
   (`feasibility.py`): certain by dominance in memory-saving choices (no less memory than one
   that ran out: 0; no more than one that ran: 1), else from a log-memory model (the predicted
   peak as its prior mean, corrected by every measured peak, its uncertainty learned from them).
   Only candidates below `PRUNE_BELOW` are not run; the others are weighted by it.
2. Seed: the predictor's top candidates, then `random_samples` (at least the widest dimension's
   options) spread-out ones, each weighted by its probability of fitting.
3. Then HEBO's acquisition over the remaining candidates picks each next one (`bo.py`): a GP
   on log-throughput with a main-effect + pairwise-interaction kernel, the prediction as a
   feature whose weight is learned, the measured noise as its noise floor; the acquisition
   (an optimistic log-throughput) plus log P(fit), i.e. an optimistic throughput that counts
   an out-of-memory run as 0. Failed trials are not throughput observations: an exception or
   timeout retires that one candidate, an out-of-memory trial teaches feasibility (step 1);
   neither reaches the GP. An exception also makes the candidate's options and pairs of options
   suspects of raising wherever they appear (`feasibility.FailureModel`: compile failing on the
   model fails every compile candidate), and P(fit) is multiplied by P(does not raise): to the
   GP a failed region looks unmeasured, and its expected improvement drew the search back there
   (benchmarks/search.py, failing-3%: up to 11 of 20 dry runs raised). A predictor that learns (`LearningPredictorLike`: it has
   `observe(strategy, step_time_s)`) is told every successful dry run and every candidate is
   predicted again: the GP's feature and the memory model follow the refit.
4. The search phase stops at its share of `max_trials`, after `patience` trials without
   improvement (an out-of-memory run before any candidate ran is not counted: it teaches
   memory), when the next trial would overrun `time_limit_s`, or when nothing is left.
5. When the evaluator reports per-step times (its noise), the leader is re-measured
   interleaved with the candidate likeliest to beat it (counted in `max_trials`; the surrogate's
   posterior, which pools similar candidates, says who that is: a measured rival, or an untried
   candidate when the posterior, times its chance to run, gives it better odds; its row's source
   is then "challenger"), round after round until a 95%
   interval of their throughput ratio (`stats.py`) separates the leader from every other
   candidate or the rounds are spent; inside the noise, the one using at least 10% less memory
   wins, else the higher measured mean. A leader ahead of everyone by more than `CLEAR_LEAD`
   (with 95% confidence) is not re-measured, and no budget is kept for it meanwhile; budget kept
   for rounds that the separation made unnecessary goes back to the search (once). `SearchResult.comparison` holds the
   winner against the runner-up, `reason` says it in one line.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple, cast, runtime_checkable

import numpy as np
import pandas as pd

from atorch.auto.search.feasibility import PRUNE_BELOW, FailureModel, Feasibility
from atorch.auto.search.space import Candidate, SearchSpace, memory_saving_ranks
from atorch.auto.search.stats import LogEstimate, RatioCI, log_throughput_of_steps, pool_runs, ratio_ci
from atorch.auto.strategy import Strategy

logger = logging.getLogger(__name__)

# Candidates the predictor ranks first are tried before any random sample: when the cost model
# is right the search is over after one confirming trial, and when it is wrong it costs two.
PREDICTED_SEEDS = 2
# Most rounds of interleaved re-measurement (each: one dry run of the leader, one of its challenger).
REMEASURE_ROUNDS = 3
# A leader whose throughput ratio to every other candidate has a 95% interval above this is
# not re-measured (its reserve goes to the search): repeated dry runs of one candidate on an
# idle machine differed by up to 1.12x (benchmarks/real_landscape.json, median 1.05x), i.e. a
# change of load between runs, which one run's own interval cannot see, moves a ratio by
# about this much; a lead beyond it is not undone by re-measuring.
CLEAR_LEAD = 1.10
# Inside the noise, a candidate wins on memory when it needs at least this much less.
MEMORY_TIE_BREAK = 0.10
# ... and when its measured throughput is at most this much lower: an interval that includes 1
# can still hold point estimates several % apart (a few noisy runs), and on benchmark landscapes
# with 3% noise per run a 3% allowance declared candidates truly 7% slower (benchmarks/search.py).
TIE_MAX_LOSS = 0.01
# ... and, when the leaner one is the one measured slower, when choosing it gives up less than
# this much log-throughput in expectation (the measured difference's normal approximation): the
# tie-break then needs measurements precise enough to say the cost is small, not just close means.
TIE_MAX_EXPECTED_LOSS = 0.01

# The variance of a run's log-throughput below which its steps count as identical (no noise).
NO_NOISE_VAR = 1e-12

TRIAL_COLUMNS = ["trial", "strategy", "status", "throughput", "throughput_lo", "throughput_hi",
                 "predicted_throughput", "predicted_memory", "measured_memory", "reason", "seconds",
                 "planner_seconds", "source"]


@dataclass
class DryRunResult:
    """What one dry run of a strategy measured. `error` is None on success, else "oom",
    "timeout" or "exception: <message>"; a failed run has throughput 0."""

    throughput: float                          # samples/s over the profiled steps
    peak_memory_bytes: Optional[int] = None    # largest per-rank peak
    error: Optional[str] = None
    step_time_s: Optional[float] = None        # mean of step_times_s
    # Per timed step, the slowest rank's seconds (what the confidence interval is computed from).
    step_times_s: Tuple[float, ...] = ()
    # 95% confidence interval of `throughput` (samples/s), from `step_times_s`; None when unknown.
    throughput_ci: Optional[Tuple[float, float]] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def status(self) -> str:
        if self.error is None:
            return "ok"
        head = self.error.split(":", 1)[0].strip()
        return head if head in ("oom", "timeout", "exception") else "failed"


Predictor = Callable[[Strategy], Any]          # -> an object with peak_memory_bytes and step_time_s
Evaluator = Callable[[Strategy], DryRunResult]


@dataclass
class Comparison:
    """The winner against the runner-up after re-measurement: throughput ratio winner/runner-up
    (pooled over every dry run of each) with its 95% interval, and on what the winner was chosen."""

    winner: Strategy
    runner_up: Strategy
    ratio: float
    lo: Optional[float]                # None: the evaluator reported no noise, no interval
    hi: Optional[float]
    chosen_by: str                     # "throughput", "memory" or "measured mean"
    memory_saving: Optional[float] = None    # fraction less peak memory than the runner-up
    runs: Tuple[int, int] = (1, 1)     # dry runs pooled for the winner and the runner-up

    @property
    def separated(self) -> bool:
        return self.lo is not None and (self.lo > 1.0 or cast(float, self.hi) < 1.0)  # both set or neither

    def line(self) -> str:
        a, b = self.winner.describe(), self.runner_up.describe()
        if self.lo is None:
            return f"{a}: {self.ratio:.3g}x the runner-up {b} (no interval: the evaluator reported no step times)"
        ci = f"95% CI {self.lo:.3g}-{self.hi:.3g}"
        if self.separated:
            return f"{a}: {self.ratio:.3g}x {b} ({ci})"
        saving = f"{self.memory_saving * 100:.0f}% less memory" if self.memory_saving is not None else "less memory"
        why = {"memory": saving, "measured mean": "higher measured mean"}[self.chosen_by]
        return f"{a} and {b} within noise ({self.ratio:.3g}x, {ci}); chose {a}: {why}"


@dataclass
class SearchResult:
    """The winner and every trial. `trials` has one row per dry run (TRIAL_COLUMNS; a strategy
    re-measured has several); `pruned` one row per candidate never run because it was predicted
    over the memory limit or needs at least the memory of one that ran out."""

    best: Optional[Strategy]
    best_throughput: float
    trials: pd.DataFrame
    pruned: pd.DataFrame
    evaluated: List[Strategy] = field(default_factory=list)    # aligned with trials rows
    stop_reason: str = ""
    num_candidates: int = 0
    memory_limit_bytes: Optional[int] = None
    reason: str = ""                                            # one line: why the winner won
    comparison: Optional[Comparison] = None                     # winner vs runner-up, when two ran

    @property
    def planner_seconds(self) -> List[float]:
        return [s for s in self.trials["planner_seconds"].tolist() if s == s]  # drop NaN

    def explain(self) -> str:
        return self.reason


@runtime_checkable
class LearningPredictorLike(Protocol):
    """A predictor that learns from measurements (e.g. `atorch.auto.calibration.LearningPredictor`).

    The search calls `observe(strategy, measured_step_time_s)` after every successful dry run
    (seconds per optimizer step) and then predicts every candidate again, so the surrogate's
    predictor feature and the memory model follow the refit."""

    def __call__(self, strategy: Strategy) -> Any: ...

    def observe(self, strategy: Strategy, measured_step_time_s: float) -> None: ...


def search_strategy(space: SearchSpace, evaluator: Evaluator, *, max_trials: int = 30, random_samples: int = 3,
                    patience: int = 8, seed: int = 0, predictor: Optional[Predictor] = None,
                    memory_limit_bytes: Optional[int] = None, time_limit_s: Optional[float] = None,
                    batch_size: Optional[int] = None, progress: bool = False,
                    clock: Callable[[], float] = time.monotonic,
                    remeasure_rounds: int = REMEASURE_ROUNDS, planner_factory: Optional[Callable] = None
                    ) -> SearchResult:
    """Search `space` for the highest-throughput strategy; see the module docstring.

    `batch_size` turns predicted step times into predicted samples/s for the table (ranking
    only needs the step times), and a measured throughput into the step time a learning
    predictor observes when the evaluator reports none. `progress` shows a tqdm bar.
    `remeasure_rounds` (0 to turn it off) is the most rounds of interleaved re-measurement
    (leader, challenger) that close the search when the evaluator reports per-step times.
    `planner_factory(labels, choices, prior, seed)` replaces the HEBO planner (tests, benchmarks).
    """
    if max_trials < 1:
        raise ValueError(f"max_trials={max_trials} must be >= 1")
    if random_samples < 0 or patience < 1:
        raise ValueError(f"random_samples={random_samples} must be >= 0 and patience={patience} >= 1")
    # `not x > 0` also refuses NaN, which every comparison lets through.
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s} must be > 0 (or None for no limit)")
    if memory_limit_bytes is not None and (isinstance(memory_limit_bytes, bool) or not memory_limit_bytes > 0):
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes} must be > 0 (or None for no limit)")
    if remeasure_rounds < 0:
        raise ValueError(f"remeasure_rounds={remeasure_rounds} must be >= 0")
    start = clock()
    candidates = space.candidates()
    if not candidates:
        raise ValueError(f"the search space has no valid candidate ({space.size} combinations were all refused; "
                         f"e.g. {next(iter(space.rejected.items()), None)})")
    warned: Set[str] = set()         # predictor problems already logged (once per search)
    predictions = _predict_all(predictor, candidates, warned)
    trials = _TrialLog(candidates, predictions, batch_size)
    feasibility = Feasibility([c.choices for c in candidates], memory_saving_ranks(space), memory_limit_bytes,
                              _peaks(predictions))
    failures = FailureModel([c.choices for c in candidates])
    labels_of = [c.label() for c in candidates]

    def allowed(indices: Any) -> Dict[int, float]:
        """Untried (or given) candidates that may run, with their probability of measuring a
        throughput: of fitting in memory, times of not raising (an option that raised before)."""
        probs = feasibility.probabilities(list(indices))
        return {i: f.p * failures.p_runs(i) for i, f in probs.items() if f.p >= PRUNE_BELOW}

    def pruned_table() -> pd.DataFrame:
        rows = []
        for i in range(len(candidates)):
            if i in trials.tried or feasibility.probability(i).p >= PRUNE_BELOW:
                continue
            p = feasibility.raw_predicted[i]
            rows.append({"strategy": labels_of[i], "predicted_memory": int(p) if p is not None else None,
                         "reason": feasibility.describe(i, labels_of)})
        return pd.DataFrame(rows, columns=["strategy", "predicted_memory", "reason"])

    if not allowed(range(len(candidates))):
        return trials.result(None, "every candidate is predicted over the memory limit", pruned_table(),
                             len(candidates), memory_limit_bytes)

    rng = np.random.default_rng(seed)
    seeding = _Seeding(candidates, random_samples, rng)
    make_planner = planner_factory or _hebo_planner
    prior = _prior(predictions)
    labels = list(space.labels().values())
    choices = [c.choices for c in candidates]
    learner = predictor if isinstance(predictor, LearningPredictorLike) else None
    # Built before the first trial when it will be needed, so its one-time cost (importing hebo,
    # a first GP fit: seconds) counts against time_limit_s like everything else.
    planner = make_planner(labels, choices, prior, seed) if len(allowed(range(len(candidates)))) > \
        seeding.planned(predictions) else None
    stop_reason = "exhausted"
    since_improvement = 0
    bar = _progress_bar(min(max_trials, len(candidates) + 2 * remeasure_rounds), progress)

    def out_of_time(planner_cost: float = 0.0) -> bool:
        return time_limit_s is not None and clock() - start + trials.typical_seconds() + planner_cost > time_limit_s

    def run(index: int, planner_s: float, source: str) -> bool:
        nonlocal predictions, prior
        result, seconds = _evaluate(evaluator, candidates[index].strategy, clock)
        improved = trials.add(index, result, seconds, planner_s, source)
        feasibility.observe(index, result.status, _usable_peak(result.peak_memory_bytes))
        failures.observe(index, result.status)
        bar.update(1)
        bar.set_postfix_str(f"best {trials.best_mean_throughput():.4g}/s")
        if learner is not None and result.ok:
            step = result.step_time_s or (batch_size / result.throughput if batch_size else None)
            if step and _observe(learner, candidates[index].strategy, float(step)):
                predictions = _predict_all(predictor, candidates, warned)
                trials.predictions = predictions
                feasibility.set_predictions(_peaks(predictions))
                prior = _prior(predictions)
                if planner is not None and prior is not None and hasattr(planner, "update_prior"):
                    planner.update_prior(prior)
        return improved

    try:
        held = 0            # dry runs the search phase kept for re-measuring when it stopped
        released = False    # the re-measurement ended early and gave its spare dry runs back
        while True:
            while True:   # the search phase
                remaining = allowed(i for i in range(len(candidates)) if i not in trials.tried)
                # Once the evaluator has shown it reports noise, keep budget for the re-measurements.
                # Not while the leader is ahead of everyone by more than load drift could explain:
                # a re-measurement would only confirm it, a search trial may find a faster neighbour.
                reserve = _remeasure_reserve(max_trials, remeasure_rounds) \
                    if trials.noise_reported and not trials.clearly_ahead() and not released else 0
                if not remaining:
                    stop_reason = "every candidate that fits evaluated"
                    break
                if trials.count >= max_trials - reserve:
                    stop_reason = f"max_trials={max_trials} reached" + (
                        f" ({reserve} kept for re-measuring the top candidates)" if reserve else "")
                    held = reserve
                    break
                if since_improvement >= patience:
                    stop_reason = f"no improvement in {patience} trials (patience)" if trials.runs else \
                        f"{patience} dry runs failed (not out of memory) before any ran (patience)"
                    break
                pick = seeding.next(remaining, predictions, trials.tried, list(trials.runs))
                if out_of_time(planner.expected_seconds if planner and pick is None else 0.0):
                    stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                    break
                planner_s = float("nan")
                if pick is not None:
                    index, source = pick
                else:
                    if planner is None:   # candidates came back under a corrected memory prediction
                        planner = make_planner(labels, choices, prior, seed)
                        if prior is not None and hasattr(planner, "update_prior"):
                            planner.update_prior(prior)
                    log_fit = {i: math.log(max(p, 1e-12)) for i, p in remaining.items()}
                    suggestion = planner.suggest(trials.observations(), sorted(remaining), log_fit=log_fit)
                    index, planner_s, source = suggestion.index, suggestion.seconds, f"hebo-{suggestion.how}"
                    if out_of_time():
                        stop_reason = f"time_limit_s={time_limit_s:g} would be exceeded by another trial"
                        break
                improved = run(index, planner_s, source)
                # Out of memory before anything ran is how the search finds the memory boundary
                # (each one rules out every candidate needing as much): it is not a trial without
                # improvement, or a model that needs a leaner strategy than predicted would stop
                # the search before it reached one. Exceptions do count: a model or loss that
                # raises under every strategy should not cost max_trials dry runs.
                learning_memory = trials.rows[-1]["status"] == "oom" and not trials.runs
                since_improvement = 0 if improved else since_improvement + (0 if learning_memory else 1)
            # The re-measurement phase: the leader against its likeliest challenger, interleaved,
            # until the interval separates the leader from every other candidate or the budget is spent.
            rounds, separated = 0, False
            while trials.noise_reported and rounds < remeasure_rounds:
                untried = allowed(i for i in range(len(candidates)) if i not in trials.tried)
                posterior = _posterior(planner, trials, untried)
                pair = trials.challenge(first=rounds == 0 and not trials.clearly_ahead(), posterior=posterior)
                separated = pair is None
                if pair is None or trials.count + 2 > max_trials or out_of_time(trials.typical_seconds()):
                    break
                newcomer = _likelier_newcomer(posterior, pair, untried) if posterior else None
                if newcomer is not None:
                    run(pair[0], float("nan"), "remeasure")
                    run(newcomer, float("nan"), "challenger")
                else:
                    for index in pair:
                        run(index, float("nan"), "remeasure")
                rounds += 1
            # The leader stood apart from every other candidate before the budget kept for it was
            # spent: the rest goes back to the search, once (at 256 candidates / 20 dry runs, up to
            # 2 of the 4 kept were left unused). So does a last dry run that no round (two runs)
            # fits: the reserve is kept only once the leader stops being clearly ahead, which can
            # happen with one dry run left. A new leader found there is compared with the old on
            # their measurements like any other pair.
            odd_one_left = trials.noise_reported and max_trials - trials.count == 1
            if released or not ((separated and held or odd_one_left) and trials.count < max_trials):
                break
            released = True
    finally:
        bar.close()
    return trials.result(stop_reason, None, pruned_table(), len(candidates), memory_limit_bytes)


def _posterior(planner: Any, trials: "_TrialLog", untried: Iterable[int] = ()
               ) -> Optional[Dict[int, Tuple[float, float]]]:
    """The surrogate's (mean, variance) of log-throughput of every candidate that can win and of
    `untried`, or None without a surrogate (a planner without `posterior`, or none built)."""
    if planner is None or not hasattr(planner, "posterior"):
        return None
    try:
        return planner.posterior(trials.observations(), sorted({*trials.eligible(), *untried})) or None
    except Exception as e:  # noqa: BLE001 - the measurements alone still choose the challenger
        logger.warning("the surrogate's posterior failed (%s); re-measuring by the measurements alone", e)
        return None


def _likelier_newcomer(posterior: Dict[int, Tuple[float, float]], pair: Tuple[int, int],
                       untried: Dict[int, float]) -> Optional[int]:
    """An untried candidate likelier to beat the leader than the measured challenger is, or None.

    The surrogate's posterior gives every candidate a probability of being faster than the
    leader; an untried one's is weighted by its chance to run at all (`untried`: P(fit) x P(does
    not raise)). Re-measuring is for not declaring a leader whose one run was lucky, and the
    leader's repeat does that whoever it is paired with; its partner is best spent on the
    candidate likeliest to overturn it. When the leader has a close measured rival, that is the
    rival; when it is well ahead of every measured candidate, it is an untried one the surrogate
    is unsure of (an option whose effect was only seen in other combinations). In 1,380 paired
    searches (`benchmarks/search.py`: 460 landscapes of 64 and 256 candidates, every family, 3
    predictor settings) this turned 5 that declared 0.66-0.88 of the best into 0.96-1.0 and cost
    2 (1.0 -> 0.995, 0.872 -> 0.851); the other 1,371 did not change."""
    leader, challenger = pair
    if leader not in posterior or challenger not in posterior:
        return None
    best, best_p = None, _p_faster(posterior[leader], posterior[challenger])
    for i, p_runs in sorted(untried.items()):
        p = _p_faster(posterior[leader], posterior[i]) * p_runs if i in posterior else 0.0
        if p > best_p:
            best, best_p = i, p
    return best


def _p_faster(a: Tuple[float, float], b: Tuple[float, float]) -> float:
    """P(B's log-throughput > A's) for independent normal estimates (mean, variance) of each."""
    return float(_normal_cdf((b[0] - a[0]) / math.sqrt(max(a[1] + b[1], 1e-300))))


def _remeasure_reserve(max_trials: int, rounds: int) -> int:
    """Dry runs kept from the search phase for re-measuring: 2 per round, one round per 10 dry
    runs of budget (a budget of 14 keeps 2, one of 20 or more 4): at small budgets finding the
    best region matters more than a second round (benchmarks/search.py)."""
    return min(2 * rounds, 2 * (max_trials // 10))


def _peaks(predictions: List[Any]) -> Optional[List[Optional[float]]]:
    if not predictions or any(p is None for p in predictions):
        return None
    return [float(p.peak_memory_bytes) for p in predictions]


def _observe(learner: LearningPredictorLike, strategy: Strategy, step_time_s: float) -> bool:
    try:
        learner.observe(strategy, step_time_s)
        return True
    except Exception as e:  # noqa: BLE001 - a predictor that cannot learn is still a predictor
        logger.warning("the predictor could not learn from %s (%s); its predictions stay as they were",
                       strategy.describe(), e)
        return False


def _predict_all(predictor: Optional[Predictor], candidates: List[Candidate], warned: Set[str]) -> List[Any]:
    """Every candidate's prediction; None where the predictor raised or answered something
    unusable (one warning per kind of problem and search, naming the first candidate and the count)."""
    if predictor is None:
        return [None] * len(candidates)
    out: List[Any] = []
    problems: Dict[str, Tuple[str, int]] = {}
    for c in candidates:
        prediction, problem = _predict(predictor, c.strategy)
        out.append(prediction)
        if problem is not None:
            kind, detail = problem
            first, count = problems.get(kind, (f"{c.strategy.describe()}: {detail}", 0))
            problems[kind] = (first, count + 1)
    for kind, (first, count) in problems.items():
        if kind not in warned:
            warned.add(kind)
            logger.warning("the predictor gave no usable prediction for %d of %d candidates (e.g. %s); they are "
                           "searched without one", count, len(candidates), first)
    return out


def _predict(predictor: Predictor, strategy: Strategy) -> Tuple[Any, Optional[Tuple[str, str]]]:
    """(prediction, None) or (None, (kind of problem, what was wrong))."""
    try:
        prediction = predictor(strategy)
    except Exception as e:  # noqa: BLE001 - an unpredictable candidate is still searchable
        return None, ("raised", f"raised {type(e).__name__} ({e})")
    problem = _invalid_prediction(prediction)
    return (None, problem) if problem is not None else (prediction, None)


def _usable_peak(peak: Any) -> Optional[float]:
    """A measured peak the memory model can learn from: finite and positive, else unknown."""
    try:
        value = float(peak)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def _invalid_prediction(prediction: Any) -> Optional[Tuple[str, str]]:
    """(kind, what) when a predictor's answer cannot be used, None when it can: it needs a
    finite positive step time and a finite non-negative peak memory."""
    try:
        step, peak = float(prediction.step_time_s), float(prediction.peak_memory_bytes)
    except (AttributeError, TypeError, ValueError) as e:
        return "type", f"an object without numeric step_time_s / peak_memory_bytes ({type(prediction).__name__}: {e})"
    if not (math.isfinite(step) and step > 0):
        return "step_time_s", f"step_time_s={step!r}"
    if not (math.isfinite(peak) and peak >= 0):
        return "peak_memory_bytes", f"peak_memory_bytes={peak!r}"
    return None


def _prior(predictions: List[Any]) -> Optional[List[float]]:
    """Predicted log-throughput of every candidate (up to a constant), or None unless all are predicted."""
    if not predictions or any(p is None for p in predictions):
        return None
    return [-math.log(max(float(p.step_time_s), 1e-12)) for p in predictions]


class _Seeding:
    """The first trials, before the surrogate has data: the predictor's fastest candidates
    (weighted by their probability of fitting), then spread-out ones.

    The spread-out part has at least as many points as the largest dimension has options, and
    each is drawn among the candidates showing the most options not yet covered (weighted by
    the probability of fitting), then the farthest, in changed dimensions, from those already
    tried: after it every option of every dimension has been measured once where memory allows,
    so the surrogate's main effects all start from data rather than from its prior. Picks are
    made one at a time, so each sees what the trials so far taught about memory.
    """

    def __init__(self, candidates: List[Candidate], random_samples: int, rng: np.random.Generator) -> None:
        self.candidates, self.rng = candidates, rng
        dims = len(candidates[0].choices) if candidates else 0
        widest = max((len({c.choices[d] for c in candidates}) for d in range(dims)), default=1)
        self.cover = 0 if random_samples == 0 else max(random_samples, widest)
        self.predicted_left = PREDICTED_SEEDS

    def planned(self, predictions: List[Any]) -> int:
        return self.cover + (PREDICTED_SEEDS if any(p is not None for p in predictions) else 0)

    def next(self, remaining: Dict[int, float], predictions: List[Any], tried: Set[int],
             measured: Sequence[int]) -> Optional[Tuple[int, str]]:
        """The next seed (index, source), or None once seeding is over."""
        if self.predicted_left > 0:
            pool = [i for i in remaining if predictions[i] is not None]
            if pool:
                self.predicted_left -= 1
                best = max(pool, key=lambda i: (math.log(remaining[i]) - math.log(
                    max(float(predictions[i].step_time_s), 1e-12)), -i))
                return best, "predicted-top"
            self.predicted_left = 0
        if self.cover <= 0:
            return None
        self.cover -= 1
        choices = [c.choices for c in self.candidates]
        # Only a run that measured a throughput covers its options (an out-of-memory one did not).
        covered = {(d, v) for j in measured for d, v in enumerate(choices[j])}
        pool = sorted(remaining)
        key = [(round(remaining[i] * sum((d, v) not in covered for d, v in enumerate(choices[i])), 1),
                min((_hamming(choices[i], choices[j]) for j in tried), default=0)) for i in pool]
        top = max(key)
        tied = [i for i, k in zip(pool, key) if k == top]
        return int(tied[int(self.rng.integers(len(tied)))]), "random"


def _expected_loss(mean: float, sd: float) -> float:
    """E[max(0, -d)] for d ~ N(mean, sd^2): the log-throughput expected to be given up by
    choosing a candidate whose advantage over the other is d."""
    if sd <= 0:
        return max(0.0, -mean)
    z = mean / sd
    return sd * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) - mean * _normal_cdf(-z)


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _hamming(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x != y for x, y in zip(a, b))


def _hebo_planner(labels: List[List[str]], choices: List[Tuple[int, ...]], prior: Optional[List[float]], seed: int):
    from atorch.auto.search.bo import CandidatePlanner

    return CandidatePlanner(labels, choices, prior=prior, seed=seed)


def _evaluate(evaluator: Evaluator, strategy: Strategy, clock: Callable[[], float]) -> tuple:
    start = clock()
    try:
        result = evaluator(strategy)
        if not isinstance(result, DryRunResult):
            raise TypeError(f"the evaluator returned {type(result).__name__}, expected DryRunResult")
        if result.ok and not (isinstance(result.throughput, (int, float)) and math.isfinite(result.throughput)
                              and result.throughput > 0):
            result = DryRunResult(0.0, result.peak_memory_bytes,
                                  f"exception: evaluator reported throughput {result.throughput!r}")
    except Exception as e:  # noqa: BLE001 - an evaluator that raises is one failed trial
        logger.warning("evaluating %s raised %s: %s", strategy.describe(), type(e).__name__, e)
        result = DryRunResult(0.0, None, f"exception: {type(e).__name__}: {e}")
    return result, clock() - start


def _run_estimate(result: DryRunResult) -> Tuple[float, Optional[float], float]:
    """(log-throughput, variance of it or None, its degrees of freedom) of one successful dry run."""
    log_tp = math.log(result.throughput)
    steps = log_throughput_of_steps(result.step_times_s) if result.step_times_s else None
    if steps is not None:
        return log_tp, steps.var, steps.df
    if result.throughput_ci is not None:
        lo, hi = result.throughput_ci
        if 0 < lo <= hi:
            # Half the log-width of a 95% interval is 1.96 standard errors (normal approximation).
            return log_tp, ((math.log(hi) - math.log(lo)) / (2 * 1.96)) ** 2, math.inf
    return log_tp, None, math.inf


def _interval(result: DryRunResult) -> Tuple[float, float]:
    """The trial table's (throughput_lo, throughput_hi): the evaluator's interval, else one from its steps."""
    if not result.ok:
        return float("nan"), float("nan")
    if result.throughput_ci is not None:
        return float(result.throughput_ci[0]), float(result.throughput_ci[1])
    log_tp, var, df = _run_estimate(result)
    if var is None:
        return float("nan"), float("nan")
    from atorch.auto.search.stats import t_quantile

    half = (t_quantile(0.95, df) if math.isfinite(df) else 1.96) * math.sqrt(var)
    return math.exp(log_tp - half), math.exp(log_tp + half)


class _TrialLog:
    """Every dry run, and each candidate's pooled measurement."""

    def __init__(self, candidates: List[Candidate], predictions: List[Any], batch_size: Optional[int]) -> None:
        self.candidates = candidates
        self.predictions = predictions
        self.batch_size = batch_size
        self.rows: List[Dict[str, Any]] = []
        self.runs: Dict[int, List[Tuple[DryRunResult, float, Optional[float], float]]] = {}   # ok runs only
        self.failed: Dict[int, DryRunResult] = {}
        self.tried: Set[int] = set()
        self.order: List[int] = []                 # aligned with rows
        self.noise_reported = False
        self._best_mean = -math.inf

    @property
    def count(self) -> int:
        return len(self.rows)

    def add(self, index: int, result: DryRunResult, seconds: float, planner_s: float, source: str) -> bool:
        """Record one dry run; True when it raised the best pooled mean."""
        if index in self.tried and source != "remeasure":
            raise AssertionError(f"candidate {index} suggested twice")   # the search's own invariant
        self.tried.add(index)
        self.order.append(index)
        if result.ok:
            est = _run_estimate(result)
            self.runs.setdefault(index, []).append((result, *est))
            # Identical step times (a deterministic evaluator: a table, a simulator) show no noise,
            # and re-measuring them would repeat the same number: only a variance above rounding
            # (a relative standard error of 1e-6; real timings are >= 1e-3) counts.
            self.noise_reported = self.noise_reported or (est[1] is not None and est[1] > NO_NOISE_VAR)
        else:
            self.failed[index] = result
        pred = self.predictions[index]
        lo, hi = _interval(result)
        self.rows.append({
            "trial": len(self.rows) + 1, "strategy": self.candidates[index].label(), "status": result.status,
            "throughput": result.throughput, "throughput_lo": lo, "throughput_hi": hi,
            "predicted_throughput": pred.throughput(self.batch_size) if pred is not None and self.batch_size
            else float("nan"),
            "predicted_memory": pred.peak_memory_bytes if pred is not None else None,
            "measured_memory": result.peak_memory_bytes, "reason": result.error or "",
            "seconds": seconds, "planner_seconds": planner_s, "source": source})
        ranked = self.ranked()
        best = self.pooled(ranked[0]).mean if ranked else -math.inf
        improved = best > self._best_mean + 1e-12 and result.ok
        self._best_mean = max(self._best_mean, best)
        return improved

    def pooled(self, index: int) -> LogEstimate:
        runs = self.runs[index]
        est = pool_runs([r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs if r[2] is not None])
        if est is None:     # no noise reported: the mean with an unknown variance
            est = LogEstimate(float(np.mean([r[1] for r in runs])), math.nan, math.inf, len(runs))
        return est

    def eligible(self) -> List[int]:
        """Candidates that can win: ran fine, and never failed on a re-measurement."""
        return [i for i in self.runs if i not in self.failed]

    def ranked(self) -> List[int]:
        """Eligible candidates by pooled mean log-throughput, best first."""
        return sorted(self.eligible(), key=lambda i: (-self.pooled(i).mean, i))

    def best_mean_throughput(self) -> float:
        ranked = self.ranked()
        return self.mean_throughput(ranked[0]) if ranked else 0.0

    def mean_throughput(self, index: int) -> float:
        return float(np.mean([r[0].throughput for r in self.runs[index]]))

    def observations(self) -> List[Any]:
        from atorch.auto.search.bo import Observation

        out = []
        for i in self.runs:           # re-measured or not, one pooled observation per candidate
            est = self.pooled(i)
            out.append(Observation(i, est.mean, None if math.isnan(est.var) else est.var))
        return out

    def typical_seconds(self) -> float:
        """Median duration of a trial so far (0 before the first): what the next one will probably cost."""
        if not self.rows:
            return 0.0
        return float(np.median([r["seconds"] for r in self.rows]))

    def _peak(self, index: int) -> Optional[float]:
        # Only peaks the memory model could use (an evaluator may report None, NaN or junk).
        peaks = [p for p in (_usable_peak(r[0].peak_memory_bytes) for r in self.runs[index]) if p is not None]
        return float(np.mean(peaks)) if peaks else None

    def challenge(self, first: bool = False, posterior: Optional[Dict[int, Tuple[float, float]]] = None
                  ) -> Optional[Tuple[int, int]]:
        """(leader, challenger) to re-measure, or None when the leader is separated from every
        other candidate (`first`: never None with two candidates: one dry run's interval, from
        its own steps, does not see load changing between runs, so the first round happens
        unless the lead is beyond `CLEAR_LEAD`, which the search decides). The challenger is the candidate likeliest to be faster than the leader
        (normal approximation of the difference of their log-throughputs); re-measuring both is
        what most reduces the chance of declaring the slower one.

        `posterior` (the surrogate's mean and variance per candidate) replaces each one's own
        pooled measurement in that probability: the leader by measured mean is often the one
        whose single run was lucky, and a truly faster candidate measured a few % low is then
        not the likeliest challenger by the raw means; pooled with what similar candidates
        showed, it can be. (benchmarks/search.py: 7 of 22 misses on 270 development landscapes
        had the best candidate measured but not declared; this choice of challenger did not
        turn any of those 7 into a hit -- the best there was measured low in both of its runs.)
        Separation stays a matter of the measurements alone."""
        ranked = self.ranked()
        if len(ranked) < 2:
            return None
        a = ranked[0]
        ea = self.pooled(a)
        best_p, challenger = -1.0, None
        for b in ranked[1:]:
            eb = self.pooled(b)
            if math.isnan(ea.var) or math.isnan(eb.var):
                p, separated = 0.5, False
            else:
                p = _p_faster((ea.mean, ea.var), (eb.mean, eb.var))
                separated = ratio_ci(ea, eb).separated
            if posterior is not None and a in posterior and b in posterior:
                p = _p_faster(posterior[a], posterior[b])
            if (first or not separated) and p > best_p:
                best_p, challenger = p, b
        return None if challenger is None else (a, challenger)

    def clearly_ahead(self, margin: float = CLEAR_LEAD) -> bool:
        """The leader's throughput over every other eligible candidate is above `margin` with
        95% confidence (by the measurements; False before two candidates ran, or without noise)."""
        ranked = self.ranked()
        if len(ranked) < 2:
            return False
        ea = self.pooled(ranked[0])
        if math.isnan(ea.var):
            return False
        for b in ranked[1:]:
            eb = self.pooled(b)
            if math.isnan(eb.var) or ratio_ci(ea, eb).lo <= margin:
                return False
        return True

    def compare(self, a: int, b: int) -> Optional[Comparison]:
        """A (the higher pooled mean) against B: separated by the interval, or a tie broken by
        memory (at least MEMORY_TIE_BREAK less: A when it is the leaner one and the means are
        within TIE_MAX_LOSS; B only when the throughput expected to be given up by choosing it is
        below TIE_MAX_EXPECTED_LOSS), else by the measured mean."""
        ea, eb = self.pooled(a), self.pooled(b)
        sa, sb = self.candidates[a].strategy, self.candidates[b].strategy
        if math.isnan(ea.var) or math.isnan(eb.var):
            return Comparison(sa, sb, math.exp(ea.mean - eb.mean), None, None, "measured mean", runs=(ea.n, eb.n))
        ci: RatioCI = ratio_ci(ea, eb)
        if ci.separated:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, "throughput", runs=(ea.n, eb.n))
        pa, pb = self._peak(a), self._peak(b)
        winner, chosen_by, saving = a, "measured mean", None
        close = abs(ea.mean - eb.mean) <= -math.log1p(-TIE_MAX_LOSS)
        if pa and pb and abs(pa - pb) >= MEMORY_TIE_BREAK * max(pa, pb):
            # B is leaner but measured slower: worth it only if little throughput is expected to
            # be lost (a 1% rule alone chose candidates truly 3-4% slower after two runs each at
            # 3% noise: benchmarks/search.py, 2 of 17 misses on 270 development landscapes).
            cheap = _expected_loss(eb.mean - ea.mean, math.sqrt(max(ea.var + eb.var, 0.0))) < TIE_MAX_EXPECTED_LOSS
            if (pa < pb and close) or (pb < pa and close and cheap):
                winner, chosen_by = (a, "memory") if pa < pb else (b, "memory")
                saving = 1.0 - min(pa, pb) / max(pa, pb)
        # Otherwise the higher measured mean, still the best estimate: preferring the simpler
        # strategy here chose a 7% slower one on a benchmark landscape (3% noise per dry run).
        if winner == a:
            return Comparison(sa, sb, ci.ratio, ci.lo, ci.hi, chosen_by, saving, (ea.n, eb.n))
        inv = ratio_ci(eb, ea)
        return Comparison(sb, sa, inv.ratio, inv.lo, inv.hi, chosen_by, saving, (eb.n, ea.n))

    def result(self, stop_reason: Optional[str], failure: Optional[str], pruned: pd.DataFrame, num_candidates: int,
               memory_limit_bytes: Optional[int]) -> SearchResult:
        from atorch.auto.search.report import explain

        trials = pd.DataFrame(self.rows, columns=TRIAL_COLUMNS)
        ranked = self.ranked()
        comparison = self.compare(ranked[0], ranked[1]) if len(ranked) >= 2 else None
        best_index: Optional[int]
        if comparison is not None:
            best_index = next(i for i in ranked[:2] if self.candidates[i].strategy == comparison.winner)
        else:
            best_index = ranked[0] if ranked else None
        best = self.candidates[best_index].strategy if best_index is not None else None
        best_tp = self.mean_throughput(best_index) if best_index is not None else 0.0
        out = SearchResult(best, best_tp, trials, pruned, [self.candidates[i].strategy for i in self.order],
                           stop_reason or failure or "", num_candidates, memory_limit_bytes, comparison=comparison)
        out.reason = explain(out)
        return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="strategy search", unit="trial", leave=True)
