"""Probability that a candidate fits in memory, learned from the memory model and from the dry runs.

Out-of-memory is a property of a candidate, not a low throughput: the search never gives it to
the throughput surrogate. It learns it here instead, from three sources:

- **Dominance** (certain): memory is monotone in the memory-saving choices
  (`space.memory_saving_ranks`). A candidate that saves no more memory than one that ran out
  of memory (every ordered choice saves no more, every unordered one equal) does not fit
  (P = 0); one that saves at least as much as one that ran fine does (P = 1). A declared saving
  can reverse: more accumulation steps hold fewer activations but keep every micro-step's
  gradients alive (whole under DDP and DeepSpeed ZeRO-1; unsharded fp32 under FSDP2 synced once
  a step), which for a large model with checkpointed blocks is more memory, not less. So an
  out-of-memory run rules a candidate out only when the predictor does not put that candidate below
  it by more than twice its measured error (`CONTRADICTION_SDS`); the log-memory model decides
  the rest. The other direction stays certain: vouching wrongly costs one dry run that corrects
  it, ruling out wrongly loses the candidate, and a predictor wrong about the best few
  (predicting them over the limit while what they save says they fit) must not take that rescue
  away.
- **A log-memory model** (uncertain): log peak = log predicted peak (0 without a predictor)
  + a global bias + one effect per option + a per-candidate residual, a Bayesian linear model
  whose posterior is updated by every measured peak (a run that fits reports its peak; one that
  ran out and reports a peak above the limit is observed too). The residual variance is learned
  from the peaks themselves (a scaled inverse chi-square with a prior of `RESIDUAL_PRIOR_DF`
  pseudo-observations), so a predictor that scatters widely makes the search less sure, and
  a candidate predicted just over the limit comes back once the peaks show that its
  prediction may be that far off. P(fit) = Phi((log limit - mean) / sd).
- Without a limit or any memory information: P = 1 (nothing to learn from).

The search prunes a candidate only when P(fit) < `PRUNE_BELOW` and weights its acquisition
by P(fit) otherwise (an expected throughput that counts an out-of-memory run as 0).
`FailureModel` does the same for dry runs that raise: P(does not raise) from the options and
pairs of options the candidates that raised share (never a reason to prune, only a weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
from scipy.special import ndtr

from atorch.auto.search.failure_causes import CauseSets, suspects_of

# Below this probability of fitting a candidate is not run (reported in `pruned`).
PRUNE_BELOW = 0.02
# Prior standard deviations (log scale) of the memory model with a predictor: the global bias of
# the predicted peaks, each option's systematic error, and a candidate's own residual. The cost
# model is validated to ~10-15% per backend (issue 12, item 3); the data widen these when wrong.
PRIOR_SD_WITH_PREDICTOR = {"bias": 0.15, "option": 0.05, "residual": 0.05}
# Without a predictor: the level is unknown (learned from the first peak) and one option
# changes the peak by a factor of about e^+-0.3 (35%) a priori.
PRIOR_SD_WITHOUT = {"bias": 30.0, "option": 0.3, "residual": 0.05}
# Without a predictor, the prior mean of one step of a memory-saving dimension (fsdp over zero2,
# checkpointing over none): it saves memory by definition, about 20% a step a priori. With a mean
# of 0 a step was as likely to add memory as to save it, so after two out-of-memory runs the
# leanest candidates were predicted at the level of those runs and pruned, though they fit.
PRIOR_MEAN_SAVING_STEP = -0.2
# A predictor contradicting a declared ordering (predicting the candidate that should need more memory below
# the other) by more than this many residual standard deviations of its own measured errors keeps an
# out-of-memory run of the other from ruling it out: the cost model knows where a saving reverses
# (accumulated whole gradients); a predictor that scatters this much cannot overrule the declared order.
CONTRADICTION_SDS = 2.0
# A choice's memory-saving score: one number, or one per kind of saving.
RankScore = Union[float, Sequence[float]]
# Weight of the residual prior, in pseudo-observations.
RESIDUAL_PRIOR_DF = 3.0


@dataclass(frozen=True)
class FitProbability:
    """P(fit) of one candidate and why."""

    p: float
    why: str            # "ran", "dominates <j>", "dominated by <j>", "model", "unknown"
    other: Optional[int] = None                 # the candidate that decided it by dominance
    predicted: Optional[float] = None           # the model's median peak (bytes), when used


def _as_vector(score: RankScore) -> Tuple[float, ...]:
    return tuple(float(x) for x in score) if isinstance(score, (tuple, list)) else (float(cast(float, score)),)


class Feasibility:
    """P(fit) for every candidate of a search (see the module docstring).

    `choices[i]` candidate i's option index per dimension, `ranks[d]` dimension d's memory-saving
    scores per option (None: unordered; a number or one per kind of saving, compared kind by kind:
    `space.memory_saving_ranks`), `predicted_peaks[i]` the predictor's peak (None: none).
    """

    def __init__(self, choices: Sequence[Sequence[int]], ranks: Sequence[Optional[Sequence[RankScore]]],
                 limit: Optional[float], predicted_peaks: Optional[Sequence[Optional[float]]] = None) -> None:
        self.choices = np.asarray([list(c) for c in choices], dtype=int).reshape(len(choices), -1)
        # Per dimension, per option: its scores as a vector (a single number is one kind).
        self.ranks: List[Optional[List[Tuple[float, ...]]]] = [
            None if r is None else [_as_vector(x) for x in r] for r in ranks]
        self.limit = limit
        self.oom: List[int] = []
        self.ok: List[int] = []
        self.peaks: Dict[int, float] = {}      # measured log-peaks (ok runs, and oom runs over the limit)
        self._design = self._one_hot()
        self._unordered, self._savings = self._dominance_columns()
        self.set_predictions(predicted_peaks)

    # -- inputs --------------------------------------------------------------------------------

    def set_predictions(self, predicted_peaks: Optional[Sequence[Optional[float]]]) -> None:
        """(Re)set the predictor's peaks (a refitted predictor may change them)."""
        n = len(self.choices)
        peaks = list(predicted_peaks) if predicted_peaks is not None else [None] * n
        self.has_predictor = all(p is not None and p > 0 for p in peaks) and n > 0
        self.offset = np.log(np.asarray([float(p or 1.0) for p in peaks])) if self.has_predictor else np.zeros(n)
        self.raw_predicted = [None if p is None else float(p) for p in peaks]
        # The log-memory model's (median log-peak, its sd) per candidate, and its residual sd: `_fitted_model`.
        self._posterior: Optional[Tuple[np.ndarray, np.ndarray, float]] = None

    def observe(self, i: int, status: str, peak_bytes: Optional[float]) -> None:
        """One dry run of candidate i: status "ok", "oom" or another failure (ignored here)."""
        if status == "oom":
            if i not in self.oom:
                self.oom.append(i)
            if self.limit is not None:
                # Without a peak over the limit, the run still says the candidate needs at least the
                # limit: taken as its peak (a lower bound), it teaches the level of memory when
                # nothing else has (every run so far out of memory, no predictor), so the search
                # turns to the candidates that save more instead of trying blindly.
                over = peak_bytes is not None and peak_bytes > self.limit
                self.peaks[i] = math.log(float(peak_bytes) if over and peak_bytes is not None else self.limit)
        elif status == "ok":
            if i not in self.ok:
                self.ok.append(i)
            if peak_bytes and peak_bytes > 0:
                self.peaks[i] = math.log(peak_bytes)
        else:
            return
        self._posterior = None

    # -- dominance -----------------------------------------------------------------------------

    def needs_at_least(self, i: int, j: int) -> bool:
        """Whether candidate i needs at least the memory of candidate j by the declared savings."""
        for a, b, r in zip(self.choices[i], self.choices[j], self.ranks):
            if r is None:
                if a != b:
                    return False
            elif any(x > y for x, y in zip(r[a], r[b])):   # i saves more of some kind than j
                return False
        return True

    def ruled_out_by(self, i: int, j: int) -> bool:
        """Whether an out-of-memory run of j rules candidate i out: i needs at least j's memory, and the
        predictor does not say otherwise beyond its error (`CONTRADICTION_SDS`)."""
        if not self.needs_at_least(i, j):
            return False
        return not self.has_predictor or bool(self.offset[i] >= self.offset[j] - self._contradiction_margin())

    def _contradiction_margin(self) -> float:
        """How far (log scale) the predictor may put a candidate below one it should need at least the
        memory of before the pair's dominance is off: `CONTRADICTION_SDS` residual sds of the model."""
        return CONTRADICTION_SDS * self._fitted_model()[2]

    def _dominance_columns(self) -> Tuple[np.ndarray, np.ndarray]:
        """`needs_at_least` as arrays, for thousands of candidates at once: every candidate's option
        of each unordered dimension, and its saving score of each kind of each ordered dimension
        (dimensions past `ranks` are not compared, as in `needs_at_least`)."""
        n = len(self.choices)
        unordered, savings = [], []
        for d, r in enumerate(self.ranks[:self.choices.shape[1]]):
            if r is None:
                unordered.append(self.choices[:, d])
                continue
            for kind in range(min((len(x) for x in r), default=0)):
                savings.append(np.asarray([r[v][kind] for v in self.choices[:, d]], dtype=float))
        return (np.stack(unordered, axis=1) if unordered else np.zeros((n, 0), dtype=int),
                np.stack(savings, axis=1) if savings else np.zeros((n, 0)))

    def _first_dominance(self, rows: np.ndarray, others: List[int], rows_need_more: bool) -> np.ndarray:
        """Per row, the position in `others` (out-of-memory runs) of the first that rules it out
        (`rows_need_more`, `ruled_out_by`), or in `others` (runs that fit) of the first that needs
        at least its memory (otherwise, `needs_at_least`); -1 where none."""
        if not others or not len(rows):
            return np.full(len(rows), -1)
        cols = np.asarray(others)
        same = np.all(self._unordered[rows][:, None, :] == self._unordered[cols][None, :, :], axis=2)
        a, b = self._savings[rows][:, None, :], self._savings[cols][None, :, :]
        leaner = np.all(a <= b, axis=2) if rows_need_more else np.all(b <= a, axis=2)
        hit = same & leaner
        if rows_need_more and self.has_predictor:     # `ruled_out_by`: not contradicted beyond the error
            hit &= self.offset[rows][:, None] >= self.offset[cols][None, :] - self._contradiction_margin()
        return np.where(hit.any(axis=1), hit.argmax(axis=1), -1)

    # -- the log-memory model -------------------------------------------------------------------

    def _one_hot(self) -> np.ndarray:
        """Design matrix: an intercept, then per unordered dimension one column per option but
        the first, and per memory-ordered dimension and kind of saving one column per *step* of
        saving (rank >= r):
        an option that saves more is the one before it plus one more step, so a deep saving
        (fsdp = zero1 + two more steps) is a sum of modest effects the prior does not shrink away."""
        cols = [np.ones(len(self.choices))]
        saving = [False]
        for d in range(self.choices.shape[1]):
            values = sorted(set(self.choices[:, d].tolist()))
            r = self.ranks[d] if d < len(self.ranks) else None
            if r is None:
                for v in values[1:]:
                    cols.append((self.choices[:, d] == v).astype(float))
                    saving.append(False)
            else:
                for kind in range(len(r[values[0]]) if values else 0):
                    rank = np.asarray([r[v][kind] for v in self.choices[:, d]])
                    for level in sorted({r[v][kind] for v in values})[1:]:
                        cols.append((rank >= level).astype(float))
                        saving.append(True)
        self._saving_step = np.asarray(saving)
        return np.stack(cols, axis=1)

    def _fit(self) -> tuple:
        """Posterior mean and covariance of the coefficients, and the residual variance."""
        sd = PRIOR_SD_WITH_PREDICTOR if self.has_predictor else PRIOR_SD_WITHOUT
        k = self._design.shape[1]
        prior_var = np.full(k, sd["option"] ** 2)
        prior_var[0] = sd["bias"] ** 2
        prior_mean = np.zeros(k)
        rows = sorted(self.peaks)
        if not self.has_predictor:
            # Effects are absolute here (with a predictor they correct its prediction, mean 0).
            prior_mean[self._saving_step] = PRIOR_MEAN_SAVING_STEP
            if rows:   # the level: the measured peaks' mean, less the savings they had on average
                level = self._design[rows][:, 1:] @ prior_mean[1:]
                prior_mean[0] = float(np.mean([self.peaks[r] for r in rows]) - np.mean(level))
        if not rows:
            return prior_mean, np.diag(prior_var), sd["residual"] ** 2
        x = self._design[rows]
        y = np.asarray([self.peaks[r] for r in rows]) - self.offset[rows]
        # Two passes: the residual variance from the first fit's residuals, then the final fit.
        resid_var = sd["residual"] ** 2
        for _ in range(2):
            precision = np.diag(1.0 / prior_var) + x.T @ x / resid_var
            cov = np.linalg.inv(precision)
            mean = cov @ (prior_mean / prior_var + x.T @ y / resid_var)
            r = y - x @ mean
            # A residual is shrunk by the leverage of its own observation (E r^2 = s^2 (1 - h)):
            # divide it back out, or option effects fitted to few peaks would hide the scatter.
            leverage = np.clip(np.einsum("ij,jk,ik->i", x, cov, x) / resid_var, 0.0, 0.95)
            scatter = float(np.sum(r * r / (1.0 - leverage)))
            resid_var = (RESIDUAL_PRIOR_DF * sd["residual"] ** 2 + scatter) / (RESIDUAL_PRIOR_DF + len(rows))
        return mean, cov, resid_var

    def model(self) -> Tuple[np.ndarray, np.ndarray]:
        """(median predicted log-peak, its standard deviation) of every candidate."""
        mu, sd, _ = self._fitted_model()
        return mu, sd

    def _fitted_model(self) -> Tuple[np.ndarray, np.ndarray, float]:
        """`model`'s answer and the residual sd, fitted once per change of the peaks or predictions."""
        if self._posterior is None:
            mean, cov, resid_var = self._fit()
            mu = self.offset + self._design @ mean
            var = np.einsum("ij,jk,ik->i", self._design, cov, self._design) + resid_var
            self._posterior = (mu, np.sqrt(var), math.sqrt(resid_var))
        return self._posterior

    @property
    def informed(self) -> bool:
        """Whether the model knows anything about the level of memory (a predictor or a peak)."""
        return self.has_predictor or bool(self.peaks)

    # -- the answer ----------------------------------------------------------------------------

    def probability(self, i: int) -> FitProbability:
        return self.probabilities([i])[i]

    def probabilities(self, indices: Sequence[int]) -> Dict[int, FitProbability]:
        """P(fit) of each of `indices`: a measured answer, then dominance by a run (the first in
        run order decides, and is named), then the log-memory model. Array operations throughout:
        the search asks for every untried candidate before each trial, thousands in a default space."""
        indices = list(indices)
        ok, oom = set(self.ok), set(self.oom)
        out: Dict[int, FitProbability] = {}
        for i in indices:
            if i in ok:
                out[i] = FitProbability(1.0, "ran")
            elif i in oom:
                out[i] = FitProbability(0.0, "ran out of memory")
        rest = np.asarray([i for i in indices if i not in out], dtype=int)
        blocker = self._first_dominance(rest, self.oom, rows_need_more=True)
        saver = self._first_dominance(rest, self.ok, rows_need_more=False)
        model = rest[(blocker < 0) & (saver < 0)]
        if len(model) and self.limit is not None and self.informed:
            mu, sd = self.model()
            p = ndtr((math.log(self.limit) - mu[model]) / sd[model])
            modelled = {int(i): FitProbability(float(q), "model", predicted=math.exp(mu[i])) for i, q in zip(model, p)}
        else:
            modelled = {int(i): FitProbability(1.0, "unknown") for i in model}
        for i, b, s in zip(rest.tolist(), blocker.tolist(), saver.tolist()):
            if b >= 0:
                out[i] = FitProbability(0.0, "dominated", self.oom[b])
            elif s >= 0:
                out[i] = FitProbability(1.0, "dominates", self.ok[s])
            else:
                out[i] = modelled[i]
        return {i: out[i] for i in indices}

    def retry_order(self, indices: Sequence[int], weights: Optional[Dict[int, float]] = None) -> List[int]:
        """`indices` (candidates not run for memory) in the order to try them when nothing that may
        fit is left: those pruned by the log-memory model first, the ones dominated by an out-of-memory
        run last (dominance assumes memory monotone in the saving choices, and one run out of memory
        may be transient), each group by the model's P(fit) ignoring dominance, times `weights[i]`
        (e.g. P(does not raise)), highest first."""
        indices = list(indices)
        if not indices:
            return []
        rows = np.asarray(indices, dtype=int)
        dominated = self._first_dominance(rows, self.oom, rows_need_more=True) >= 0
        if self.limit is not None and self.informed:
            mu, sd = self.model()
            p = ndtr((math.log(self.limit) - mu[rows]) / sd[rows])
        else:
            p = np.ones(len(rows))
        w = np.asarray([1.0 if weights is None else weights.get(i, 1.0) for i in indices])
        score = p * w
        return [indices[k] for k in sorted(range(len(rows)), key=lambda k: (bool(dominated[k]), -score[k], indices[k]))]

    def scale(self) -> float:
        """Measured over predicted peak, as the model has learned it (exp of the global bias)."""
        if not self.has_predictor:
            return 1.0
        mean, _, _ = self._fit()
        return float(math.exp(mean[0]))

    def describe(self, i: int, labels: Sequence[str]) -> str:
        """Why candidate i is not run, for the `pruned` table."""
        f = self.probability(i)
        if f.why == "dominated" and f.other is not None:
            return f"needs at least the memory of {labels[f.other]}, which ran out of memory"
        pred = self.raw_predicted[i]
        scale = self.scale()
        if pred is not None:
            scaled = f" (cost model x {scale:.2f}, the measured/predicted ratio)" if abs(scale - 1) > 0.01 else ""
            head = f"predicted {format_bytes(pred)}{scaled}"
        else:
            head = f"memory model {format_bytes(f.predicted)}"
        return f"{head} > {format_bytes(self.limit)} limit (P(fit) {f.p:.3f} < {PRUNE_BELOW})"


