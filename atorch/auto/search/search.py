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
   (expected improvement of log-throughput) times P(fit), an out-of-memory run counting as 0;
   when nothing promises a measurable gain, the candidate with the most combinations of three
   options never measured together (what a two-way model cannot see). Failed trials are not throughput
   observations: an exception or timeout retires that one candidate, an out-of-memory trial teaches
   feasibility (step 1); neither reaches the GP. A failure may be the machine's (a collective that
   timed out under load): a candidate whose only run raised or timed out stays on offer to the
   planner, weighted by P(a retry runs) (`FailureModel.p_retry_runs`: learned from how often
   failures in this search did not repeat), and a candidate that ran can outlive such a failure
   (`TrialLog.eligible`). An exception also makes the candidate's options and pairs of options
   suspects of raising wherever they appear (`feasibility.FailureModel`: compile failing on the
   model fails every compile candidate; the explanations of the failures seen, sets of at most two
   causes, share the blame: `failure_causes`), and P(fit) is multiplied by P(does not raise): to the
   GP a failed region looks unmeasured, and its expected improvement drew the search back there
   (benchmarks/search.py, failing-3%: up to 11 of 20 dry runs raised). A predictor that
   learns (`LearningPredictorLike`: it has `observe(strategy, step_time_s)`) is told every
   successful dry run and every candidate is predicted again: the GP's feature and the memory
   model follow the refit.
4. The search phase stops at its share of `max_trials`, after `patience` trials without
   improvement (an out-of-memory run before any candidate ran is not counted: it teaches
   memory; nor is a seed that ran: the seeds cover the space for the surrogate), when the next
   trial would overrun `time_limit_s`, or when nothing is left. Nothing left that may fit but budget
   left: the candidates not run for memory are tried, likeliest to fit first and those dominated by an
   out-of-memory run last (`_pruned_to_retry`), and the stop reason says so.
5. When the evaluator reports per-step times (its noise), the leader is re-measured
   interleaved with the candidate likeliest to beat it (counted in `max_trials`; the surrogate's
   posterior, which pools similar candidates, says who that is: a measured rival, or an untried
   candidate when the posterior, times its chance to run, gives it better odds; its row's source
   is then "challenger"; when the leader's repeat raises or times out, the partner's run retries the
   leader instead, source "retry"), round after round until a 99% interval of their throughput ratio
   (`stats.py`, `trials.LOOK_CONFIDENCE`; the one reported is 95%) separates the leader from
   every other candidate or the rounds are spent; inside the noise, the one using at least 10% less
   memory wins if it gives up little throughput (measured means within 1%, or, when it is the one
   measured slower, an expected loss below 1%: `TrialLog.compare`), else the higher measured mean.
   A leader ahead of everyone by more than `CLEAR_LEAD` (with 95% confidence) is not re-measured,
   and no budget is kept for it meanwhile; budget kept for rounds that the separation made
   unnecessary goes back to the search (once). `SearchResult.comparison` holds the winner against
   the runner-up, `reason` says it in one line.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np
import pandas as pd

from atorch.auto.search.feasibility import PRUNE_BELOW, FailureModel, Feasibility
from atorch.auto.search.predictions import observe, predict_all, predicted_peaks, predicted_prior
from atorch.auto.search.results import (TRIAL_COLUMNS, Comparison, DryRunResult, Evaluator, LearningPredictorLike,
                                        Predictor, SearchResult, usable_peak)
from atorch.auto.search.seeding import Seeding
from atorch.auto.search.space import SearchSpace, memory_saving_ranks
from atorch.auto.search.trials import TrialLog, evaluate, p_faster, user_error

