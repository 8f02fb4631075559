"""The cost model's formulas, and its memory prediction against measured peaks (single process).

Measured peaks come from `PeakMemoryTracker` (exact tensor-storage accounting on CPU) on a
training loop shaped like `atorch.auto.train_step` (the output is dropped before backward).
The activation model is counted from the blocks' saved tensors, not fitted to these runs.
The 15% tolerance is the issue's; the sharded strategies are checked on 2 ranks in
tests/distributed/test_dry_run.py.
"""

import copy
import dataclasses

import pytest
import torch

from atorch.auto.cost_model import (
    ModelShape,
    StrategyTraits,
    estimate,
    memory_breakdown,
    micro_batch_size,
    model_state_bytes,
    peak_bytes,
    resident_bytes,
)
from atorch.testing import tiny_gpt2, tiny_gpt2_config, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, global_batches
from atorch.utils.peak_memory import PeakMemoryTracker, SimulatedOutOfMemoryError, is_out_of_memory

TOLERANCE = 0.15
# Single-process peaks: activations are counted tensor by tensor (not fitted), so the prediction
# is within 2.5% of the measured bytes on every configuration here; 10% leaves room for small
# saved tensors (masks, rsqrt vectors, indices) the model leaves out.
PEAK_TOLERANCE = 0.10


def test_model_shape_matches_module_parameter_counts():
    for build, config in ((tiny_llama, tiny_llama_config), (tiny_gpt2, tiny_gpt2_config)):
        for layers in (2, 4):
            kw = {"num_hidden_layers": layers} if build is tiny_llama else {"n_layer": layers}
            model = build(**kw)
            real = sum(p.numel() for p in model.parameters())
            from_config = ModelShape.from_config(config(**({"num_hidden_layers": layers} if build is tiny_llama
                                                           else {"n_layer": layers})))
            from_module = ModelShape.from_module(model)
            assert from_config.num_params == real == from_module.num_params
            assert from_module.num_layers == layers and from_module.hidden_size == 64
            assert from_module.layer_params * layers + from_module.embedding_params <= real
    # A plain module (no config): widths from its linears, layers from its ModuleList.
    plain = torch.nn.Sequential(torch.nn.Embedding(100, 16),
                                torch.nn.ModuleList([torch.nn.Linear(16, 32) for _ in range(3)]))
    shape = ModelShape.from_module(plain)
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (3, 16, 100)