def format_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# The prior rate at which a candidate raises for a reason of its own (no option it shares with others):
# the weight of the "no shared cause" explanation of a failure. At 0.1, in a space of ~70 options and
# pairs and before any run rules one out, one failure makes each of its options and pairs a cause with
# P 0.05 (a candidate sharing one option with it runs with P 0.95), two sharing an option make it 0.15
# (0.6), three 0.32 (0.5): other options and pairs they share, and two separate causes, explain them
# too (`failure_causes`); beside runs that rule those out, three failures on one option make it 0.9.
# The rate is learned from the runs (`FailureModel.isolated_rate`):
# this is the mean of its Beta prior, worth `ISOLATED_PRIOR_RUNS` dry runs. A prior worth 5 runs
# followed the first failures of a shared cause too readily (benchmarks/search.py failing-3%, 120 paired
# searches: >= 0.98 of the best in 110 vs 112); at 15 it matched the fixed rate there (112).
ISOLATED_FAILURE_RATE = 0.1
ISOLATED_PRIOR_RUNS = 15.0
# Of the failures that are a candidate's own and read like the machine's (a timeout, a connection
# reset: `looks_transient`), the share that would not repeat, a Beta(a, b) prior updated by what
# retries and re-measurements show: a candidate that failed and also ran is one that did not repeat,
# one that failed twice without running one that did. A priori 1 in 5: a retry costs a dry run.
TRANSIENT_PRIOR = (0.5, 2.0)
# What a failure of the machine rather than of the strategy says (lower case): collectives and
# rendezvous that timed out or lost a peer, a port taken. Any other exception (compile cannot trace
# the model, a shape error) is the strategy's own and repeats: it is retried only once this search
# has seen a failure not repeat.
TRANSIENT_MARKERS = ("timed out", "timeout", "connection reset", "connection refused", "connection closed",
                     "broken pipe", "address already in use", "nccl error", "unhandled system error", "socket")
