"""HEBO-driven suggestions over an explicit candidate list, with a surrogate shaped like strategy spaces.

HEBO's own `suggest()` evolves its acquisition with NSGA-II (population 100 x 100
generations); on an all-categorical space of 128 combinations one suggestion took 77-115 s on
the 2-core CPU machine. A strategy space is a short list of valid candidates, so here HEBO's GP
is fitted on the observed trials and HEBO's LCB acquisition is scored over the remaining
candidates at once (at most `MAX_SCORED` of them: the work per suggestion is bounded by the
trials observed, the fixed fit epochs and that cap).

The surrogate models log-throughput, which for a strategy is close to a sum of per-option
effects (each optimization speeds up or slows down by a factor) plus effects of pairs that
interact (amp with ZeRO, checkpointing with a tensor split). HEBO's GP is given that structure
as its kernel (`AnovaKernel`): an independent effect per option of every dimension, a smaller
one per pair of options of two dimensions, and, when a predictor (the cost model) exists, a
linear term in its standardized predicted log-throughput whose weight the marginal likelihood
learns: a good predictor is used, a useless one is weighted near 0, and an anti-correlated one
is used with its sign flipped. The predictor is never the prior mean, so a wrong one cannot
drag the search. Each observation's measured noise (from the dry run's per-step times) sets
the GP's noise floor.

The acquisition is expected improvement (over the best posterior mean of the candidates
measured so far) times the probability of fitting in memory, the usual form for an unknown
constraint: the value of a trial is what it may add over the incumbent, and an out-of-memory
run adds nothing. An optimistic bound (LCB) weighted by P(fit) instead scores throughput, not
improvement, so a log P(fit) of -0.9 (P = 0.4) outweighed any throughput difference in the
space and kept the search away from the memory boundary, where the fastest strategies usually
are (the ones saving no more memory than needed). On 270 development landscapes
(`benchmarks/search.py`, 64 candidates, 14 dry runs) EI x P(fit) reached >= 0.98 of the best
on 91.9% vs 88.9% for LCB x P(fit) (mean ratio 0.993 vs 0.989); probability of improvement: 90.7%.

A two-way model cannot see a combination of three options that is fast while each option and each
pair of them is slow, and it steers away from it with growing confidence: on such landscapes (an
outside tester's "trap") the search declared 0.83 of the best on average where random search got
0.91. So once no remaining candidate promises an expected gain a dry run could resolve
(`COVERAGE_EI`), a suggestion (at most one in `COVERAGE_SHARE_DIVISOR` trials) goes to the candidate
with the most combinations of three options never measured together, times P(fit): it tests the
model where no trial has tested it, at the moment exploiting it has nothing left to give.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch

# Candidates scored per suggestion at most (a seeded random subset of the rest beyond it): the
# acquisition over 512 candidates is a 512 x n kernel, milliseconds; the cap keeps spaces of
# thousands of combinations inside the planner's 2 s budget too.
MAX_SCORED = 512

# HEBO's GP, fitted by Adam instead of its default pSGLD (which barely moves the kernel's
# hyperparameters from their initial values in 50 epochs at lr 0.01).
_GP_CONFIG = {"lr": 0.05, "num_epochs": 60, "verbose": False, "pred_likeli": False, "optimizer": "adam"}
# Noise floor (on standardized y) when no trial reported its noise.
_DEFAULT_NOISE_LB = 1e-3
# LCB's exploration weight (acquisition="lcb"): the mean minus KAPPA standard deviations of
# the predicted -log-throughput. HEBO's own schedule (about 4 at 10 trials in 5 dimensions)
# explores for hundreds of trials; a search of 10-30 dry runs must exploit sooner.
KAPPA = 2.0
ACQUISITIONS = ("ei", "lcb")
# Below this expected improvement (x P(fit)) of log-throughput for every remaining candidate, a
# trial would gain less than a dry run can resolve (its mean is off by 1-3%): the suggestion goes
# instead to the candidate with the most combinations of three options never measured together,
# where a model of per-option effects and pairs could be wrong without any trial showing it.
COVERAGE_EI = 0.005
# At most one suggestion in this many observed trials goes to coverage: on landscapes where
# failures are common and unrelated, coverage picks gained nothing and cost 1 of 10 (`raising30`).
COVERAGE_SHARE_DIVISOR = 3


@contextlib.contextmanager
def _preserve_torch_threads(threads_inside: Optional[int] = None) -> Iterator[None]:
    """Restore torch's thread count afterwards (importing hebo sets it to 1 process-wide).

    `threads_inside=1` for GP fits: on tiny matrices OpenMP's fork/join costs more than the
    math, and on a busy 2-core machine a 100-epoch fit took 22 s with 2 threads, 0.7 s with 1.
    """
    threads = torch.get_num_threads()
    if threads_inside is not None:
        torch.set_num_threads(threads_inside)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def import_hebo() -> None:
    """Import hebo (a few seconds, once) without its process-wide thread-count side effect."""
    with _preserve_torch_threads():
        import hebo.acquisitions.acq  # noqa: F401
        import hebo.design_space.design_space  # noqa: F401
        import hebo.models.model_factory  # noqa: F401


@dataclass
class Suggestion:
    index: int            # into the candidate list
    seconds: float        # planner time spent on this suggestion
    how: str              # "acquisition", "coverage" (`COVERAGE_EI`) or a fallback's name
    scored: int = 0       # candidates the acquisition was evaluated on


@dataclass(frozen=True)
class Observation:
    """What the planner learns from one evaluated candidate: its mean log-throughput and the
    variance of that mean (None: not reported)."""

    index: int
    log_throughput: float
    noise_var: Optional[float] = None


def _anova_kernel_class():
    import gpytorch
    from gpytorch.constraints import Positive

    class AnovaKernel(gpytorch.kernels.Kernel):
        """k(x, x') = main * share of equal dimensions + pair * share of equal dimension pairs + pred * p p'.

        The inputs are the candidates' category codes (one column per varying dimension) and,
        optionally, a last column with the predictor's feature. `main` is the prior variance of
        the sum of the per-option effects, `pair` that of the pairwise interaction effects: a
        GP with this kernel is Bayesian two-way ANOVA on log-throughput.
        """

        def __init__(self, num_dims: int, has_pred: bool) -> None:
            super().__init__()
            self.num_dims, self.has_pred = num_dims, has_pred
            for name, init in (("main", 1.0), ("pair", 0.3), ("pred", 0.5 if has_pred else 0.0)):
                if name == "pred" and not has_pred:
                    continue
                self.register_parameter(f"raw_{name}", torch.nn.Parameter(torch.zeros(1)))
                self.register_constraint(f"raw_{name}", Positive())
                constraint = getattr(self, f"raw_{name}_constraint")
                getattr(self, f"raw_{name}").data.fill_(float(constraint.inverse_transform(torch.tensor(init))))

        def _value(self, name: str) -> torch.Tensor:
            return getattr(self, f"raw_{name}_constraint").transform(getattr(self, f"raw_{name}"))

        def forward(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
            d = self.num_dims
            eq = (x1[..., :d].unsqueeze(-2) == x2[..., :d].unsqueeze(-3)).to(x1.dtype)
            same = eq.sum(-1)
            k = self._value("main") * same / max(d, 1)
            if d > 1:
                k = k + self._value("pair") * (same * same - same) / (d * (d - 1))
            if self.has_pred:
                k = k + self._value("pred") * x1[..., d:d + 1] @ x2[..., d:d + 1].transpose(-1, -2)
            return k.diagonal(dim1=-2, dim2=-1) if diag else k

    class CodesAndPrediction(torch.nn.Module):
        """HEBO's feature extractor slot: category codes first, then the (scaled) predictor column."""

        def __init__(self, num_dims: int, has_pred: bool) -> None:
            super().__init__()
            self.total_dim = num_dims + int(has_pred)

        def forward(self, x: torch.Tensor, xe: torch.Tensor) -> torch.Tensor:
            return torch.cat([xe.to(torch.float32), x], dim=1)

    return AnovaKernel, CodesAndPrediction


class CandidatePlanner:
    """Suggests the next candidate to evaluate by HEBO's acquisition over the remaining ones.

    `labels[d]` are the category names of dimension d, `choices[i][d]` candidate i's category
    index in it, `prior[i]` (optional) its predicted log-throughput, used as a feature of the
    surrogate (see the module docstring).
    """

    def __init__(self, labels: Sequence[Sequence[str]], choices: Sequence[Sequence[int]],
                 prior: Optional[Sequence[float]] = None, seed: int = 0, kappa: float = KAPPA,
                 acquisition: str = "ei") -> None:
        if acquisition not in ACQUISITIONS:
            raise ValueError(f"acquisition={acquisition!r} is not one of {ACQUISITIONS}")
        import_hebo()
        self.seed, self.kappa, self.acquisition = seed, kappa, acquisition
        self._last_fit: Optional[Tuple[Tuple[Tuple[int, float, Optional[float]], ...], object]] = None
        self.num_candidates = len(choices)
        self.prior = np.zeros(len(choices)) if prior is None else np.asarray(prior, dtype=float)
        self.has_prior = prior is not None and np.ptp(self.prior) > 1e-12
        varying = [d for d, cats in enumerate(labels) if len(cats) > 1]
        self.setup_seconds = self.expected_seconds = 0.0
        self.fits = 0                       # GP fits done (the planner's work, for tests)
        self.coverage_picks = 0             # suggestions made by coverage (`COVERAGE_EI`)
        self.max_scored = 0                 # most candidates one acquisition was evaluated on
        if not varying or len(choices) < 2:  # nothing to model
            self.codes = None
            return
        self.codes = torch.tensor([[c[d] for d in varying] for c in choices], dtype=torch.long)
        if self.has_prior:
            p = (self.prior - self.prior.mean()) / self.prior.std()
            self.pred = torch.tensor(p, dtype=torch.float32).reshape(-1, 1)
        else:
            self.pred = torch.zeros(len(choices), 0)
        # The first GP fit of a process pays lazy imports (gpytorch, torch._refs: seconds);
        # pay them here, once, so a suggestion's time is the planner's own.
        start = time.perf_counter()
        rows = list(range(min(3, len(choices))))
        with _quiet_hebo(seed):
            from hebo.acquisitions.acq import LCB

            model = self._fit(rows, np.arange(len(rows), dtype=float).reshape(-1, 1), None)
            with torch.no_grad():   # the prediction path has lazy first-call costs too
                LCB(model, kappa=1.0)(self.pred[rows], self.codes[rows])
        self.fits = 0
        self.setup_seconds = time.perf_counter() - start
        self.expected_seconds = self.setup_seconds     # what the next suggestion will probably cost

    def _fit(self, rows: Sequence[int], y: np.ndarray, noise_var: Optional[float]) -> object:
        from hebo.models.model_factory import get_model

        AnovaKernel, CodesAndPrediction = _anova_kernel_class()
        # Both are set whenever there is something to model (the only case that fits).
        codes, pred = cast(torch.Tensor, self.codes), cast(torch.Tensor, self.pred)
        num_dims, has_pred = codes.shape[1], pred.shape[1] > 0
        y_var = float(np.var(y)) if len(y) > 1 else 1.0
        # The GP standardizes y: the measured noise variance in those units is its noise floor.
        noise_lb = _DEFAULT_NOISE_LB if noise_var is None else max(1e-4, min(0.5, noise_var / max(y_var, 1e-12)))
        num_uniqs = [int(codes[:, d].max()) + 1 for d in range(num_dims)]
        config = dict(_GP_CONFIG, noise_lb=noise_lb, noise_guess=max(noise_lb, 0.01), num_uniqs=num_uniqs,
                      fe=CodesAndPrediction(num_dims, has_pred), kern=AnovaKernel(num_dims, has_pred))
        model = get_model("gp", pred.shape[1], num_dims, 1, **config)
        rows = list(rows)
        model.fit(pred[rows], codes[rows], torch.tensor(y, dtype=torch.float32))
        self.fits += 1
        return model

    def update_prior(self, prior: Sequence[float]) -> None:
        """A refitted predictor's new predictions: the GP's feature follows them from the next fit."""
        self.prior = np.asarray(prior, dtype=float)
        self._last_fit = None            # fitted on the old feature
        if self.codes is None or not self.has_prior or np.ptp(self.prior) <= 1e-12:
            return     # the kernel's shape (with or without the feature) is fixed at construction
        p = (self.prior - self.prior.mean()) / self.prior.std()
        self.pred = torch.tensor(p, dtype=torch.float32).reshape(-1, 1)

    def _can_model(self, observed: Sequence[Observation]) -> bool:
        """Something to fit: a dimension that varies, and at least two different measurements."""
        return self.codes is not None and len(observed) >= 2 and \
            float(np.ptp([o.log_throughput for o in observed])) >= 1e-12

    def _fitted(self, observed: Sequence[Observation]) -> object:
        """The GP fitted on `observed` (-log-throughput, HEBO minimizes); the last fit is reused
        when the observations did not change (the re-measurement phase asks again)."""
        key = tuple((o.index, o.log_throughput, o.noise_var) for o in observed)
        if self._last_fit is not None and self._last_fit[0] == key:
            return self._last_fit[1]
        noises = [o.noise_var for o in observed if o.noise_var is not None]
        noise_var = float(np.median(noises)) if noises else None
        y = -np.array([[o.log_throughput] for o in observed])
        with _quiet_hebo(self.seed + len(observed)):
            model = self._fit([o.index for o in observed], y, noise_var)
        self._last_fit = (key, model)
        return model

    def posterior(self, observed: Sequence[Observation], indices: Sequence[int]) -> Dict[int, Tuple[float, float]]:
        """The surrogate's posterior (mean, variance) of log-throughput at `indices`, given
        `observed`: for a measured candidate, its measurement pooled with what similar
        candidates showed (empty when there is nothing to model yet)."""
        if not self._can_model(observed) or not indices:
            return {}
        model, codes = self._fitted(observed), cast(torch.Tensor, self.codes)   # set when _can_model
        rows = list(indices)
        with _quiet_hebo(self.seed), torch.no_grad():
            mu, var = model.predict(self.pred[rows], codes[rows])   # type: ignore[attr-defined]
        return {i: (-float(m), float(v)) for i, m, v in zip(rows, mu.reshape(-1), var.reshape(-1))}

    def suggest(self, observed: Sequence[Observation], remaining: Sequence[int],
                log_fit: Optional[Mapping[int, float]] = None) -> Suggestion:
        """The remaining candidate with the highest expected improvement of log-throughput over
        the best measured candidate's posterior mean, times its probability of fitting in memory
        (`log_fit`, its log; 0 when not given). With acquisition="lcb": the lowest LCB of
        -log-throughput less log P(fit), the highest optimistic throughput x P(fit)."""
        if not remaining:
            raise ValueError("no remaining candidate to suggest")
        start = time.perf_counter()
        remaining = list(remaining)
        fit = np.zeros(self.num_candidates)
        if log_fit:
            for i, v in log_fit.items():
                fit[i] = v
        if not self._can_model(observed):
            # Nothing to fit yet: the predictor's favourite (x P(fit)), else the likeliest to fit.
            index = remaining[int(np.argmax(self.prior[remaining] + fit[remaining]))]
            return Suggestion(index, time.perf_counter() - start, "prior" if self.has_prior else "order")
        scored = scored_candidates(remaining, self.seed + len(observed))
        model, codes = self._fitted(observed), cast(torch.Tensor, self.codes)   # set when _can_model
        with _quiet_hebo(self.seed + len(observed)), torch.no_grad():
            if self.acquisition == "lcb":
                from hebo.acquisitions.acq import LCB

                # LCB is an optimistic -log-throughput (HEBO un-standardizes it): minus log P(fit)
                # makes it the optimistic throughput x P(fit), an out-of-memory run counting as 0.
                scores = LCB(model, kappa=self.kappa)(self.pred[scored], codes[scored]).reshape(-1).numpy()
                scores = scores - fit[scored]
            else:
                measured = sorted({o.index for o in observed})
                mu_seen, _ = model.predict(self.pred[measured], codes[measured])   # type: ignore[attr-defined]
                mu, var = model.predict(self.pred[scored], codes[scored])          # type: ignore[attr-defined]
                # Minimizing -log-throughput: the improvement is below the incumbent's posterior mean.
                scores = -(log_expected_improvement(float(mu_seen.min()), mu.reshape(-1).double().numpy(),
                                                    var.reshape(-1).double().numpy()) + fit[scored])
        self.max_scored = max(self.max_scored, len(scored))
        how, keys = "acquisition", [-self.prior[scored], scores]    # the last key sorts first
        if self.acquisition == "ei" and float(np.exp(-scores.min())) < COVERAGE_EI \
                and self.coverage_picks < len(observed) // COVERAGE_SHARE_DIVISOR:
            # Nothing promises a measurable gain under the model: check the model instead.
            uncovered = uncovered_triples(codes.numpy(), sorted({o.index for o in observed}), scored)
            if uncovered.max() > 0:
                how = "coverage"
                self.coverage_picks += 1
                keys.append(np.where(uncovered > 0, -(np.log(np.maximum(uncovered, 1)) + fit[scored]), np.inf))
        # Ties (identical feature rows) go to the predictor's favourite.
        order = np.lexsort(tuple(keys))
        seconds = time.perf_counter() - start
        self.expected_seconds = seconds
        return Suggestion(scored[int(order[0])], seconds, how, len(scored))


def uncovered_triples(codes: np.ndarray, measured: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
    """For each of `candidates`, how many of its combinations of options of three dimensions no
    `measured` candidate has (`codes`: one row of category codes per candidate, one column per
    varying dimension). All 0 with fewer than three dimensions: the surrogate's main effects and
    pairs then describe every candidate exactly, and its own uncertainty is the whole story."""
    dims = codes.shape[1]
    counts = np.zeros(len(candidates), dtype=int)
    if dims < 3 or not len(candidates):
        return counts
    sizes = codes.max(axis=0) + 1
    rows, seen = codes[list(candidates)], codes[list(measured)]
    for combo in itertools.combinations(range(dims), 3):
        radix = np.cumprod([1] + [int(sizes[d]) for d in combo[:-1]])
        keys = rows[:, combo] @ radix
        counts += ~np.isin(keys, seen[:, combo] @ radix)
    return counts


def scored_candidates(candidates: Sequence[int], seed: int) -> List[int]:
    """The candidates a planner scores: all of `candidates` up to `MAX_SCORED`, else a seeded random
    subset of that size (sorted), so the work per suggestion stays bounded in spaces of thousands."""
    if len(candidates) <= MAX_SCORED:
        return list(candidates)
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(list(candidates), size=MAX_SCORED, replace=False))


def log_expected_improvement(best: float, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """log E[max(best - f, 0)] for f ~ N(mean, var) (minimization), stable far in the tail
    where the improvement's probability underflows (those candidates still rank by it)."""
    from scipy.special import log_ndtr

    sd = np.sqrt(np.maximum(var, 1e-18))
    z = (best - mean) / sd
    # E = sd * (z Phi(z) + phi(z)); for z << 0 use Mills' ratio: z Phi(z) + phi(z) ~ phi(z) / z^2.
    log_phi = -0.5 * z * z - 0.5 * np.log(2 * np.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = np.log(np.maximum(z * np.exp(log_ndtr(z)) + np.exp(log_phi), 1e-300))
        tail = log_phi - 2 * np.log(np.maximum(-z, 1e-300))
    return np.log(sd) + np.where(z > -6, direct, tail)


@contextlib.contextmanager
def _quiet_hebo(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, and without HEBO's GP printing its Cholesky retries to stdout."""
    with _seeded(seed), _preserve_torch_threads(threads_inside=1), \
            contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # gpytorch's NumericalWarning on tiny variances
        yield


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Deterministic GP fits (pSGLD noise, embedding init) without touching the caller's RNG streams."""
    np_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        np.random.seed(seed % (2 ** 32))
        try:
            yield
        finally:
            np.random.set_state(np_state)


def hebo_default_suggest_seconds(labels: Sequence[Sequence[str]], observed_choices: Sequence[Sequence[int]],
                                 values: Sequence[float], seed: int = 0) -> float:
    """Seconds one `HEBO.suggest()` with default settings takes after observing the given trials (benchmark)."""
    import_hebo()
    import pandas as pd
    from hebo.design_space.design_space import DesignSpace

    with _preserve_torch_threads():
        from hebo.optimizers.hebo import HEBO

        params = [{"name": f"d{d}", "type": "cat", "categories": list(cats)} for d, cats in enumerate(labels)]
        space = DesignSpace().parse(params)
        opt = HEBO(space, scramble_seed=seed)
        frame = pd.DataFrame({f"d{d}": [labels[d][c[d]] for c in observed_choices] for d in range(len(labels))})
        opt.observe_new_data(frame, -np.asarray(values, dtype=float).reshape(-1, 1))
        with _seeded(seed):
            start = time.perf_counter()
            opt.suggest(n_suggestions=1)
            return time.perf_counter() - start
