"""A step-time model that learns: device constants from a short probe, then a refit on every dry run.

Two layers over the cost model (`atorch.auto.cost_model.estimate`, used as is):

1. **Probe** (`calibrate_device`): matmul FLOP/s per dtype on this device, and all-reduce
   bandwidth and latency over the current process group. Measured once per device kind (and
   per backend and group size for the collectives), cached as JSON in
   `$ATORCH_CALIBRATION_CACHE` or `~/.cache/atorch/calibration.json` (never pickle), and
   handed to the cost model through its `profile=` argument (`DeviceConstants.as_profile`).
2. **Refit** (`LearningPredictor`), on every measured dry run (`observe(strategy, step_time_s)`):
   one non-negative weight per part of the cost model's step time (compute, overhead,
   communication; least squares on relative errors, shrunk towards a common rescale), then
   per-option corrections: log(measured / predicted) ~ bias + one effect per option of the
   strategy (amp, checkpoint, each sharder, tensor=2, ...), ridge-shrunk towards 0 and fitted
   with a Huber loss. An option the cost model misjudges (autocast on a CPU) is learned from
   the trials that used it and corrects the candidates not yet run, which reorders them; one
   trial only rescales, and one wild measurement is downweighted. Memory is left as the base
   model says.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from atorch.auto.cost_model import Estimate, ModelShape, StrategyTraits, estimate
from atorch.auto.devices import cpu_model_name
from atorch.auto.strategy import Strategy, StrategyLike

logger = logging.getLogger(__name__)

CACHE_ENV = "ATORCH_CALIBRATION_CACHE"
CACHE_VERSION = 1
COMPONENTS = ("time_compute", "time_overhead", "time_communication")

Predictor = Callable[[Strategy], Estimate]


# -- probe --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceConstants:
    """Measured rates of one device kind (and of its collectives at one backend and group size)."""

    device_kind: str
    flops_fp32: float
    flops_bf16: float
    comm_key: Optional[str] = None            # "<backend>:<group size>", when measured
    comm_bytes_per_s: Optional[float] = None  # all-reduce bus bandwidth (ring volume 2(n-1)/n x bytes)
    comm_latency_s: Optional[float] = None    # per all-reduce

    def as_profile(self) -> Dict[str, float]:
        """The keys `cost_model.estimate(profile=...)` overrides."""
        out = {"flops_fp32": self.flops_fp32, "flops_bf16": self.flops_bf16}
        if self.comm_bytes_per_s is not None and self.comm_latency_s is not None:
            out.update(comm_bytes_per_s=self.comm_bytes_per_s, comm_latency_s=self.comm_latency_s)
        return out


def device_kind(device: torch.device) -> str:
    """A name for "this kind of device": GPU model, or CPU model and thread count; with torch's version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model_name() + f" x{torch.get_num_threads()} threads"
    return f"{device.type}:{name}|torch {torch.__version__}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_matmul(device: torch.device, dtype: torch.dtype, size: int = 0, min_seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls of `size` (default: 512 on CPU, 4096 on GPU), median over repeats."""
    size = size or (4096 if device.type == "cuda" else 512)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b   # warm-up (kernel selection, allocation)
    _synchronize(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        _synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 2.0 * size ** 3 / statistics.median(times)


def probe_all_reduce(device: torch.device, group: Any = None, large_bytes: int = 8 << 20,
                     repeats: int = 5) -> Tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of all-reduce over `group`: a 1-element and a large tensor.

    Collective: every rank of `group` must call it. Times are the slowest rank's, so every
    rank returns the same constants.
    """
    n = dist.get_world_size(group)

    def timed(numel: int) -> float:
        x = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(x, group=group)   # warm-up
        samples = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            _synchronize(device)
            samples.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    latency = timed(1)
    large = timed(large_bytes // 4)
    bus_bytes = 2.0 * (n - 1) / n * large_bytes
    return bus_bytes / max(large - latency, 1e-9), latency


def default_cache_path() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atorch", "calibration.json")


def load_cache(path: str) -> Dict[str, Any]:
    """The cache's entries; an unreadable, corrupt or other-version file is ignored with a warning."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"),
                                                                                               dict):
            raise ValueError(f"expected {{'version': {CACHE_VERSION}, 'entries': {{...}}}}")
        return data["entries"]
    except (OSError, ValueError) as e:
        logger.warning("calibration cache %s is unusable (%s); measuring again", path, e)
        return {}