# Failures that may be the machine's (a collective that timed out under load, a port taken): a
# candidate that failed so is retried once (`FailureModel.p_retry_runs`) and, having run, can outlive
# them (`trials.TrialLog.eligible`). Out of memory is not one (the same job near its limit would run
# out again in a long training run), nor an error in the user's code.
RETRYABLE_STATUSES = ("exception", "timeout", "failed")


def outlived(failures: Sequence[str], runs: int, last_ran: bool) -> bool:
    """Whether a candidate that ran `runs` times outlived the failed runs of statuses `failures`: each one that
    may be the machine's (`RETRYABLE_STATUSES`), no more of them than runs, and its latest run a success. The
    one rule by which the search lets such a candidate win (`trials.TrialLog.eligible`) and the report says so."""
    return last_ran and runs >= len(failures) and all(f in RETRYABLE_STATUSES for f in failures)


def looks_transient(status: str, error: str) -> bool:
    """Whether a failure reads like the machine's rather than the strategy's: a timeout of a collective or a
    peer (the dry runner's "timeout: rank 1: ..."), not of the whole dry run ("timeout: exceeded 300 s": a
    strategy that slow is slow again); an exception whose message has one of `TRANSIENT_MARKERS`."""
    text = error.lower()
    if status == "timeout":
        return "exceeded" not in text
    return any(marker in text for marker in TRANSIENT_MARKERS)


