"""Step-time calibration: the probe's cache, the cost-model predictor with accumulation, the refit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from atorch.auto import calibration
from atorch.auto.calibration import device_probe, shape_probe
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

    monkeypatch.setattr(device_probe, "probe_matmul", fake_probe)
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
    monkeypatch.setattr(device_probe, "probe_matmul", lambda device, dtype, size=0, min_seconds=0.2: 3e9)
    path = tmp_path / "calibration.json"
    kind = calibration.device_kind(torch.device("cpu"))
    damaged = [{kind: 5}, {kind: {"compute": "fast"}}, {kind: {"compute": {"flops_fp32": 1e10}}},
               {kind: {"compute": {"flops_fp32": -1.0, "flops_bf16": 1e10}}},
               {kind: {"compute": {"flops_fp32": 1e10, "flops_bf16": True}}}]
    for content in ("{not json", json.dumps({"version": 999, "entries": {}}), json.dumps([1, 2]), "[" * 100_000,
                    *(json.dumps({"version": calibration.CACHE_VERSION, "entries": e}) for e in damaged)):
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
    # One micro-batch of activations, plus the gradients the earlier micro-steps keep alive.
    assert ga.peak_memory_bytes == estimate(config, Strategy(["parallel_mode", ("gradient_accumulation", 4)]), 16,
                                            64, 2).peak_memory_bytes
    assert ga.breakdown["mem_accumulated_grads"] == micro.breakdown["mem_grads"] > 0
    assert micro.peak_memory_bytes < ga.peak_memory_bytes <= micro.peak_memory_bytes + micro.breakdown["mem_grads"]
    assert ga.peak_memory_bytes < plain.peak_memory_bytes
    assert ga.breakdown["time_compute"] == pytest.approx(4 * micro.breakdown["time_compute"])
    assert ga.breakdown["time_overhead"] == pytest.approx(4 * plain.breakdown["time_overhead"])
    assert ga.breakdown["time_communication"] == pytest.approx(plain.breakdown["time_communication"])  # no_sync
    fsdp = predict(Strategy(["parallel_mode", "fsdp", ("gradient_accumulation", 2)]))
    fsdp_once = predict(Strategy(["parallel_mode", "fsdp",
                                  ("gradient_accumulation", {"steps": 2, "sync_each_micro_step": False})]))
    fsdp_micro = estimate(config, Strategy(["parallel_mode", "fsdp"]), 8, 64, 2)
    # FSDP2 gathers the parameters forward and backward in each micro-step and reduce-scatters in each
    # (the default), 6 collectives' volume vs 3; or once (sync_each_micro_step=False): 5 vs 3.
    assert fsdp.breakdown["time_communication"] == pytest.approx(2 * fsdp_micro.breakdown["time_communication"])
    assert fsdp_once.breakdown["time_communication"] == pytest.approx(
        5 / 3 * fsdp_micro.breakdown["time_communication"])
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


# -- per-option corrections --------------------------------------------------------------------

OPTIONS = ("amp_native", "checkpoint", "zero1", "fsdp", "module_replace")
# What the synthetic machine does that the base model does not know: log factors per option.
TRUE_EFFECTS = {"amp_native": 0.5, "checkpoint": -0.3, "zero1": 0.25, "fsdp": 0.6, "module_replace": -0.1,
                "parallel_mode:tensor=2": 0.4}


def _option_landscape():
    """32 candidates (data 2 or tensor 2, x 5 options on/off in a fixed pseudo-random subset), a base
    model with fixed breakdowns, and a 'measured' step = base step x exp(sum of the true effects)."""
    rng = np.random.default_rng(3)
    strategies, rows, measured = [], {}, {}
    for i in range(32):
        layout = [("data", 2)] if i % 2 else [("tensor", 2), ("data", 1)]
        chosen = [o for o, bit in zip(OPTIONS, rng.integers(0, 2, len(OPTIONS))) if bit]
        s = Strategy([("parallel_mode", (layout, None)), *chosen, f"tag{i}"])
        parts = tuple(rng.uniform(0.05, 1.0, size=3))
        rows[s.describe()] = parts
        keys = calibration.option_keys(s)
        measured[s.describe()] = sum(parts) * float(np.exp(sum(TRUE_EFFECTS.get(k, 0.0) for k in keys)))
        strategies.append(s)
    return strategies, _TableBase(rows), measured


def _held_out_tau(predict, strategies, measured):
    return kendall_tau([-predict(s).step_time_s for s in strategies], [-measured[s.describe()] for s in strategies])


def test_option_keys_name_items_configs_and_parallel_dims():
    s = Strategy([("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel",
                  ("amp_native", {"dtype": "bfloat16"}), ("gradient_accumulation", 4)])
    assert calibration.option_keys(s) == ('amp_native:{"dtype": "bfloat16"}', "gradient_accumulation:4",
                                          "parallel_mode:tensor=2", "tensor_parallel")
    assert calibration.option_keys(Strategy(["parallel_mode", "fsdp"])) == ("fsdp",)


def test_per_option_refit_moves_the_ranking_towards_the_truth_as_trials_come_in():
    strategies, base, measured = _option_landscape()
    held_out = strategies[16:]
    taus = []
    for n in (0, 4, 8, 16):
        learner = LearningPredictor(base, fit_components=False)
        for s in strategies[:n]:
            learner.observe(s, measured[s.describe()])
        taus.append(_held_out_tau(learner, held_out, measured))
    assert taus[0] < 0.5 and taus[-1] > 0.75, taus
    assert taus[0] < taus[1] < taus[2] < taus[3], taus     # improves as trials come in
    learner = LearningPredictor(base, fit_components=False)
    for s in strategies[:16]:
        learner.observe(s, measured[s.describe()])
    # Shrunk but in the right direction and order: fsdp's effect the largest, checkpoint's negative.
    effects = learner.effects
    assert effects["fsdp"] > effects["amp_native"] > effects["zero1"] > 0 > effects["checkpoint"]
    assert 0.5 * TRUE_EFFECTS["fsdp"] < effects["fsdp"] < TRUE_EFFECTS["fsdp"] * 1.05
    # The default (component weights, then per-option corrections) gets there too.
    both = LearningPredictor(base)
    for s in strategies[:16]:
        both.observe(s, measured[s.describe()])
    assert _held_out_tau(both, held_out, measured) > 0.75


def test_one_trial_rescales_without_reordering_and_few_trials_move_little():
    strategies, base, measured = _option_landscape()
    plain = [base(s).step_time_s for s in strategies]
    learner = LearningPredictor(base, fit_components=False)
    learner.observe(strategies[0], measured[strategies[0].describe()] * 3.0)
    after = [learner(s).step_time_s for s in strategies]
    assert np.argsort(after).tolist() == np.argsort(plain).tolist()           # the same order
    assert after[0] == pytest.approx(measured[strategies[0].describe()] * 3.0)  # the bias took it all
    assert max(abs(v) for v in learner.effects.values()) < 1e-12
    # Two trials that differ in one option: that option gets a third of the apparent log ratio (ridge 2).
    a = Strategy([("parallel_mode", ([("data", 2)], None)), "x"])
    b = Strategy([("parallel_mode", ([("data", 2)], None)), "x", "fsdp"])
    base2 = _TableBase({a.describe(): (1.0, 0.0, 0.0), b.describe(): (1.0, 0.0, 0.0)})
    two = LearningPredictor(base2, fit_components=False, option_ridge=2.0, huber_delta=10.0)
    two.observe(a, 1.0)
    two.observe(b, 2.0)
    # min over c, e: c^2 + (log 2 - c - e)^2 + 2 e^2 (c = bias + x's effect, free) gives e = log(2) / 5.
    assert two.effects["fsdp"] == pytest.approx(math.log(2.0) / 5.0)


def test_a_wild_measurement_does_not_drag_the_effects():
    strategies, base, measured = _option_landscape()
    seen, held_out = strategies[:16], strategies[16:]
    wild = dict(measured)
    wild[seen[3].describe()] *= 10.0          # one trial 10x slower than the truth (a stalled machine)
    robust = LearningPredictor(base, fit_components=False)
    naive = LearningPredictor(base, fit_components=False, huber_delta=100.0)   # plain least squares
    for s in seen:
        robust.observe(s, wild[s.describe()])
        naive.observe(s, wild[s.describe()])
    clean = LearningPredictor(base, fit_components=False)
    for s in seen:
        clean.observe(s, measured[s.describe()])
    options = [k for k in clean.effects if not k.startswith("tag")]
    moved = max(abs(robust.effects[k] - clean.effects[k]) for k in options)
    moved_naive = max(abs(naive.effects[k] - clean.effects[k]) for k in options)
    assert moved < 0.02 < 0.1 < moved_naive, (moved, moved_naive)
    assert _held_out_tau(robust, held_out, measured) > _held_out_tau(naive, held_out, measured) \
        > _held_out_tau(base, held_out, measured)


def test_fit_option_effects_validates():
    with pytest.raises(ValueError, match="ridge"):
        calibration.fit_option_effects([("a",)], [0.1], ridge=0.0)
    with pytest.raises(ValueError, match="one key list per residual"):
        calibration.fit_option_effects([("a",)], [0.1, 0.2])
    with pytest.raises(ValueError, match="option_ridge"):
        LearningPredictor(_TableBase({}), option_ridge=-1.0)


# -- the probe at the model's shapes -----------------------------------------------------------

def _shape():
    from atorch.auto.cost_model import ModelShape

    return ModelShape.from_config(tiny_llama_config(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                                    vocab_size=128))


def test_model_gemms_are_the_blocks_projections_forward_and_backward():
    shape = _shape()
    gemms = calibration.model_gemms(shape, tokens=32, tensor=1)
    flops = sum(2 * m * k * n * c for m, k, n, c in gemms)
    # 6 x (block matmul params x layers + LM head) per token: forward, input grad, weight grad.
    block_matmuls = 4 * 64 * 64 + 3 * 64 * 96
    assert flops == 6 * 32 * (block_matmuls * shape.num_layers + 64 * 128)
    split = calibration.model_gemms(shape, tokens=32, tensor=2)
    assert sum(2 * m * k * n * c for m, k, n, c in split) == 6 * 32 * (block_matmuls // 2 * 2 + 64 * 128)
    with pytest.raises(ValueError, match="tokens=0"):
        calibration.model_gemms(shape, tokens=0)


def test_probes_return_plausible_rates_on_a_tiny_block():
    shape = _shape()
    rate, overhead = calibration.probe_block(torch.device("cpu"), shape, tokens=64, seq_len=8, tensor=1, half=False,
                                             min_seconds=0.0)
    assert 1e5 < rate < 1e15 and overhead >= 0.0
    rate_half, _ = calibration.probe_block(torch.device("cpu"), shape, tokens=64, seq_len=8, tensor=2, half=True,
                                           min_seconds=0.0)
    assert 1e5 < rate_half < 1e15
    gemm = calibration.probe_model_gemms(torch.device("cpu"), shape, 16, 1, torch.float32, min_seconds=0.0)
    assert 1e5 < gemm < 1e15
    with pytest.raises(ValueError, match="tokens=4 must be >= seq_len=8"):
        calibration.probe_block(torch.device("cpu"), shape, tokens=4, seq_len=8, tensor=1, half=False)


def test_fit_bandwidth_recovers_bandwidth_and_latency():
    bw, lat = 2e9, 3e-4
    times = {size: lat + 2 * (4 - 1) / 4 * size / bw for size in (4, 1 << 16, 1 << 20, 1 << 24)}
    got_bw, got_lat = calibration.fit_bandwidth(times, ranks=4)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)
    with pytest.raises(ValueError, match=">= 2 sizes"):
        calibration.fit_bandwidth({4: 1e-4}, ranks=2)


def _fake_probes(monkeypatch):
    calls = []

    def block(device, shape, tokens, seq_len, tensor, half, min_seconds=0.1):
        calls.append(("block", tokens, tensor, half))
        return (2e10 if half else 1e10) * tensor, 1e-3

    def gemms(device, shape, tokens, tensor, dtype, min_seconds=0.02):
        calls.append(("gemm", tokens, tensor, dtype))
        return 5e10

    monkeypatch.setattr(shape_probe, "probe_block", block)
    monkeypatch.setattr(shape_probe, "probe_model_gemms", gemms)
    return calls


def test_calibrate_model_measures_missing_points_once_and_caches_json(tmp_path, monkeypatch):
    calls = _fake_probes(monkeypatch)
    shape = _shape()
    path = str(tmp_path / "calibration.json")
    first = calibration.calibrate_model(shape, [(32, 1)], seq_len=8, cache_path=path)
    assert len(calls) == 2 and first.flops == {"bf16:tokens=32:tensor=1": 2e10, "fp32:tokens=32:tensor=1": 1e10}
    assert first.layer_overhead_s["fp32:tokens=32:tensor=1"] == 1e-3 and first.comm_bytes_per_s is None
    text = open(path).read()
    assert json.loads(text)["version"] == calibration.CACHE_VERSION and "pickle" not in text
    again = calibration.calibrate_model(shape, [(32, 1)], seq_len=8, cache_path=path)
    assert again == first and len(calls) == 2                       # read back
    wider = calibration.calibrate_model(shape, [(32, 1), (64, 2)], seq_len=8, cache_path=path)
    assert len(calls) == 4 and wider.flops["fp32:tokens=64:tensor=2"] == 2e10   # only the new point measured
    other_seq = calibration.calibrate_model(shape, [(32, 1)], seq_len=16, cache_path=path)
    assert len(calls) == 6 and other_seq.shape_key.endswith("seq=16")            # keyed by shape and seq
    calibration.calibrate_model(shape, [(32, 1)], method="gemm", cache_path=path)
    assert calls[-1][0] == "gemm"
    with pytest.raises(ValueError, match="method='x'"):
        calibration.calibrate_model(shape, [(32, 1)], method="x", cache_path=path)


def test_calibrate_model_ignores_a_corrupt_cache_or_entry_with_a_warning(tmp_path, monkeypatch, caplog):
    calls = _fake_probes(monkeypatch)
    shape = _shape()
    path = tmp_path / "calibration.json"
    kind = calibration.device_kind(torch.device("cpu"))
    key = calibration.shape_key(shape) + ",seq=8"
    zero_rate = {"fp32:tokens=32:tensor=1": 0.0, "bf16:tokens=32:tensor=1": 2e10}
    for content in ("{truncated", json.dumps({"version": 1, "entries": {kind: {"block": {key: {"fp32": "fast"}}}}}),
                    json.dumps({"version": 1, "entries": {kind: {"block": {key: [1, 2]}}}}),
                    json.dumps({"version": 1, "entries": {kind: {"block": {key: zero_rate}}}})):
        path.write_text(content)
        caplog.clear()
        before = len(calls)
        constants = calibration.calibrate_model(shape, [(32, 1)], seq_len=8, cache_path=str(path))
        assert len(calls) == before + 2 and constants.flops["fp32:tokens=32:tensor=1"] == 1e10
        assert str(path) in caplog.text and "unusable" in caplog.text
        assert json.loads(path.read_text())["entries"][kind]["block"][key]["fp32:tokens=32:tensor=1"] == 1e10


def test_shaped_constants_give_each_strategy_its_own_rates():
    shape = _shape()
    constants = calibration.ShapedConstants(
        "cpu:x", "k", {"fp32:tokens=32:tensor=1": 1e9, "bf16:tokens=32:tensor=1": 2e9,
                       "fp32:tokens=64:tensor=2": 4e9, "bf16:tokens=64:tensor=2": 8e9},
        comm_bytes_per_s=1e9, comm_latency_s=1e-4,
        layer_overhead_s={"fp32:tokens=32:tensor=1": 1e-3, "bf16:tokens=32:tensor=1": 2e-3})
    assert constants.profile_for(32, 1) == {"flops_fp32": 1e9, "flops_bf16": 2e9, "layer_overhead_s": 1e-3,
                                            "comm_bytes_per_s": 1e9, "comm_latency_s": 1e-4}
    assert constants.profile_for(32, 1, half=True)["layer_overhead_s"] == 2e-3
    assert constants.profile_for(60, 2)["flops_fp32"] == 4e9          # nearest probed point
    assert "layer_overhead_s" not in constants.profile_for(64, 2)
    data2 = Strategy([("parallel_mode", ([("data", 2)], None))])
    tensor2 = Strategy([("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"])
    assert calibration.strategy_workload(shape, data2, 8, 8, 2)[:2] == (32, 1)
    tokens, tensor, sizes, half = calibration.strategy_workload(shape, tensor2, 8, 8, 2)
    assert (tokens, tensor, half) == (64, 2, False) and sizes == [64 * 64 * 4]
    predict = cost_model_predictor(shape, 8, 8, 2, profile=constants)
    for s, (tok, ten) in ((data2, (32, 1)), (tensor2, (64, 2))):
        assert predict(s) == estimate(shape, s, 8, 8, 2, profile=constants.profile_for(tok, ten))


# -- one FLOP count, one workload, one cache cycle ------------------------------------------------

def _moe_shape():
    import transformers

    from atorch.auto.cost_model import ModelShape

    config = transformers.AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                               num_local_experts=8, num_experts_per_tok=2)
    return ModelShape.from_config(config)


def test_block_flops_count_what_the_probed_block_and_the_cost_model_compute():
    from atorch.auto.cost_model import StrategyTraits
    from atorch.auto.cost_model.step_time import DEVICE_PROFILES, time_breakdown

    tokens, seq = 256, 32
    for shape in (_moe_shape(), _shape()):
        flops = shape_probe.block_flops(shape, tokens, seq, 1)
        # The probed block multiplies the widths a token goes through (a top-2-of-8 MoE: two experts).
        block = shape_probe._ProbeBlock(shape, 1)
        matmul = sum(p.numel() for name, p in block.named_parameters() if not name.startswith("norm"))
        assert (flops - 12 * tokens * seq * shape.q_dim) / (6 * tokens) == pytest.approx(matmul, rel=0.02)
        # The cost model's compute at a rate of 1 FLOP/s: every block's count plus the LM head's.
        rates = {**DEVICE_PROFILES["cpu"], "flops_fp32": 1.0}
        traits = StrategyTraits.from_strategy(["parallel_mode"], 1, shape)
        compute = time_breakdown(shape, traits, tokens // seq, seq, rates)["compute"]
        assert compute == pytest.approx(shape.num_layers * flops + 6 * tokens * shape.embedding_params / 2)


def test_strategy_workload_probes_one_pass_of_the_cost_model():
    from atorch.auto.cost_model import StrategyTraits, micro_batch_size

    shape = _shape()
    pipeline = Strategy([("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), ("pipeline_parallel", {"chunks": 4})])
    accumulated = Strategy([("parallel_mode", ([("data", 2)], None)), ("gradient_accumulation", {"steps": 2})])
    for s, rows in ((pipeline, 2), (accumulated, 2), (Strategy(["amp_native"]), 4)):
        tokens = calibration.strategy_workload(shape, s, 8, 8, 2)[0]
        assert tokens == micro_batch_size(StrategyTraits.from_strategy(s, 2, shape), 8) * 8 == rows * 8, s


def test_collectives_run_on_the_device_their_backend_takes(monkeypatch):
    import torch.distributed as dist

    from atorch.auto.calibration.cache import probe_device
    from atorch.distributed import collective_device

    assert collective_device() == torch.device("cpu")               # no process group: nothing to place
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)           # nccl takes no CPU tensors
    assert probe_device(None, torch.device("cpu")) == torch.device("cuda", 3)
    assert probe_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")
    assert probe_device(None, torch.device("cpu")) == torch.device("cpu")
    assert probe_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)   # gloo takes CUDA too


def _two_fake_ranks(monkeypatch, other_rank_misses=True, backend="gloo"):
    """This process as rank 0 of 2 over `backend`; the other rank's cache misses everything (the MAX of
    the flags is 1) and its rates are 3x this one's (their averages 2x). Returns the devices each
    all-reduce saw. A CPU tensor on nccl raises as NCCL does."""
    import torch.distributed as dist

    seen = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
        seen.append(tensor.device)
        if backend == "nccl" and tensor.device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")
        if op == dist.ReduceOp.MAX:
            tensor.clamp_(min=1 if other_rank_misses else 0)
        else:
            tensor.mul_(4)                      # + the other rank's 3x: the rank-averaged rates (the probes'
                                                # own all-reduces, which would sum ones, are faked)

    for name, value in (("is_initialized", lambda: True), ("get_world_size", lambda group=None: 2),
                        ("get_rank", lambda group=None: 0), ("get_backend", lambda group=None: backend),
                        ("all_reduce", all_reduce), ("barrier", lambda group=None: None)):
        monkeypatch.setattr(dist, name, value)
    return seen


def test_both_probes_share_one_cache_cycle_across_ranks(tmp_path, monkeypatch):
    calls = _fake_probes(monkeypatch)
    monkeypatch.setattr(device_probe, "probe_matmul", lambda device, dtype, size=0, min_seconds=0.2:
                        1e10 if dtype is torch.float32 else 2e10)
    monkeypatch.setattr(device_probe, "time_all_reduce", lambda device, numel, group, repeats: 1e-4 + numel * 4e-9)
    monkeypatch.setattr(shape_probe, "time_all_reduce", lambda device, numel, group, repeats: 1e-4 + numel * 4e-9)
    path = str(tmp_path / "calibration.json")
    shape = _shape()
    # This rank has the points cached; the other rank does not: both measure, and average.
    calibration.calibrate_model(shape, [(32, 1)], seq_len=8, cache_path=path)
    calibrate_device(torch.device("cpu"), cache_path=path)
    seen = _two_fake_ranks(monkeypatch)
    before = len(calls)
    constants = calibration.calibrate_model(shape, [(32, 1)], [4096], seq_len=8, cache_path=path)
    assert len(calls) == before + 2 and constants.flops["fp32:tokens=32:tensor=1"] == 2e10     # (1 + 3) / 2
    assert constants.layer_overhead_s["fp32:tokens=32:tensor=1"] == pytest.approx(2e-3)
    assert constants.comm_bytes_per_s == pytest.approx(1e9, rel=1e-6)   # 1e-9 s per byte over 2 ranks
    device = calibrate_device(torch.device("cpu"), cache_path=path)
    assert (device.flops_fp32, device.comm_key) == (2e10, "gloo:2") and device.comm_latency_s > 0
    assert seen and all(d == torch.device("cpu") for d in seen)
    entry = json.load(open(path))["entries"][calibration.device_kind(torch.device("cpu"))]
    assert entry["compute"]["flops_fp32"] == 2e10 and "measured" in entry["compute"]   # rank 0 wrote it
    assert set(entry["allreduce"]["gloo:2"]) == {"4", "4096", str(1 << 20)} and "comm" in entry
    # Nobody misses anything: no probe, and only the vote crosses the ranks.
    seen = _two_fake_ranks(monkeypatch, other_rank_misses=False)
    before = len(calls)
    assert calibration.calibrate_model(shape, [(32, 1)], [4096], seq_len=8, cache_path=path) == constants
    assert len(calls) == before and len(seen) == 1


def test_on_nccl_the_vote_and_the_averages_never_send_cpu_tensors(tmp_path, monkeypatch):
    # init_distributed's default group is NCCL wherever CUDA exists; NCCL refuses CPU tensors.
    monkeypatch.setattr(device_probe, "probe_matmul", lambda device, dtype, size=0, min_seconds=0.2: 1e10)
    monkeypatch.setattr(device_probe, "time_all_reduce", lambda device, numel, group, repeats: 1e-4)
    _fake_probes(monkeypatch)
    seen = _two_fake_ranks(monkeypatch, backend="nccl")
    for calibrate in (lambda: calibrate_device(torch.device("cpu"), cache_path=str(tmp_path / "c.json")),
                      lambda: calibration.calibrate_model(_shape(), [(32, 1)], seq_len=8,
                                                          cache_path=str(tmp_path / "c.json"))):
        try:
            calibrate()
        except (AssertionError, RuntimeError) as e:      # without CUDA: making the CUDA tensor fails
            assert not torch.cuda.is_available() and "device type cpu" not in str(e), e
        assert all(d.type == "cuda" for d in seen), seen
