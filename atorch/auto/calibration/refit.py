"""The refit: the cost model's step time corrected on every dry run (`LearningPredictor`), and Kendall's tau."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atorch.auto.calibration.predictor import COMPONENTS, Predictor
from atorch.auto.cost_model import Estimate
from atorch.auto.opt_lib.parallel_mode import ParallelModeOptimization
from atorch.auto.strategy import Strategy, StrategyLike


def _features(est: Estimate) -> np.ndarray:
    return np.array([float(est.breakdown.get(k, 0.0)) for k in COMPONENTS])


def fit_weights(features: np.ndarray, measured: np.ndarray, prior_strength: float = 0.1) -> np.ndarray:
    """Non-negative weights w (one per component) with features @ w ~ measured.

    Minimizes sum_i (features_i . w / measured_i - 1)^2 + prior_strength * sum_j (w_j / s - 1)^2,
    s = the median of measured / (features . 1): relative errors, so fast and slow candidates
    count alike, and a prior that keeps the base model's proportions (rescaled by s) until the
    observations say otherwise. `prior_strength` is in units of one observation's squared
    relative error: at 0.1 a handful of consistent observations outweigh it, while one or two
    only rescale (the data then cannot tell the components apart).
    """
    from scipy.optimize import nnls

    features = np.asarray(features, dtype=float)
    measured = np.asarray(measured, dtype=float)
    if features.ndim != 2 or features.shape[0] != measured.shape[0] or features.shape[0] == 0:
        raise ValueError(f"fit_weights needs one row of features per measurement, got {features.shape} and "
                         f"{measured.shape}")
    totals = features.sum(axis=1)
    scale = float(np.median(measured / np.maximum(totals, 1e-30)))
    k = features.shape[1]
    rows = features / measured[:, None]
    prior = math.sqrt(prior_strength) * np.eye(k) / scale
    a = np.vstack([rows, prior])
    b = np.concatenate([np.ones(len(measured)), np.full(k, math.sqrt(prior_strength))])
    weights, _ = nnls(a, b)
    return weights


def option_keys(strategy: StrategyLike) -> Tuple[str, ...]:
    """The options a strategy is made of, as keys a per-option correction can be learned for.

    One key per item (its name, with its config when it has one: `amp_native:{"dtype": ...}`),
    and one per parallel dimension of size > 1 (`parallel_mode:tensor=2`) instead of the layout
    as a whole, so that what is learned about tensor=2 applies to every candidate using it.
    """
    keys: List[str] = []
    for item in Strategy.from_any(strategy):
        if item.name == "parallel_mode":
            dims = _layout(item.config)
            if dims is not None:
                keys.extend(f"parallel_mode:{k}={v}" for k, v in sorted(dims.items()) if v > 1)
                continue
        if item.config is None:
            keys.append(item.name)
        else:
            keys.append(f"{item.name}:{json.dumps(item.config, sort_keys=True, default=repr)}")
    return tuple(sorted(set(keys)))


def _layout(config: Any) -> Optional[Dict[str, int]]:
    """{dim: size} of a parallel_mode config ({} for none: every rank data-parallel), or None when
    parallel_mode refuses it (`parse_config`)."""
    try:
        dims = ParallelModeOptimization.parse_config(config).dims
    except ValueError:
        return None
    return dict(dims) if dims else {}


def fit_option_effects(keys: Sequence[Sequence[str]], residuals: Sequence[float], ridge: float = 2.0,
                       huber_delta: float = 0.1, iterations: int = 10) -> Tuple[float, Dict[str, float]]:
    """(bias, effect per option) with residual_i ~ bias + sum of the effects of row i's options.

    `residuals` are log(measured / predicted). The bias is free (it rescales every candidate
    alike, so it never reorders them); the effects are ridge-shrunk towards 0 with strength
    `ridge` in units of one observation, so an option seen in one or two trials gets a fraction
    of its apparent effect and one trial (whose residual the bias absorbs) changes no ranking.
    A Huber loss (quadratic within max(`huber_delta`, 1.345 x the residuals' robust sigma) in
    log units, linear beyond), by iterated reweighting, keeps one wild measurement from dragging
    the effects of its options.
    """
    if ridge <= 0:
        raise ValueError(f"ridge={ridge!r} must be > 0 (0 would let one trial set an option's effect)")
    y = np.asarray(residuals, dtype=float)
    if len(keys) != len(y) or len(y) == 0:
        raise ValueError(f"fit_option_effects needs one key list per residual, got {len(keys)} and {len(y)}")
    names = sorted({k for row in keys for k in row})
    index = {k: j for j, k in enumerate(names)}
    x = np.zeros((len(y), len(names) + 1))
    x[:, 0] = 1.0
    for i, row in enumerate(keys):
        for k in row:
            x[i, 1 + index[k]] = 1.0
    penalty = np.full(len(names) + 1, float(ridge))
    penalty[0] = 0.0   # the bias is free: it rescales all candidates alike
    weights = np.ones(len(y))
    for _ in range(iterations):
        xtw = x.T * weights
        coef = np.linalg.solve(xtw @ x + np.diag(penalty), xtw @ y)
        r = np.abs(y - x @ coef)
        # The threshold follows the residuals' own spread (1.345 sigma, sigma from the median
        # absolute residual), floored at huber_delta: a fit whose residuals are all alike (a
        # shrunk but consistent fit) keeps every point at full weight; one point far beyond
        # the others is downweighted.
        delta = max(huber_delta, 1.345 * 1.4826 * float(np.median(r)))
        new = np.where(r <= delta, 1.0, delta / np.maximum(r, 1e-12))
        if np.allclose(new, weights):
            break
        weights = new
    return float(coef[0]), {k: float(coef[1 + j]) for k, j in index.items()}


class LearningPredictor:
    """A predictor (`strategy -> Estimate`) whose step times are refitted on every observed dry run.

    `base` must return estimates with the cost model's breakdown (time_compute, time_overhead,
    time_communication), e.g. `cost_model_predictor(...)` with probed constants. Two refits,
    one after the other, on every observation:

    1. (`fit_components`) one non-negative weight per part (`fit_weights`): rescales compute
       against overhead against communication;
    2. (`option_ridge`, None: off) per-option corrections (`fit_option_effects`): the log of
       measured / predicted explained as a bias plus one effect per option (`option_keys`),
       ridge-shrunk towards 0. The prediction of a candidate not yet run is multiplied by
       exp(bias + the effects of its options): what the cost model misjudges about an option
       (autocast's casts on a CPU, a sharder's per-step bookkeeping) is learned from the
       candidates that used it and applied to those that have not run. Options never observed
       get no correction.

    Before any observation it predicts exactly what `base` does. A search uses it by calling
    `observe(strategy, global_batch / throughput)` after each successful dry run and predicting
    the remaining candidates again (base estimates are cached).
    """

    def __init__(self, base: Predictor, prior_strength: float = 0.1, option_ridge: Optional[float] = 2.0,
                 fit_components: bool = True, huber_delta: float = 0.1) -> None:
        if prior_strength <= 0:
            raise ValueError(f"prior_strength={prior_strength!r} must be > 0")
        if option_ridge is not None and option_ridge <= 0:
            raise ValueError(f"option_ridge={option_ridge!r} must be > 0 (or None: no per-option corrections)")
        if huber_delta <= 0:
            raise ValueError(f"huber_delta={huber_delta!r} must be > 0")
        self.base = base
        self.prior_strength = prior_strength
        self.option_ridge = option_ridge
        self.fit_components = fit_components
        self.huber_delta = huber_delta
        self.weights = np.ones(len(COMPONENTS))
        self.bias = 0.0
        self.effects: Dict[str, float] = {}
        self._observed: Dict[str, Tuple[np.ndarray, float, Tuple[str, ...]]] = {}
        self._cache: Dict[str, Tuple[Estimate, Tuple[str, ...]]] = {}

    def _base(self, strategy: StrategyLike) -> Tuple[Estimate, Tuple[str, ...]]:
        s = Strategy.from_any(strategy)
        key = repr(s)
        if key not in self._cache:
            self._cache[key] = (self.base(s), option_keys(s))
        return self._cache[key]

    def correction(self, strategy: StrategyLike) -> float:
        """The factor the per-option refit multiplies `strategy`'s step time by (1.0 before any trial)."""
        _, keys = self._base(strategy)
        return math.exp(self.bias + sum(self.effects.get(k, 0.0) for k in keys))

    def __call__(self, strategy: StrategyLike) -> Estimate:
        est, keys = self._base(strategy)
        x = _features(est)
        if not x.any():
            return est
        factor = math.exp(self.bias + sum(self.effects.get(k, 0.0) for k in keys))
        step = float(x @ self.weights) * factor
        weighted = {k: float(est.breakdown.get(k, 0.0)) * float(w) * factor
                    for k, w in zip(COMPONENTS, self.weights)}
        return Estimate(est.peak_memory_bytes, step, {**est.breakdown, **weighted})

    def observe(self, strategy: StrategyLike, measured_step_time_s: float) -> None:
        """Record a measured step time (seconds per optimizer step) and refit. A repeated strategy
        keeps its latest measurement; failed trials are not observations (pass nothing)."""
        if not (isinstance(measured_step_time_s, (int, float)) and measured_step_time_s > 0
                and math.isfinite(measured_step_time_s)):
            raise ValueError(f"measured_step_time_s={measured_step_time_s!r} must be a finite number > 0")
        s = Strategy.from_any(strategy)
        est, keys = self._base(s)
        x = _features(est)
        if not x.any():
            return
        self._observed[repr(s)] = (x, float(measured_step_time_s), keys)
        xs = np.stack([v[0] for v in self._observed.values()])
        ys = np.array([v[1] for v in self._observed.values()])
        if self.fit_components:
            self.weights = fit_weights(xs, ys, self.prior_strength)
        if self.option_ridge is not None:
            residuals = np.log(ys / np.maximum(xs @ self.weights, 1e-30))
            self.bias, self.effects = fit_option_effects([v[2] for v in self._observed.values()], residuals,
                                                         self.option_ridge, self.huber_delta)

    @property
    def observations(self) -> int:
        return len(self._observed)

    def describe(self) -> Dict[str, float]:
        """The fitted weights per component, the bias and the per-option effects (log units)."""
        return {**dict(zip(COMPONENTS, (float(w) for w in self.weights))), "bias": self.bias,
                **{f"effect {k}": v for k, v in sorted(self.effects.items())}}


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b between two score lists (ties counted as neither concordant nor discordant)."""
    from scipy.stats import kendalltau

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"kendall_tau needs two lists of equal length >= 2, got {len(a)} and {len(b)}")
    return float(kendalltau(a, b).statistic)