def _breakdown(strategy, world_size=4, batch=8, seq=64):
    model = tiny_llama(num_hidden_layers=6)   # more blocks than the root unit holds: FSDP's gathering shows
    shape = ModelShape.from_module(model)
    traits = StrategyTraits.from_strategy(strategy, world_size, shape)
    return shape, traits, memory_breakdown(shape, traits, batch // traits.data, seq)


def test_zero_and_fsdp_memory_formulas():
    shape, _, plain = _breakdown(["parallel_mode"])
    P = shape.num_params
    assert plain["params"] == plain["grads"] == 4 * P and plain["optimizer"] == 8 * P
    assert plain["ddp_buckets"] == 4 * P                       # DDP's flat gradient copy (data > 1)
    _, _, single = _breakdown(["parallel_mode"], world_size=1)
    assert "ddp_buckets" not in single
    _, _, z1 = _breakdown(["parallel_mode", "zero1"])          # Adam state / 4, still under DDP
    assert z1["optimizer"] == 2 * P and z1["grads"] == 4 * P and z1["ddp_buckets"] == 4 * P
    _, _, z2 = _breakdown(["parallel_mode", "zero2"])          # FSDP2 without reshard
    assert z2["optimizer"] == 2 * P and z2["grads"] == P and z2["params"] == P
    # every unit gathered from forward to backward; backward reshards the blocks one by one
    assert z2["gathered_params"] + z2["gathered_blocks"] == 4 * P and "ddp_buckets" not in z2
    assert 0 < z2["gathered_params"] < z2["gathered_blocks"]
    _, _, fs = _breakdown(["parallel_mode", "fsdp"])           # resharded after forward
    assert fs["optimizer"] == 2 * P and fs["grads"] == P and fs["params"] == P
    assert fs["gathered_params"] == z2["gathered_params"] and "gathered_blocks" not in fs
    # the root unit reduces last: its shards are not there while the blocks run backward
    assert 0 < fs["backward_grads"] < fs["grads"] and 0 < z2["backward_grads"] < z2["grads"]
    assert plain["backward_grads"] == plain["grads"]
    _, _, ds2 = _breakdown(["parallel_mode", ("zero2", {"use_ds_zero": True})])   # textbook ZeRO-2
    assert ds2["grads"] == P and ds2["params"] == 4 * P and "gathered_params" not in ds2
    _, _, half = _breakdown(["parallel_mode", "half"])
    assert half["params"] == 2 * P and half["optimizer"] == 4 * P


def test_activation_terms_follow_the_strategy():
    act = {name: _breakdown(s)[2]["activations"] for name, s in {
        "plain": ["parallel_mode"], "ckpt": ["parallel_mode", "checkpoint"], "amp": ["parallel_mode", "amp_native"],
        "replace": ["parallel_mode", "module_replace"],
        "tp": [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel"]}.items()}
    assert act["ckpt"] < act["plain"] and act["replace"] < act["plain"] and act["amp"] < act["plain"]
    # tensor=2 x data=2: twice the micro-batch of data=4; q/k/v, attention and MLP tensors are split
    # over the 2 tensor ranks, the residual stream, the norms and the column-parallel inputs are not.
    assert act["plain"] < act["tp"] < 2 * act["plain"]
    # The micro-batch is the global batch over the data ranks.
    assert _breakdown(["parallel_mode"], world_size=2)[2]["activations"] == pytest.approx(2 * act["plain"])


def test_loss_buffers_and_tensor_parallel_logits():
    shape, traits, plain = _breakdown(["parallel_mode"])
    tokens, v = 2 * 64, shape.vocab_size
    # Hugging Face's loss: the fp32 log-softmax is saved; its backward holds two more fp32 copies.
    assert plain["loss_buffers"] == 8 * tokens * v
    tp = [("parallel_mode", ([("tensor", 2), ("data", 2)], None))]
    _, _, full = _breakdown(tp + ["tensor_parallel"])
    _, _, local = _breakdown(tp + [("tensor_parallel", {"gather_logits": False})])
    # Full logits (the default): the local slice, the gathered list and the concatenation, fp32,
    # for the doubled micro-batch (data=2); without the gather only the vocabulary-parallel loss's buffers.
    assert full["loss_buffers"] == pytest.approx(2 * tokens * v * 4 * 2.5)
    assert local["loss_buffers"] == pytest.approx(2 * tokens * v / 2 * 8)
    assert full["activations"] == local["activations"]
    # Under autocast: exact half copies of the matmul weights (blocks and head, not the lookup table).
    _, _, amp = _breakdown(["parallel_mode", "amp_native"])
    assert amp["weight_casts"] == 2 * (shape.num_params - shape.vocab_size * shape.hidden_size)


def test_step_time_model():
    model = tiny_llama(num_hidden_layers=4)

    def t(strategy, world_size=2, **kw):
        return estimate(model, strategy, 8, 64, world_size, "cpu", **kw)

    single = t(["parallel_mode"], world_size=1)
    assert single.breakdown["time_communication"] == 0
    ddp, fsdp = t(["parallel_mode"]), t(["parallel_mode", "fsdp"])
    assert 0 < ddp.breakdown["time_communication"] < fsdp.breakdown["time_communication"]
    assert ddp.breakdown["time_compute"] == pytest.approx(single.breakdown["time_compute"] / 2)
    assert t(["parallel_mode", "checkpoint"]).step_time_s > ddp.step_time_s
    tp = t([("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"])
    assert tp.breakdown["time_communication"] > 0
    assert estimate(tiny_llama(num_hidden_layers=2), ["parallel_mode"], 8, 64, 1, "cpu").step_time_s \
        < single.step_time_s
    fast = t(["parallel_mode"], profile={"flops_fp32": 1e15})
    assert fast.breakdown["time_compute"] < ddp.breakdown["time_compute"]
    assert ddp.throughput(8) == pytest.approx(8 / ddp.step_time_s)
    assert estimate(model, ["parallel_mode"], 8, 64, 1, "cuda").step_time_s < single.step_time_s


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="batch_size=0"):
        estimate(tiny_llama(), ["parallel_mode"], 0, 64, 1)
    with pytest.raises(ValueError, match="none of"):
        ModelShape.from_config(object())


def _measured_peak(model, batch, seq, checkpoint=False, amp=False, steps=2):
    """Peak tensor bytes of `steps` AdamW steps shaped like train_step (the output is dropped before backward)."""
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    batches = global_batches(TokenDataset(n=batch * steps, seq_len=seq, vocab_size=vocab), batch, steps)
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        m = copy.deepcopy(model)
        optim = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for b in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = m(**b).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            del loss
    return tracker.peak_bytes


@pytest.mark.parametrize("build,batch,seq", [
    (lambda: tiny_llama(), 4, 96), (lambda: tiny_gpt2(n_layer=3), 6, 48),
    (lambda: tiny_llama(num_hidden_layers=3, vocab_size=512), 12, 40),
    # Qwen2/Mistral-like: grouped-query attention under sdpa, a tied head, a wider MLP.
    (lambda: tiny_llama(num_hidden_layers=3, num_key_value_heads=1, intermediate_size=256, tie_word_embeddings=True,
                        attn_implementation="sdpa"), 6, 80),
    (lambda: tiny_gpt2(n_layer=2, attn_implementation="sdpa", vocab_size=2048), 4, 64)])
@pytest.mark.parametrize("variant", ["plain", "checkpoint", "amp"])
def test_memory_prediction_within_15_percent_of_measured(build, batch, seq, variant):
    model = build()
    strategy = ["parallel_mode"] + {"plain": [], "checkpoint": ["checkpoint"], "amp": ["amp_native"]}[variant]
    measured = _measured_peak(model, batch, seq, checkpoint=variant == "checkpoint", amp=variant == "amp")
    predicted = estimate(model, strategy, batch, seq, 1, "cpu").peak_memory_bytes
    assert abs(predicted - measured) <= PEAK_TOLERANCE * measured, (predicted, measured, predicted / measured)


# -- the CPU peak-memory tracker ------------------------------------------------------------------

def test_peak_memory_tracker_counts_storages_exactly():
    cpu = torch.device("cpu")
    with PeakMemoryTracker(cpu) as tracker:
        a = torch.empty(1000, dtype=torch.float32)      # 4000 B
        view = a[10:20].view(2, 5)                      # a view: no new storage
        b = torch.ones(500, dtype=torch.float64)        # 4000 B
        del a, view
        c = torch.zeros(250, dtype=torch.float32)       # 1000 B, after a was freed
        assert tracker.current_peak_bytes == 8000
    assert tracker.peak_bytes == 8000
    del b, c
    before = torch.empty(10**6)                         # existed before: not counted
    with PeakMemoryTracker(cpu) as again:
        _ = before + 1                                  # 4 MB new
    assert again.peak_bytes == 4 * 10**6


def test_peak_memory_tracker_sees_storages_resized_in_place():
    # FSDP2 frees gathered parameters with storage.resize_(0) and re-allocates with resize_(n),
    # which bypasses the dispatcher on CPU.
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        a = torch.empty(1000)                           # 4000 B
        a.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0
        a.untyped_storage().resize_(8000)
        assert tracker.live_bytes == 8000
        a.untyped_storage().resize_(0)
        b = torch.empty(500)                            # 2000 B while a holds nothing
        assert tracker.live_bytes == 2000
        del a
        assert tracker.live_bytes == 2000
    assert tracker.peak_bytes == 8000
    del b


def test_simulated_memory_limit_raises_out_of_memory():
    with pytest.raises(torch.OutOfMemoryError, match="simulated device memory limit") as info:
        with PeakMemoryTracker(torch.device("cpu"), memory_limit_bytes=10_000):
            keep = [torch.empty(1000) for _ in range(2)]    # 8000 B: fits
            keep.append(torch.empty(1000))                  # 12000 B: over
    assert isinstance(info.value, SimulatedOutOfMemoryError) and is_out_of_memory(info.value)
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"))
    assert not is_out_of_memory(ValueError("out of memory"))


# -- the ZeRO paper's Figure 1, and the backends the formulas distinguish ----------------------------

GB = 1e9
# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2020),
# Figure 1: per-device model states for Psi = 7.5B parameters on N_d = 64 devices, K = 12
# (fp32 master weights + Adam moments), mixed precision. Baseline, P_os, P_os+g, P_os+g+p.
PAPER_FIGURE_1 = {"baseline": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
PSI, N_D = 7_500_000_000, 64


def _psi_7_5b() -> ModelShape:
    h, vocab, layers = 4096, 32000, 32
    embedding = 2 * vocab * h
    return ModelShape(PSI, layers, h, 11008, 32, vocab, (PSI - embedding) // layers, embedding)


def _model_states(strategy, world_size=N_D, shape=None, device="cuda", batch=64):
    e = estimate(shape or _psi_7_5b(), strategy, batch, 1024 if shape is None else 64, world_size, device)
    return {k[len("mem_"):]: v for k, v in e.breakdown.items() if k.startswith("mem_")}, e


def test_zero_paper_figure_1_for_deepspeed_bf16():
    ds = {stage: model_state_bytes(_model_states(["amp_native", (name, {"use_ds_zero": True})])[0]) / GB
          for stage, name in (("zero1", "zero1"), ("zero2", "zero2"), ("zero3", "fsdp"))}
    baseline = model_state_bytes(_model_states(["parallel_mode", "amp_native"])[0]) / GB
    assert baseline == pytest.approx(PAPER_FIGURE_1["baseline"], rel=0.15)
    assert ds["zero2"] == pytest.approx(PAPER_FIGURE_1["zero2"], rel=0.15)
    assert ds["zero3"] == pytest.approx(PAPER_FIGURE_1["zero3"], rel=0.15)
    # DeepSpeed's stage-1 optimizer keeps only its partition's gradients (it copies each reduced
    # bucket's slice into one partition buffer; tests/distributed/test_memory_model.py measures
    # stage 1 == stage 2), so it holds P_os+g, not the paper's P_os with whole fp16 gradients.
    assert ds["zero1"] == pytest.approx(PAPER_FIGURE_1["zero2"], rel=0.15)
    whole_fp16_grads = 2 * PSI * (1 - 1 / N_D) / GB
    assert ds["zero1"] + whole_fp16_grads == pytest.approx(PAPER_FIGURE_1["zero1"], rel=0.15)


def test_deepspeed_holds_a_half_module_and_fp32_master_partitions():
    states, e = _model_states(["amp_native", ("zero2", {"use_ds_zero": True})])
    assert states["params"] == 2 * PSI                      # bf16 module, whole
    assert states["master"] == pytest.approx(4 * PSI / N_D) and states["optimizer"] == pytest.approx(8 * PSI / N_D)
    assert "weight_casts" not in states                      # no autocast: the module already is bf16
    assert states["ds_reduce_bucket"] == 2 * 500_000_000    # DeepSpeed's default reduce bucket, in bf16
    z3, _ = _model_states(["amp_native", ("fsdp", {"use_ds_zero": True})])
    # ZeRO-3 upcasts the gradient partition for the step only (measured: not alive after backward).
    assert z3["params"] == pytest.approx(2 * PSI / N_D) and z3["step_grad_fp32"] == pytest.approx(4 * PSI / N_D)
    assert "grad_fp32" not in z3
    fp32, _ = _model_states([("zero2", {"use_ds_zero": True})])
    assert fp32["params"] == 4 * PSI and "grad_fp32" not in fp32 and "step_grad_fp32" not in fp32
    assert e.peak_memory_bytes > resident_bytes(states)


def test_fsdp2_mixed_precision_and_cpu_offload():
    on_gpu, e_gpu = _model_states(["parallel_mode", "amp_native", ("fsdp", {"cpu_offload": True})])
    on_cpu, e_cpu = _model_states(["parallel_mode", "amp_native", ("fsdp", {"cpu_offload": True})], device="cpu")
    # Offloaded shards live in host memory: not in a GPU's peak; on a CPU run the host is the device.
    assert {"host_params", "host_grads", "host_optimizer"} <= set(on_gpu) and "params" not in on_gpu
    assert on_gpu["host_grads"] == pytest.approx(4 * PSI / N_D)          # reduce_dtype fp32
    assert on_gpu["gathered_params"] == on_cpu["gathered_params"]          # gathered in bf16 on the device
    assert e_gpu.peak_memory_bytes < e_cpu.peak_memory_bytes
    assert e_cpu.peak_memory_bytes == pytest.approx(peak_bytes(on_cpu))


def test_lora_trains_adapters_only():
    shape = ModelShape.from_module(tiny_llama(num_hidden_layers=4))
    full, _ = _model_states(["parallel_mode"], world_size=2, shape=shape, device="cpu")
    lora, _ = _model_states(["parallel_mode", ("lora", {"r": 4})], world_size=2, shape=shape, device="cpu")
    adapters = 4 * 4 * (64 + 64 + 64 + 64)       # r x (in + out) for q_proj and v_proj in each of 4 layers
    assert lora["params"] == pytest.approx(full["params"] + 4 * adapters)
    assert lora["grads"] == pytest.approx(4 * adapters) and lora["optimizer"] == pytest.approx(8 * adapters)
    assert lora["ddp_buckets"] == pytest.approx(4 * adapters)


def test_pipeline_stages_and_micro_batches():
    shape = ModelShape.from_module(tiny_llama(num_hidden_layers=4))
    whole, _ = _model_states(["parallel_mode"], world_size=1, shape=shape, device="cpu")
    pp = [("parallel_mode", ([("data", 1), ("pipeline", 2)], None))]
    gpipe, _ = _model_states(pp + [("pipeline_parallel", {"chunks": 4})], world_size=2, shape=shape, device="cpu")
    one_f_one_b, _ = _model_states(pp + [("pipeline_parallel", {"chunks": 4, "schedule": "1f1b"})], world_size=2,
                                   shape=shape, device="cpu")
    assert whole["params"] / 2 <= gpipe["params"] < whole["params"] and "ddp_buckets" not in gpipe
    # GPipe: 4 micro-batches in flight on every stage. 1F1B: 2 on the first stage, but the last stage runs
    # each backward right after its forward, so its logits and loss count once (counting them twice put
    # 1F1B 1.22-1.39x over measured peaks where activations dominate).
    from atorch.auto.cost_model.activations import last_stage_bytes
    from atorch.auto.cost_model.traits import StrategyTraits

    one = gpipe["activations"] / 4
    traits = StrategyTraits.from_strategy(pp + [("pipeline_parallel", {"chunks": 4, "schedule": "1f1b"})], 2, shape)
    tail = last_stage_bytes(shape, traits, 64 // 4, 64)
    assert 0 < tail < one
    assert one_f_one_b["activations"] == pytest.approx(max(2 * (one - tail), one))
    assert one_f_one_b["activations"] < gpipe["activations"] / 2
    assert gpipe["activations"] < whole["activations"]


def test_gradient_accumulation_shrinks_the_micro_batch(monkeypatch):
    from atorch.auto.opt_lib.amp_native import AmpNativeOptimization

    shape = ModelShape.from_module(tiny_llama())
    plain = StrategyTraits.from_strategy(["parallel_mode"], 2, shape)
    assert micro_batch_size(plain, 16) == 8
    # An optimization declaring accumulation steps (as `gradient_accumulation` does) divides it further.
    monkeypatch.setattr(AmpNativeOptimization, "cost_traits", classmethod(lambda cls, config, context:
                                                                          {"accumulation_steps": 4}))
    traits = StrategyTraits.from_strategy(["parallel_mode", "amp_native"], 2, shape)
    assert micro_batch_size(traits, 16) == 2
    monkeypatch.setattr(AmpNativeOptimization, "cost_traits", classmethod(lambda cls, config, context: {"nope": 1}))
    with pytest.raises(ValueError, match=r"amp_native.cost_traits declares unknown trait\(s\) \['nope'\]"):
        StrategyTraits.from_strategy(["parallel_mode", "amp_native"], 2, shape)


def test_every_registered_optimization_declares_its_cost_traits():
    from atorch.auto.opt_lib.base import CostContext, Optimization, get_optimization, registered_names

    context = CostContext(world_size=4, dims={"tensor": 2, "data": 1, "pipeline": 2})
    valid = {f.name for f in dataclasses.fields(StrategyTraits)}
    for name in registered_names():
        cls = get_optimization(name)
        assert cls.cost_traits.__func__ is not Optimization.cost_traits.__func__, \
            f"{name} does not declare cost_traits (return {{}} to declare no effect on memory or time)"
        # A config of its own where the default is not valid alone (gradient_accumulation needs its steps).
        raw = {"gradient_accumulation": {"steps": 2}}.get(name)
        declared = cls.cost_traits(cls.parse_config(raw), context)
        assert set(declared) <= valid, (name, declared)
    # Unknown names in a strategy declare nothing (the cost model ignores them).
    assert StrategyTraits.from_strategy(["parallel_mode", "not_an_optimization"], 2, _psi_7_5b()).data == 2


def test_a_strategy_is_estimated_as_resolve_strategy_completes_it():
    # auto_accelerate adds parallel_mode (and ddp where nothing else reduces gradients) to a strategy
    # without one; the estimate must count what it builds (DDP's gradient buckets among them).
    from atorch.auto.opt_lib.base import ValidationContext
    from atorch.auto.opt_lib.resolve import resolve_strategy
    from atorch.auto.strategy import Strategy

    config = tiny_llama_config(num_hidden_layers=2)
    for bare, world in ((["amp_native"], 2), (["checkpoint"], 4), (["fsdp"], 2), (["amp_native"], 1)):
        resolved = resolve_strategy(Strategy(bare), ValidationContext(world_size=world))
        completed = Strategy(r.item for r in resolved)
        assert completed.get("parallel_mode") is not None
        got = estimate(config, bare, batch_size=8, seq_len=16, world_size=world)
        assert got == estimate(config, completed, batch_size=8, seq_len=16, world_size=world), (bare, world)
        if world > 1 and bare != ["fsdp"]:
            assert got.breakdown["mem_ddp_buckets"] > 0