if TYPE_CHECKING:
    from atorch.auto.search.bo import CandidatePlanner

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
                    remeasure_rounds: int = REMEASURE_ROUNDS, planner_factory: Optional[Callable] = None,
                    memory_limit_source: str = "") -> SearchResult:
    """Search `space` for the highest-throughput strategy; see the module docstring.

    `batch_size` turns predicted step times into predicted samples/s for the table (ranking
    only needs the step times), and a measured throughput into the step time a learning
    predictor observes when the evaluator reports none. `progress` shows a tqdm bar.
    `remeasure_rounds` (0 to turn it off) is the most rounds of interleaved re-measurement
    (leader, challenger) that close the search when the evaluator reports per-step times.
    `planner_factory(labels, choices, prior, seed)` replaces the HEBO planner (tests, benchmarks).
    `memory_limit_source` says where `memory_limit_bytes` came from (e.g. "ATORCH_DEVICE_MEMORY_LIMIT=100000"),
    for the reason line when candidates were not run for memory.
    """
    _check_arguments(max_trials, random_samples, patience, time_limit_s, memory_limit_bytes, remeasure_rounds)
    search = _Search(space, evaluator, _Limits(max_trials, patience, time_limit_s, remeasure_rounds),
                     predictor=predictor, memory_limit_bytes=memory_limit_bytes, batch_size=batch_size, clock=clock,
                     random_samples=random_samples, seed=seed, planner_factory=planner_factory,
                     memory_limit_source=memory_limit_source)
    if not search.runnable(search.every_candidate()):
        return search.result(None, "every candidate is predicted over the memory limit")
    search.start_planner()
    return search.result(search.run(progress), None)


def _check_arguments(max_trials: int, random_samples: int, patience: int, time_limit_s: Optional[float],
                     memory_limit_bytes: Optional[int], remeasure_rounds: int) -> None:
    """Refuse settings no search can follow, before anything runs."""
    # Counts must be ints: NaN passed `max_trials < 1` and meant no limit, 1.5 ran 2 trials, True
    # ran 1, and "3" or None raised a bare TypeError from the comparison.
    for name, value in (("max_trials", max_trials), ("random_samples", random_samples), ("patience", patience),
                        ("remeasure_rounds", remeasure_rounds)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"search_strategy: {name}={value!r} must be an int, got {type(value).__name__}")
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


@dataclass(frozen=True)
class _Limits:
    """What ends a search: `search_strategy`'s arguments of the same names."""

    max_trials: int
    patience: int
    time_limit_s: Optional[float]
    remeasure_rounds: int


@dataclass(frozen=True)
class _Pick:
    """The next candidate to run, and where it came from."""

    index: int
    source: str         # "predicted-top" or "random" (a seed), "hebo-<how>" (the planner)
    planner_s: float    # the planner's seconds for the suggestion; NaN for a seed
    is_seed: bool