class FailureModel:
    """P(a candidate's dry run does not raise), learned from the candidates that raised and ran.

    A dry run that raises usually has a cause shared with other candidates: one option (compile
    on a model it cannot trace) or a pair of options of two dimensions (an optimization with a
    tensor split). Each option and each such pair is a possible cause (every candidate with it
    raises), a priori one cause in the space (prior 1 / the number of options and pairs); a
    failure can also be the candidate's own, at a rate learned from the runs (`isolated_rate`). A
    possible cause seen in a candidate that ran (or ran out of memory: it got past building and its
    first steps) is ruled out. The posterior is over sets of at most two causes among the rest
    (`failure_causes.CauseSets`), so explanations of the same failures compete for them: two failures
    of amp off with module_replace off are amp off, or that pair, or two causes, and a candidate with
    amp off and module_replace on keeps P(run) ~0.6 (it was 0.11 when each suspect was weighed alone,
    and the best candidate of such a space was never tried). A candidate runs when none of its options
    and pairs is a cause; 1 for a candidate that shares nothing with a failure. Timeouts teach nothing
    here (load can cause them).
    """

    def __init__(self, choices: Sequence[Sequence[int]]) -> None:
        self.keys = [self._keys(c) for c in choices]
        every = {k for keys in self.keys for k in keys}
        self.prior = 1.0 / max(len(every), 1)
        self.seen_failing: set = set()             # options and pairs of candidates that raised
        self.ruled_out: set = set()
        self.raised: List[int] = []            # candidates whose dry run raised, once per dry run
        self.runs = 0                          # dry runs that raised, ran or ran out of memory
        self.rate = ISOLATED_FAILURE_RATE
        self.got_past: set = set()             # candidates that ran or ran out of memory at least once
        # each candidate's latest retryable failure: (status, whether it reads like the machine's)
        self.failed_last: Dict[int, Tuple[str, bool]] = {}
        self.failed_count: Dict[int, int] = {}  # and how many it had
        self.did_not_repeat, self.repeated = 0, 0   # evidence on `TRANSIENT_PRIOR`
        self._cause_state: Optional[tuple] = None
        self._cause_sets: Optional[CauseSets] = None
        self._clear_all: Optional[np.ndarray] = None

    @staticmethod
    def _keys(choice: Sequence[int]) -> List[tuple]:
        singles = [(d, int(v)) for d, v in enumerate(choice)]
        return singles + [a + b for k, a in enumerate(singles) for b in singles[k + 1:]]

    def observe(self, i: int, status: str, error: str = "") -> None:
        """One dry run of candidate i: "exception" makes its options and pairs suspects; "ok" and
        "oom" rule them out; anything else (a timeout) is ignored here. Every status also teaches
        how often a failure repeats (`p_retry_runs`; `error`: the failure's message)."""
        self._learn_repeats(i, status, error)
        if status == "exception":
            self.seen_failing.update(self.keys[i])
            self.raised.append(i)
        elif status in ("ok", "oom"):
            self.ruled_out.update(self.keys[i])
        else:
            return
        self.runs += 1
        self.rate = self.isolated_rate()

    def _learn_repeats(self, i: int, status: str, error: str) -> None:
        if status in RETRYABLE_STATUSES:
            if i in self.got_past:
                self.did_not_repeat += 1
            elif i in self.failed_last:
                self.repeated += 1
            self.failed_last[i] = (status, looks_transient(status, error))
            self.failed_count[i] = self.failed_count.get(i, 0) + 1
        elif status in ("ok", "oom"):
            if i in self.failed_last and i not in self.got_past:
                self.did_not_repeat += 1
            self.got_past.add(i)

    def transient_share(self) -> float:
        """The share of a candidate's own failures that do not repeat (`TRANSIENT_PRIOR`'s posterior mean)."""
        a, b = TRANSIENT_PRIOR
        return (a + self.did_not_repeat) / (a + b + self.did_not_repeat + self.repeated)

    def p_retry_runs(self, i: int) -> float:
        """P(a retry of candidate i runs): 0 unless its only dry run failed in a way that may be the
        machine's (`RETRYABLE_STATUSES`) and it never got past that point; then the chance that the
        failure was its own rather than an option's or pair's times the share of such failures that
        do not repeat. A failure whose message does not read like the machine's (`looks_transient`)
        gets no retry until this search has seen a failure not repeat: a deterministic error (compile
        cannot trace the model) would cost a second dry run for nothing."""
        last = self.failed_last.get(i)
        if last is None or i in self.got_past or self.failed_count[i] > 1:
            return 0.0
        status, machines = last
        if not machines and not self.did_not_repeat:
            return 0.0
        # A timeout is never blamed on options (load causes them): only an exception has a shared cause.
        own = self._p_isolated(i) if status == "exception" else 1.0
        return own * self.transient_share()

    def isolated_rate(self) -> float:
        """The rate at which a dry run raises for a reason of its own, learned from the runs.

        A Beta prior of mean `ISOLATED_FAILURE_RATE` worth `ISOLATED_PRIOR_RUNS` dry runs, updated by
        the failures that no shared cause explains (each counts P(none of its options and pairs is a
        cause)) over the dry runs: a few fixed-point steps, since the posteriors depend on the rate.
        Many failures that share nothing (30% of candidates raising for reasons of their own) raise
        the rate, and then an option or pair that two of them share by chance is weak evidence; a
        fixed 0.1 blamed such options and steered the search away from good regions (raising30top,
        session 23). Failures that concentrate on one option are explained by it and leave the rate low.
        """
        rate = ISOLATED_FAILURE_RATE
        for _ in range(3):
            self.rate = rate
            unexplained = sum(self._p_isolated(i) for i in self.raised)
            rate = (ISOLATED_FAILURE_RATE * ISOLATED_PRIOR_RUNS + unexplained) / (ISOLATED_PRIOR_RUNS + self.runs)
        return rate

    def _causes(self) -> CauseSets:
        """The posterior over sets of causes for the evidence so far at the current `rate` (cached)."""
        state = (len(self.raised), len(self.ruled_out), self.rate)
        if self._cause_state != state:
            self._cause_sets = CauseSets(suspects_of(self.seen_failing, self.ruled_out),
                                         [self.keys[i] for i in self.raised], self.prior, self.rate)
            self._cause_state = state
            self._clear_all = None
        return cast(CauseSets, self._cause_sets)

    def _p_isolated(self, i: int) -> float:
        """P(candidate i's failure is its own): no cause among its options and pairs (`failure_causes`)."""
        return self._causes().p_clear(self.keys[i])

    def posterior(self, key: tuple) -> float:
        """Probability that an option (d, v) or a pair (d, v, e, w) makes every candidate with it raise."""
        return self._causes().marginal(key)

    def p_runs(self, i: int) -> float:
        """P(candidate i has none of the causes of failures): 1 for a candidate that shares nothing with one."""
        if not self.raised:
            return 1.0
        causes = self._causes()
        if self._clear_all is None:    # every candidate at once: the search asks for all that remain
            self._clear_all = causes.p_clear_many(self.keys)
        return float(self._clear_all[i])