def _save_cache(path: str, entries: Mapping[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": dict(entries)}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def calibrate_device(device: Optional[torch.device] = None, group: Any = None, *, cache_path: Optional[str] = None,
                     refresh: bool = False) -> DeviceConstants:
    """This device's constants, measured on first use and read from the cache afterwards.

    Collective when a process group is initialized (every rank of `group` must call it): the
    collectives are probed over `group` (default: the world) and the matmul rates averaged
    over its ranks, so every rank gets the same constants. Rank 0 writes the cache.
    """
    device = device or torch.device("cpu")
    path = cache_path or default_cache_path()
    kind = device_kind(device)
    distributed = dist.is_available() and dist.is_initialized()
    comm_key = f"{dist.get_backend(group)}:{dist.get_world_size(group)}" if distributed else None
    entries = load_cache(path)
    compute = entries.get(kind, {}).get("compute")
    comm = entries.get(kind, {}).get("comm", {}).get(comm_key) if comm_key else None
    # Every rank must agree on whether to probe (the probe is collective).
    need = [compute is None or refresh, comm_key is not None and int(dist.get_world_size(group)) > 1 and
            (comm is None or refresh)]
    if distributed:
        flags = torch.tensor([int(x) for x in need], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        need = [bool(x) for x in flags.tolist()]
    if need[0]:
        rates = torch.tensor([probe_matmul(device, torch.float32), probe_matmul(device, torch.bfloat16)],
                             dtype=torch.float64)
        if distributed:
            dist.all_reduce(rates, group=group)
            rates /= dist.get_world_size(group)
        compute = {"flops_fp32": float(rates[0]), "flops_bf16": float(rates[1]), "measured": _now()}
    if need[1]:
        bandwidth, latency = probe_all_reduce(device if device.type == "cuda" else torch.device("cpu"), group)
        comm = {"comm_bytes_per_s": bandwidth, "comm_latency_s": latency, "measured": _now()}
    if any(need) and (not distributed or dist.get_rank() == 0):
        entry = dict(entries.get(kind, {}))
        entry["compute"] = compute
        if comm_key is not None and comm is not None:
            entry["comm"] = {**entry.get("comm", {}), comm_key: comm}
        try:
            _save_cache(path, {**entries, kind: entry})
        except OSError as e:
            logger.warning("could not write the calibration cache %s: %s", path, e)
    return DeviceConstants(kind, compute["flops_fp32"], compute["flops_bf16"], comm_key if comm else None,
                           comm["comm_bytes_per_s"] if comm else None, comm["comm_latency_s"] if comm else None)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- the cost model as a predictor ------------------------------------------------------------

def cost_model_predictor(model_or_shape: Any, batch_size: int, seq_len: int, world_size: int,
                         device: Any = "cpu", profile: Optional[Mapping[str, float]] = None) -> Predictor:
    """`strategy -> Estimate` from the cost model, with `gradient_accumulation` accounted for.

    A strategy accumulating over k micro-batches is estimated as one micro-step at the global
    batch / k (its activation memory), then the step's time: compute and per-layer overhead
    k times, gradient reductions once (they are skipped on the other micro-steps), parameter
    gathers of FSDP2 k times.
    """
    shape = model_or_shape if isinstance(model_or_shape, ModelShape) else (
        ModelShape.from_module(model_or_shape) if isinstance(model_or_shape, torch.nn.Module)
        else ModelShape.from_config(model_or_shape))

    def predict(strategy: StrategyLike) -> Estimate:
        s = Strategy.from_any(strategy)
        ga = s.get("gradient_accumulation")
        steps = _steps(ga.config) if ga is not None else 1
        if steps == 1:
            return estimate(shape, s, batch_size, seq_len, world_size, device, profile=profile)
        base = Strategy(i for i in s if i.name != "gradient_accumulation")
        micro = estimate(shape, base, max(1, batch_size // steps), seq_len, world_size, device, profile=profile)
        traits = StrategyTraits.from_strategy(base, world_size, shape)
        comm_repeats = steps if traits.param_shard > 1 else 1
        b = dict(micro.breakdown)
        b["time_compute"] *= steps
        b["time_overhead"] *= steps
        b["time_communication"] *= comm_repeats
        return Estimate(micro.peak_memory_bytes, sum(b[k] for k in COMPONENTS), b)

    return predict


def _steps(config: Any) -> int:
    if isinstance(config, int):
        return config
    if isinstance(config, Mapping):
        return int(config.get("steps", 1))
    return int(getattr(config, "steps", 1))


# -- refit --------------------------------------------------------------------------------------

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
    """{dim: size} of a parallel_mode config ({} for none), or None when it has another form."""
    if config is None:
        return {}
    dims = getattr(config, "dims", None)
    if dims is None and isinstance(config, (tuple, list)) and config and isinstance(config[0], (tuple, list)):
        dims = config[0]
    if dims is None:
        return None
    try:
        return {str(name): int(size) for name, size in dims}
    except (TypeError, ValueError):
        return None


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


__all__ = ["COMPONENTS", "DeviceConstants", "LearningPredictor", "calibrate_device", "cost_model_predictor",
           "default_cache_path", "device_kind", "fit_option_effects", "fit_weights", "kendall_tau", "load_cache",
           "option_keys", "probe_all_reduce", "probe_matmul"]
