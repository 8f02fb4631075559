"""Step-time calibration: the probe's cache, the cost-model predictor with accumulation, the refit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atorch.auto import calibration
from atorch.auto.calibration import (
    COMPONENTS,
    DeviceConstants,
    LearningPredictor,
    calibrate_device,
    cost_model_predictor,
    fit_weights,
    kendall_tau,
)
from atorch.auto.cost_model import Estimate, estimate
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama_config


# -- probe and cache ---------------------------------------------------------------------------

def test_calibrate_device_measures_once_and_caches_json(tmp_path, monkeypatch):
    calls = []

    def fake_probe(device, dtype, size=0, min_seconds=0.2):
        calls.append(dtype)
        return 1e10 if dtype is torch.float32 else 2e10

    monkeypatch.setattr(calibration, "probe_matmul", fake_probe)
    path = str(tmp_path / "sub" / "calibration.json")
    first = calibrate_device(torch.device("cpu"), cache_path=path)
    assert (first.flops_fp32, first.flops_bf16) == (1e10, 2e10) and len(calls) == 2
    assert first.comm_bytes_per_s is None and first.as_profile() == {"flops_fp32": 1e10, "flops_bf16": 2e10}
    data = json.load(open(path))
    assert data["version"] == calibration.CACHE_VERSION and first.device_kind in data["entries"]
    second = calibrate_device(torch.device("cpu"), cache_path=path)
    assert second == first and len(calls) == 2            # read back, not measured again
    calibrate_device(torch.device("cpu"), cache_path=path, refresh=True)
    assert len(calls) == 4


def test_corrupt_or_foreign_cache_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(calibration, "probe_matmul", lambda device, dtype, size=0, min_seconds=0.2: 3e9)
    path = tmp_path / "calibration.json"
    for content in ("{not json", json.dumps({"version": 999, "entries": {}}), json.dumps([1, 2])):
        path.write_text(content)
        caplog.clear()
        constants = calibrate_device(torch.device("cpu"), cache_path=str(path))
        assert constants.flops_fp32 == 3e9
        assert str(path) in caplog.text and "unusable" in caplog.text
        assert json.loads(path.read_text())["version"] == calibration.CACHE_VERSION   # rewritten


def test_cache_path_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "c.json"))
    assert calibration.default_cache_path() == str(tmp_path / "c.json")
    monkeypatch.delenv(calibration.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration.default_cache_path() == str(tmp_path / "atorch" / "calibration.json")


def test_probe_matmul_returns_a_plausible_rate():
    rate = calibration.probe_matmul(torch.device("cpu"), torch.float32, size=64, min_seconds=0.01)
    assert 1e6 < rate < 1e15


# -- the cost model with gradient accumulation -------------------------------------------------

def test_cost_model_predictor_with_gradient_accumulation():
    config = tiny_llama_config(num_hidden_layers=4)
    predict = cost_model_predictor(config, batch_size=16, seq_len=64, world_size=2)
    plain = predict(Strategy(["parallel_mode"]))
    assert plain == estimate(config, Strategy(["parallel_mode"]), 16, 64, 2)
    ga = predict(Strategy(["parallel_mode", ("gradient_accumulation", {"steps": 4})]))
    micro = estimate(config, Strategy(["parallel_mode"]), 4, 64, 2)
    assert ga.peak_memory_bytes == micro.peak_memory_bytes < plain.peak_memory_bytes   # one micro-batch of activations
    assert ga.breakdown["time_compute"] == pytest.approx(4 * micro.breakdown["time_compute"])
    assert ga.breakdown["time_overhead"] == pytest.approx(4 * plain.breakdown["time_overhead"])
    assert ga.breakdown["time_communication"] == pytest.approx(plain.breakdown["time_communication"])  # no_sync
    fsdp = predict(Strategy(["parallel_mode", "fsdp", ("gradient_accumulation", 2)]))
    fsdp_micro = estimate(config, Strategy(["parallel_mode", "fsdp"]), 8, 64, 2)
    assert fsdp.breakdown["time_communication"] == pytest.approx(2 * fsdp_micro.breakdown["time_communication"])
    assert ga.step_time_s == pytest.approx(sum(ga.breakdown[k] for k in COMPONENTS))


# -- refit -------------------------------------------------------------------------------------

def test_fit_weights_recovers_component_weights_from_enough_observations():
    rng = np.random.default_rng(0)
    features = rng.uniform(0.01, 1.0, size=(24, 3))
    truth = np.array([3.0, 0.5, 8.0])
    measured = features @ truth
    weights = fit_weights(features, measured, prior_strength=1e-6)
    assert weights == pytest.approx(truth, rel=1e-3)
    # One observation: the prior keeps the proportions and only rescales.
    one = fit_weights(features[:1], measured[:1], prior_strength=1.0)
    assert np.ptp(one / one.mean()) < 0.6 and features[0] @ one == pytest.approx(measured[0], rel=0.5)
    with pytest.raises(ValueError, match="one row of features per measurement"):
        fit_weights(np.zeros((0, 3)), np.zeros(0))


class _TableBase:
    """A base predictor with fixed breakdowns per strategy name."""

    def __init__(self, rows):
        self.rows = rows
        self.calls = 0

    def __call__(self, strategy):
        self.calls += 1
        c, o, m = self.rows[strategy.describe()]
        return Estimate(1000, c + o + m, {"time_compute": c, "time_overhead": o, "time_communication": m})


def test_learning_predictor_improves_the_ranking_of_the_unobserved():
    rng = np.random.default_rng(1)
    names = [f"parallel_mode+s{i}" for i in range(30)]
    rows = {n: tuple(rng.uniform(0.01, 1.0, size=3)) for n in names}
    truth = np.array([0.2, 4.0, 1.0])      # the real machine: overhead dominates, unlike the base model
    measured = {n: float(np.dot(rows[n], truth)) for n in names}
    base = _TableBase(rows)
    strategies = {n: Strategy([("parallel_mode"), n.split("+")[1]]) for n in names}
    for n, s in strategies.items():
        rows[s.describe()] = rows[n]
    learner = LearningPredictor(base)
    s0 = strategies[names[0]]
    assert learner(s0).step_time_s == pytest.approx(sum(rows[names[0]]))   # before any observation: the base

    def tau(predict, held_out):
        return kendall_tau([-predict(strategies[n]).step_time_s for n in held_out], [-measured[n] for n in held_out])

    before = tau(learner, names[12:])
    for n in names[:12]:
        learner.observe(strategies[n], measured[n])
    after = tau(learner, names[12:])
    assert learner.observations == 12
    assert after > before + 0.3 and after > 0.9, (before, after, learner.describe())
    assert base.calls == 30      # base estimates are computed once per strategy
    with pytest.raises(ValueError, match="finite number > 0"):
        learner.observe(s0, 0.0)


def test_learning_predictor_keeps_memory_and_validates():
    base = _TableBase({"parallel_mode+x": (1.0, 1.0, 1.0)})
    learner = LearningPredictor(base)
    s = Strategy(["parallel_mode", "x"])
    base.rows[s.describe()] = (1.0, 1.0, 1.0)
    learner.observe(s, 6.0)
    assert learner(s).peak_memory_bytes == 1000 and learner(s).step_time_s == pytest.approx(6.0, rel=0.05)
    with pytest.raises(ValueError, match="prior_strength"):
        LearningPredictor(base, prior_strength=0)
    assert kendall_tau([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="equal length"):
        kendall_tau([1], [1])


def test_device_constants_profile_with_comm():
    c = DeviceConstants("cpu:x", 1.0, 2.0, "gloo:2", 3.0, 4.0)
    assert c.as_profile() == {"flops_fp32": 1.0, "flops_bf16": 2.0, "comm_bytes_per_s": 3.0, "comm_latency_s": 4.0}