class _Search:
    """One search: the candidates, the trials so far, what they taught (memory: `feasibility`,
    options that raise: `failures`, a learning predictor: `predictions`), the seeding and the
    planner that pick the next trial, and the clock and limits that end it.

    `run` is the search phase, then the re-measurement phase, then both once more when the
    re-measurement gave dry runs back (`gives_spare_runs_back`)."""

    def __init__(self, space: SearchSpace, evaluator: Evaluator, limits: _Limits, *, predictor: Optional[Predictor],
                 memory_limit_bytes: Optional[int], batch_size: Optional[int], clock: Callable[[], float],
                 random_samples: int, seed: int, planner_factory: Optional[Callable],
                 memory_limit_source: str = "") -> None:
        self.start = clock()
        self.candidates = space.candidates()
        if not self.candidates:
            raise ValueError(f"the search space has no valid candidate ({space.size} combinations were all refused; "
                             f"e.g. {next(iter(space.rejected.items()), None)})")
        self.evaluator, self.limits, self.clock = evaluator, limits, clock
        self.memory_limit_bytes, self.batch_size = memory_limit_bytes, batch_size
        self.memory_limit_source = memory_limit_source
        self.predictor = predictor
        self.learner = predictor if isinstance(predictor, LearningPredictorLike) else None
        self.warned: Set[str] = set()         # predictor problems already logged (once per search)
        self.predictions = predict_all(predictor, self.candidates, self.warned)
        self.prior = predicted_prior(self.predictions)
        self.trials = TrialLog(self.candidates, self.predictions, batch_size)
        self.feasibility = Feasibility([c.choices for c in self.candidates], memory_saving_ranks(space),
                                       memory_limit_bytes, predicted_peaks(self.predictions))
        self.failures = FailureModel([c.choices for c in self.candidates])
        self.seeding = Seeding(self.candidates, random_samples, np.random.default_rng(seed),
                               max_trials=limits.max_trials)
        self.make_planner = planner_factory or _hebo_planner
        self.option_labels = list(space.labels().values())
        self.choices = [c.choices for c in self.candidates]
        self.seed = seed
        self.planner: Any = None              # built by `start_planner`, or by the first suggestion
        self.since_improvement = 0            # trials counted against patience (`_count_for_patience`)
        self.retried: List[int] = []          # candidates not run for memory, tried later (`_pruned_to_retry`)
        self.bar: Any = _NoBar()

    # -- candidates and limits ------------------------------------------------------------------

    def every_candidate(self) -> range:
        return range(len(self.candidates))

    def untried(self) -> Iterator[int]:
        return (i for i in self.every_candidate() if i not in self.trials.tried)

    def runnable(self, indices: Iterable[int]) -> Dict[int, float]:
        """The candidates of `indices` that may run, with their probability of measuring a
        throughput: of fitting in memory, times of not raising (an option that raised before)."""
        probs = self.feasibility.probabilities(list(indices))
        return {i: f.p * self.failures.p_runs(i) for i, f in probs.items() if f.p >= PRUNE_BELOW}

    def out_of_time(self, planner_cost: float = 0.0, index: Optional[int] = None) -> bool:
        """Whether another trial (of candidate `index`, or as long as the typical one so far), plus
        `planner_cost`, would overrun time_limit_s."""
        limit = self.limits.time_limit_s
        return limit is not None and \
            self.clock() - self.start + self.trials.expected_seconds(index) + planner_cost > limit

    def within_time(self, remaining: Dict[int, float]) -> Dict[int, float]:
        """The candidates of `remaining` whose trial is expected to end within time_limit_s (one
        predicted much slower than those tried may not, while quicker ones still fit)."""
        if self.limits.time_limit_s is None:
            return remaining
        return {i: p for i, p in remaining.items() if not self.out_of_time(index=i)}

    def time_stop_reason(self) -> str:
        """Why the search stopped on time: the limit ahead, or already passed (a trial took longer than expected)."""
        limit = self.limits.time_limit_s
        spent = self.clock() - self.start
        if limit is not None and spent > limit and not self.trials.count:
            return (f"time_limit_s={limit:g} exceeded before the first dry run: {spent:.1f} s went to predicting the "
                    "candidates and starting the planner; allow more (ATORCH_SEARCH_TIME_LIMIT)")
        if limit is not None and spent > limit:
            return f"time_limit_s={limit:g} exceeded: {spent:.1f} s spent (a trial took longer than expected)"
        return f"time_limit_s={limit:g} would be exceeded by another trial"

    # -- the search ------------------------------------------------------------------------------

    def start_planner(self) -> None:
        """Build the planner now when the seeds will not cover every candidate that may run, so
        its one-time cost (importing hebo, a first GP fit: seconds) counts against time_limit_s
        like everything else."""
        if len(self.runnable(self.every_candidate())) > self.seeding.planned(self.predictions):
            self.planner = self._new_planner()

    def run(self, progress: bool) -> str:
        """Search, re-measure, and once more both when the re-measurement left dry runs unused;
        why the (last) search phase stopped."""
        limits = self.limits
        self.bar = _progress_bar(min(limits.max_trials, len(self.candidates) + 2 * limits.remeasure_rounds), progress)
        try:
            stop_reason, held = self.search_phase(released=False)
            separated = self.remeasure_phase()
            if self.gives_spare_runs_back(held, separated):
                stop_reason, _ = self.search_phase(released=True)
                self.remeasure_phase()
            return self._with_retries(stop_reason)
        finally:
            self.bar.close()

    def search_phase(self, released: bool) -> Tuple[str, int]:
        """Run seeds, then the planner's suggestions, until nothing is left, the budget (less what
        is kept for re-measuring), patience or time runs out: (why it stopped, the dry runs it
        kept for re-measuring when the budget stopped it). `released`: the re-measurement already
        gave its spare runs back, so nothing is kept any more."""
        limits = self.limits
        while True:
            remaining, retryable = self.runnable(self.untried()), self.retryable()
            reserve = self._reserve(released)
            if not remaining and not retryable and len(self.trials.tried) >= len(self.candidates):
                return "every candidate that fits evaluated", 0
            if self.trials.count >= limits.max_trials - reserve:
                kept = f" ({reserve} kept for re-measuring the top candidates)" if reserve else ""
                return f"max_trials={limits.max_trials} reached" + kept, reserve
            if self.since_improvement >= limits.patience:
                return (f"no improvement in {limits.patience} trials (patience)" if self.trials.runs else
                        f"{limits.patience} dry runs failed (not out of memory) before any ran (patience)"), 0
            if not remaining and not retryable:      # budget is left, and only candidates predicted not to fit
                retry = self._pruned_to_retry()
                if retry is None:
                    return "every candidate that fits evaluated", 0
                self._count_for_patience(self.run_trial(retry, float("nan"), "pruned-retry"), False)
                continue
            pick = self.next_pick(remaining, retryable)
            if pick is None:
                return self.time_stop_reason(), 0
            improved = self.run_trial(pick.index, pick.planner_s, pick.source)
            self._count_for_patience(improved, pick.is_seed)

    def _pruned_to_retry(self) -> Optional[int]:
        """The candidate not run for memory to try next when nothing that may fit is left but budget
        is (None when another trial would overrun time_limit_s).

        Only the candidates that ran are eligible to win, so a dry run the budget would leave unused
        can only help; and pruning rests on a memory model and on dominance after a single run out of
        memory, which a non-monotone or flaky memory breaks: one out-of-memory run pruned 53 of 64
        candidates, 38 of which fit, and the search stopped after 11 distinct candidates of a budget
        of 14 (session 23, finding 2). Order: `Feasibility.retry_order` (the model-pruned by P(fit)
        times P(does not raise), then those dominated by an out-of-memory run: trying them is a
        cheaper mistake than leaving budget unused). A candidate retried
        this way that runs makes those needing no more memory runnable again (dominance)."""
        pruned = list(self.within_time({i: 1.0 for i in self.untried()}))
        if not pruned:
            return None
        pick = self.feasibility.retry_order(pruned, {i: self.failures.p_runs(i) for i in pruned})[0]
        if not self.retried:
            logger.info("every candidate that may fit in memory was evaluated with %d of max_trials=%d dry runs "
                        "spent: trying the candidates predicted not to fit, likeliest to fit first",
                        self.trials.count, self.limits.max_trials)
        self.retried.append(pick)
        return pick

    def _with_retries(self, stop_reason: str) -> str:
        """The stop reason, with what the dry runs on candidates predicted not to fit gave (when any ran)."""
        if not self.retried:
            return stop_reason
        if stop_reason == "every candidate that fits evaluated":
            stop_reason = "every candidate evaluated"
        ran = sum(1 for i in self.retried if i in self.trials.runs)
        return (f"{stop_reason}; once every candidate that may fit had run, {len(self.retried)} dry run(s) "
                f"went to candidates predicted not to fit in memory ({ran} ran)")

    def _reserve(self, released: bool) -> int:
        """The dry runs the search phase keeps for re-measuring: once the evaluator has shown it
        reports noise. Not while the leader is ahead of everyone by more than load drift could
        explain: a re-measurement would only confirm it, a search trial may find a faster neighbour."""
        if self.trials.noise_reported and not self.trials.clearly_ahead() and not released:
            return _remeasure_reserve(self.limits.max_trials, self.limits.remeasure_rounds)
        return 0

    def next_pick(self, remaining: Dict[int, float], retryable: Dict[int, float]) -> Optional[_Pick]:
        """The next candidate among `remaining` (untried) and `retryable` (`retryable`): a seed while
        seeding lasts (untried candidates only), then the planner's suggestion; None when it (and, for a
        suggestion, the planner's work) would overrun time_limit_s."""
        remaining, retryable = self.within_time(remaining), self.within_time(retryable)
        if not remaining and not retryable:
            return None
        seeded = self.seeding.next(remaining, self.predictions, self.trials.tried, list(self.trials.runs)) \
            if remaining else None
        if self.out_of_time(self.planner.expected_seconds if self.planner and seeded is None else 0.0):
            return None
        if seeded is not None:
            return _Pick(seeded[0], seeded[1], float("nan"), True)
        suggestion = self._suggest({**remaining, **retryable})
        if self.out_of_time(index=suggestion.index):     # the suggestion took longer than the planner expected
            return None
        retry = suggestion.index in self.trials.tried
        return _Pick(suggestion.index, "retry" if retry else f"hebo-{suggestion.how}", suggestion.seconds, False)

    def retryable(self) -> Dict[int, float]:
        """Candidates whose only dry run raised or timed out, weighted by their chance to run on a
        retry (P(fit) x `FailureModel.p_retry_runs`): the planner weighs a retry like any other
        trial. A failure that does not repeat (20% of dry runs failing once on an outside tester's
        landscapes) otherwise retired the best candidate for good whenever its one run hit it."""
        failed = [i for i in self.failures.failed_last if i not in self.trials.runs]
        if not failed:
            return {}
        fit = self.feasibility.probabilities(failed)
        weights = {i: fit[i].p * self.failures.p_retry_runs(i) for i in failed}
        return {i: p for i, p in weights.items() if p >= PRUNE_BELOW}

    def _suggest(self, remaining: Dict[int, float]) -> Any:
        """The planner's suggestion among `remaining`, each weighted by its chance to run."""
        if self.planner is None:   # candidates came back under a corrected memory prediction
            self.planner = self._new_planner()
            if self.prior is not None and hasattr(self.planner, "update_prior"):
                self.planner.update_prior(self.prior)
        log_fit = {i: math.log(max(p, 1e-12)) for i, p in remaining.items()}
        return self.planner.suggest(self.trials.observations(), sorted(remaining), log_fit=log_fit)

    def _new_planner(self) -> Any:
        return self.make_planner(self.option_labels, self.choices, self.prior, self.seed)

    def run_trial(self, index: int, planner_s: float, source: str) -> bool:
        """One dry run of candidate `index`, recorded and taught to the memory and failure models
        (and to a learning predictor); True when it raised the best pooled mean."""
        result, seconds = evaluate(self.evaluator, self.candidates[index].strategy, self.clock,
                                   self.memory_limit_bytes, self.warned)
        improved = self.trials.add(index, result, seconds, planner_s, source)
        if result.status == "user":
            raise user_error(str(result.error), self.candidates[index].strategy)
        self.feasibility.observe(index, result.status, usable_peak(result.peak_memory_bytes))
        self.failures.observe(index, result.status, str(result.error or ""))
        self.bar.update(1)
        self.bar.set_postfix_str(f"best {self.trials.best_mean_throughput():.4g}/s")
        if self.learner is not None and result.ok:
            self._teach(self.learner, index, result)
        return improved

    def _teach(self, learner: LearningPredictorLike, index: int, result: DryRunResult) -> None:
        """Tell a learning predictor the step time of a successful run (derived from the throughput
        and `batch_size` when the evaluator reports none) and predict every candidate again: the
        trial table, the memory model and the planner's feature follow the refit."""
        step = result.step_time_s or (self.batch_size / result.throughput if self.batch_size else None)
        if not (step and observe(learner, self.candidates[index].strategy, float(step))):
            return
        self.predictions = predict_all(self.predictor, self.candidates, self.warned)
        self.trials.predictions = self.predictions
        self.feasibility.set_predictions(predicted_peaks(self.predictions))
        self.prior = predicted_prior(self.predictions)
        if self.planner is not None and self.prior is not None and hasattr(self.planner, "update_prior"):
            self.planner.update_prior(self.prior)

    def _count_for_patience(self, improved: bool, is_seed: bool) -> None:
        """Count the last trial against patience unless it improved (then start again from 0).

        Out of memory before anything ran is how the search finds the memory boundary (each one
        rules out every candidate needing as much): it is not a trial without improvement, or a
        model that needs a leaner strategy than predicted would stop the search before it reached
        one. Exceptions do count: a model or loss that raises under every strategy should not cost
        max_trials dry runs. Nor is a seed that ran or ran out of memory: the seeds are chosen to
        cover the space before the surrogate picks, not to improve (with 7 seeds and patience 6,
        `make demo` stopped before its first surrogate-picked trial; on a 7B model's default space
        at 64 ranks, 8 seeds out of memory stopped a 30-run search after 15, all seeds)."""
        status = self.trials.rows[-1]["status"]
        learning_memory = status == "oom" and not self.trials.runs
        covering = is_seed and status in ("ok", "oom")
        if improved:
            self.since_improvement = 0
        elif not (learning_memory or covering):
            self.since_improvement += 1

    # -- the re-measurement ----------------------------------------------------------------------

    def remeasure_phase(self) -> bool:
        """Re-measure the leader against its likeliest challenger, interleaved, round after round;
        True when the interval separated the leader from every other candidate before the rounds,
        the budget or the time were spent. Nothing to do when the evaluator reports no noise."""
        if not self.trials.noise_reported:
            return False
        for round_number in range(self.limits.remeasure_rounds):
            untried = self.runnable(self.untried())
            posterior = _posterior(self.planner, self.trials, _scored(untried, self.seed + self.trials.count))
            pair = self.trials.challenge(first=round_number == 0 and not self.trials.clearly_ahead(),
                                         posterior=posterior)
            if pair is None:
                return True
            if self.trials.count + 2 > self.limits.max_trials or self.out_of_time(self.trials.typical_seconds()):
                return False
            self._remeasure_round(pair, posterior, untried)
        return False

    def _remeasure_round(self, pair: Tuple[int, int], posterior: Optional[Dict[int, Tuple[float, float]]],
                         untried: Dict[int, float]) -> None:
        """The leader again, and its challenger, or an untried candidate that the surrogate's
        posterior gives better odds of beating the leader (its row's source: "challenger")."""
        leader = pair[0]
        newcomer = _likelier_newcomer(posterior, pair, untried) if posterior else None
        self.run_trial(leader, float("nan"), "remeasure")
        if self.trials.needs_retry(leader):
            # Its repeat raised or timed out: the partner's run goes to a retry of the leader instead,
            # which tells a one-off failure (the machine's: it stays eligible) from one that repeats.
            self.run_trial(leader, float("nan"), "retry")
        elif newcomer is not None:
            self.run_trial(newcomer, float("nan"), "challenger")
        else:
            self.run_trial(pair[1], float("nan"), "remeasure")

    def gives_spare_runs_back(self, held: int, separated: bool) -> bool:
        """Whether the search phase gets dry runs back (then, once, it runs again, and the
        re-measurement after it).

        The leader stood apart from every other candidate before the budget kept for it was
        spent: the rest goes back to the search, once (at 256 candidates / 20 dry runs, up to 2 of
        the 4 kept were left unused). So does a last dry run that no round (two runs) fits: the
        reserve is kept only once the leader stops being clearly ahead, which can happen with one
        dry run left. A new leader found there is compared with the old on their measurements like
        any other pair."""
        count, max_trials = self.trials.count, self.limits.max_trials
        odd_one_left = self.trials.noise_reported and max_trials - count == 1
        return ((separated and held > 0) or odd_one_left) and count < max_trials

    # -- the answer ------------------------------------------------------------------------------

    def result(self, stop_reason: Optional[str], failure: Optional[str]) -> SearchResult:
        return self.trials.result(stop_reason, failure, self._pruned_table(), len(self.candidates),
                                  self.memory_limit_bytes, self.memory_limit_source)

    def _pruned_table(self) -> pd.DataFrame:
        """The candidates never run because they are predicted not to fit, and why."""
        labels = [c.label() for c in self.candidates]
        rows = []
        for i in self.every_candidate():
            if i in self.trials.tried or self.feasibility.probability(i).p >= PRUNE_BELOW:
                continue
            p = self.feasibility.raw_predicted[i]
            rows.append({"strategy": labels[i], "predicted_memory": int(p) if p is not None else None,
                         "reason": self.feasibility.describe(i, labels)})
        return pd.DataFrame(rows, columns=["strategy", "predicted_memory", "reason"])


def _posterior(planner: Any, trials: TrialLog, untried: Iterable[int] = ()
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
def _scored(untried: Dict[int, float], seed: int) -> List[int]:
    """The untried candidates whose posterior the re-measurement weighs against the measured
    challenger: as many as a suggestion scores (`bo.scored_candidates`; the posterior of a
    4,216-candidate default space took 1 s a round)."""
    from atorch.auto.search.bo import scored_candidates

    return scored_candidates(sorted(untried), seed)


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


def _hebo_planner(labels: List[List[str]], choices: List[Tuple[int, ...]], prior: Optional[List[float]],
                  seed: int) -> CandidatePlanner:
    """The default planner (`bo.py`), imported only when a search needs one: it imports hebo."""
    from atorch.auto.search.bo import CandidatePlanner

    return CandidatePlanner(labels, choices, prior=prior, seed=seed)


class _NoBar:
    """The progress bar's interface, doing nothing (`progress=False`)."""

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar of `total` trials when `enabled` (tqdm imported only then), else `_NoBar`."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="strategy search", unit="trial", leave=True)
