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
   (benchmarks/search.py, failing-3%: up to 11 of 20 dry runs raised). A predictor that
   learns (`LearningPredictorLike`: it has `observe(strategy, step_time_s)`) is told every
   successful dry run and every candidate is predicted again: the GP's feature and the memory
   model follow the refit.
4. The search phase stops at its share of `max_trials`, after `patience` trials without
   improvement (an out-of-memory run before any candidate ran is not counted: it teaches
   memory; nor is a seed that ran: the seeds cover the space for the surrogate), when the next
   trial would overrun `time_limit_s`, or when nothing is left.
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
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import pandas as pd

from atorch.auto.search.feasibility import PRUNE_BELOW, FailureModel, Feasibility
from atorch.auto.search.predictions import observe, predict_all, predicted_peaks, predicted_prior
from atorch.auto.search.results import (TRIAL_COLUMNS, Comparison, DryRunResult, Evaluator, LearningPredictorLike,
                                        Predictor, SearchResult, usable_peak)
from atorch.auto.search.seeding import Seeding
from atorch.auto.search.space import SearchSpace, memory_saving_ranks
from atorch.auto.search.trials import TrialLog, evaluate, p_faster

__all__ = ["Comparison", "DryRunResult", "Evaluator", "LearningPredictorLike", "Predictor", "SearchResult",
           "TRIAL_COLUMNS", "search_strategy"]

logger = logging.getLogger(__name__)

# Most rounds of interleaved re-measurement (each: one dry run of the leader, one of its challenger).
REMEASURE_ROUNDS = 3


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
    predictions = predict_all(predictor, candidates, warned)
    trials = TrialLog(candidates, predictions, batch_size)
    feasibility = Feasibility([c.choices for c in candidates], memory_saving_ranks(space), memory_limit_bytes,
                              predicted_peaks(predictions))
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
    seeding = Seeding(candidates, random_samples, rng)
    make_planner = planner_factory or _hebo_planner
    prior = predicted_prior(predictions)
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
        result, seconds = evaluate(evaluator, candidates[index].strategy, clock, memory_limit_bytes, warned)
        improved = trials.add(index, result, seconds, planner_s, source)
        feasibility.observe(index, result.status, usable_peak(result.peak_memory_bytes))
        failures.observe(index, result.status)
        bar.update(1)
        bar.set_postfix_str(f"best {trials.best_mean_throughput():.4g}/s")
        if learner is not None and result.ok:
            step = result.step_time_s or (batch_size / result.throughput if batch_size else None)
            if step and observe(learner, candidates[index].strategy, float(step)):
                predictions = predict_all(predictor, candidates, warned)
                trials.predictions = predictions
                feasibility.set_predictions(predicted_peaks(predictions))
                prior = predicted_prior(predictions)
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
                # Nor is a seed that ran: the seeds are chosen to cover the space before the surrogate
                # picks, not to improve (with 7 seeds and patience 6, `make demo` stopped before its
                # first surrogate-picked trial).
                status = trials.rows[-1]["status"]
                learning_memory = status == "oom" and not trials.runs
                seed_ran = pick is not None and status == "ok"
                since_improvement = 0 if improved else since_improvement + (0 if learning_memory or seed_ran else 1)
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


def _posterior(planner: Any, trials: "TrialLog", untried: Iterable[int] = ()
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
    best, best_p = None, p_faster(posterior[leader], posterior[challenger])
    for i, p_runs in sorted(untried.items()):
        p = p_faster(posterior[leader], posterior[i]) * p_runs if i in posterior else 0.0
        if p > best_p:
            best, best_p = i, p
    return best


def _remeasure_reserve(max_trials: int, rounds: int) -> int:
    """Dry runs kept from the search phase for re-measuring: 2 per round, one round per 10 dry
    runs of budget (a budget of 14 keeps 2, one of 20 or more 4): at small budgets finding the
    best region matters more than a second round (benchmarks/search.py)."""
    return min(2 * rounds, 2 * (max_trials // 10))


def _hebo_planner(labels: List[List[str]], choices: List[Tuple[int, ...]], prior: Optional[List[float]], seed: int):
    from atorch.auto.search.bo import CandidatePlanner

    return CandidatePlanner(labels, choices, prior=prior, seed=seed)


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
