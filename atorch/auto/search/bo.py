"""HEBO-driven suggestions over an explicit candidate list.

HEBO's own `suggest()` evolves its acquisition with NSGA-II (population 100 x 100
generations); on an all-categorical space of 128 combinations one suggestion took 77-115 s on
the 2-core CPU machine. A strategy space is a short list of valid candidates, so here HEBO's
surrogate (its GP, with its categorical embeddings) is fitted on the observed trials and
HEBO's LCB acquisition is scored over *every* remaining candidate at once: the exact arg-min
of the acquisition on the space, 0.19 s median and 1.8 s at worst on that machine under load
(benchmarks/RESULTS.md, "Strategy search").

The predictor's log-throughput is the surrogate's prior mean: the GP fits the residual, so a
good cost model makes the GP's job easy and a poor one is learned around.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

# HEBO's own GP settings (hebo.optimizers.hebo.HEBO.model_config for "gp"), except 50 training
# epochs instead of 100: on the test landscapes (tests/unit/test_search.py) both found the best
# after the same median number of trials, and the fit is half the planner's time.
_GP_CONFIG = {"lr": 0.01, "num_epochs": 50, "verbose": False, "noise_lb": 8e-4, "pred_likeli": False}


# A failed trial's log-throughput: log(2) below the worst success. Measured on the benchmark
# landscapes (benchmarks/search.py, no predictor): median evaluations to the target 35 with this
# penalty, 36.5 with 2.0, 74 when failures are left out of the fit.
FAILURE_PENALTY = math.log(2.0)


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
    how: str              # "acquisition" or a fallback's name


class CandidatePlanner:
    """Suggests the next candidate to evaluate by HEBO's acquisition over all remaining ones.

    `labels[d]` are the category names of dimension d, `choices[i][d]` candidate i's category
    index in it, `prior[i]` (optional) its predicted log-throughput. The GP models what the
    predictor gets wrong: y = -(measured - predicted) log-throughput, so with a good cost model
    the surrogate starts from the right ranking and only learns corrections; without one the
    prior is 0 and the GP models the throughput itself.
    """

    def __init__(self, labels: Sequence[Sequence[str]], choices: Sequence[Sequence[int]],
                 prior: Optional[Sequence[float]] = None, seed: int = 0) -> None:
        import_hebo()
        import pandas as pd
        from hebo.design_space.design_space import DesignSpace

        self.seed = seed
        self.prior = np.zeros(len(choices)) if prior is None else np.asarray(prior, dtype=float)
        self.has_prior = prior is not None
        varying = [d for d, cats in enumerate(labels) if len(cats) > 1]
        self.setup_seconds = self.expected_seconds = 0.0
        if not varying:  # one candidate, or candidates differing in nothing: nothing to model
            self.space = None
            return
        # One HEBO categorical parameter per dimension that varies.
        self.space = DesignSpace().parse([{"name": f"d{d}", "type": "cat", "categories": list(labels[d])}
                                          for d in varying])
        frame = pd.DataFrame({f"d{d}": [labels[d][c[d]] for c in choices] for d in varying})
        self._xc, self._xe = self.space.transform(frame[self.space.para_names])
        # The first GP fit of a process pays lazy imports (gpytorch, torch._refs: seconds);
        # pay them here, once, so a suggestion's time is the planner's own.
        start = time.perf_counter()
        rows = list(range(min(3, len(choices))))
        with _quiet_hebo(seed):
            from hebo.acquisitions.acq import LCB

            model = self._fit(rows, np.arange(len(rows), dtype=float).reshape(-1, 1))
            with torch.no_grad():   # the prediction path has lazy first-call costs too
                LCB(model, kappa=1.0)(self._xc, self._xe)
        self.setup_seconds = time.perf_counter() - start
        self.expected_seconds = self.setup_seconds     # what the next suggestion will probably cost

    def _fit(self, rows: Sequence[int], y: np.ndarray) -> object:
        from hebo.models.model_factory import get_model

        num_uniqs = [len(self.space.paras[n].categories) for n in self.space.enum_names]
        config = dict(_GP_CONFIG, num_uniqs=num_uniqs)

        model = get_model("gp", self.space.num_numeric, self.space.num_categorical, 1, **config)
        model.fit(self._xc[list(rows)], self._xe[list(rows)], torch.tensor(y, dtype=torch.float32))
        return model

    def suggest(self, observed: Sequence[Tuple[int, Optional[float]]], remaining: Sequence[int]) -> Suggestion:
        """`observed`: (candidate index, log-throughput or None for a failed trial)."""
        if not remaining:
            raise ValueError("no remaining candidate to suggest")
        start = time.perf_counter()
        remaining = list(remaining)
        ok = [v for _, v in observed if v is not None]
        if self.space is None or len(ok) < 2 or np.ptp(ok) < 1e-12:
            # Nothing to fit yet: the predictor's favourite, else the first remaining.
            index = remaining[int(np.argmax(self.prior[remaining]))]
            return Suggestion(index, time.perf_counter() - start, "prior" if self.has_prior else "order")
        # HEBO minimizes: y = -(log throughput - predicted). A failed trial counts as FAILURE_PENALTY
        # below the worst success, so the GP learns "worse than anything that ran" without an outlier.
        worst = min(ok)
        rows = [i for i, _ in observed]
        y = np.array([[-((v if v is not None else worst - FAILURE_PENALTY) - self.prior[i])] for i, v in observed])
        with _quiet_hebo(self.seed + len(observed)):
            from hebo.acquisitions.acq import LCB

            model = self._fit(rows, y)
            acquisition = LCB(model, kappa=_hebo_kappa(len(observed), self.space.num_paras))
            with torch.no_grad():
                residual = acquisition(self._xc[remaining], self._xe[remaining]).reshape(-1).numpy()
        scores = residual - self.prior[remaining]     # LCB of -log(throughput)
        # Ties (identical feature rows) go to the predictor's favourite.
        order = np.lexsort((-self.prior[remaining], scores))
        seconds = time.perf_counter() - start
        self.expected_seconds = seconds
        return Suggestion(remaining[int(order[0])], seconds, "acquisition")


@contextlib.contextmanager
def _quiet_hebo(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, and without HEBO's GP printing its Cholesky retries to stdout."""
    with _seeded(seed), _preserve_torch_threads(threads_inside=1), \
            contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # gpytorch's NumericalWarning on tiny variances
        yield


def _hebo_kappa(n_observed: int, n_params: int) -> float:
    """HEBO's exploration weight schedule (HEBO.suggest: upsi=0.5, delta=0.01)."""
    upsi, delta = 0.5, 0.01
    it = max(1, n_observed)
    return math.sqrt(upsi * 2 * ((2.0 + n_params / 2.0) * math.log(it) + math.log(3 * math.pi ** 2 / (3 * delta))))


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
