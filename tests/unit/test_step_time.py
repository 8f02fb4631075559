"""The step-time model's terms for pipelines, accumulation, CPU offload and multi-node links.

Each test holds a strategy fixed but for one dimension and checks the direction and size of the
change the formula is meant to give (`cost_model/step_time.py`); none of these terms existed
before (a pipeline was charged the whole model's FLOPs, accumulation and offload were free, every
collective of a multi-node job crossed the inter-node link).
"""

import math

import pytest

from atorch.auto.cost_model import estimate
from atorch.auto.devices import device_spec
from atorch.testing import tiny_llama_config
from transformers import LlamaConfig

CONFIG = tiny_llama_config(num_hidden_layers=8)
# A 7B-shaped Llama (32 layers, hidden 4096) for the GPU rates: transfers and FLOPs of a real size.
LLAMA_7B = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                       num_hidden_layers=32, vocab_size=32000, max_position_embeddings=4096)
H100 = device_spec("h100").profile(multi_node=False)


def _pp(size: int, chunks: int, data: int = 1):
    return [("parallel_mode", ([("data", data), ("pipeline", size)], None)), ("pipeline_parallel", {"chunks": chunks})]


def test_a_pipeline_stage_computes_its_layers_and_waits_out_the_bubble():
    one = estimate(CONFIG, ["parallel_mode"], 8, 64, 1, "cpu")
    for p, m in ((2, 4), (4, 4), (4, 8)):
        pipe = estimate(CONFIG, _pp(p, m), 8, 64, p, "cpu")
        bubble = (m + p - 1) / m
        # blocks split p ways, the LM head on the last stage: between 1/p and 1/p + head of the whole, x bubble
        ratio = pipe.breakdown["time_compute"] / one.breakdown["time_compute"] / bubble
        assert 1 / p < ratio < 1 / p + 0.5, (p, m, ratio)
        assert pipe.breakdown["time_communication"] > 0           # boundary activations and their gradients
    # More micro-batches shrink the bubble's share.
    assert estimate(CONFIG, _pp(4, 8), 8, 64, 4, "cpu").breakdown["time_compute"] < \
        estimate(CONFIG, _pp(4, 4), 8, 64, 4, "cpu").breakdown["time_compute"]


def test_gradient_accumulation_pays_per_micro_step_overhead_and_fsdp_gathers():
    base = ["parallel_mode", "fsdp"]
    plain = estimate(LLAMA_7B, base, 64, 4096, 8, "cuda", profile=H100)
    ga = estimate(LLAMA_7B, base + [("gradient_accumulation", 8)], 64, 4096, 8, "cuda", profile=H100)
    assert ga.breakdown["time_compute"] == pytest.approx(plain.breakdown["time_compute"])   # the same tokens
    layer_overhead = plain.breakdown["time_overhead"] - H100["step_overhead_s"]
    assert ga.breakdown["time_overhead"] - H100["step_overhead_s"] == pytest.approx(8 * layer_overhead)
    # 2 gathers and a reduce-scatter per micro-step (the default: gradients stay sharded): 24 transfers
    # where one step has 3; reduce-scattering once per step (sync_each_micro_step=False): 17.
    once = estimate(LLAMA_7B, base + [("gradient_accumulation", {"steps": 8, "sync_each_micro_step": False})], 64,
                    4096, 8, "cuda", profile=H100)
    bytes_plain = plain.breakdown["time_communication"] - 3 * 32 * H100["comm_latency_s"]
    bytes_ga = ga.breakdown["time_communication"] - 24 * 32 * H100["comm_latency_s"]
    bytes_once = once.breakdown["time_communication"] - 17 * 32 * H100["comm_latency_s"]
    assert bytes_ga == pytest.approx(8 * bytes_plain)
    assert bytes_once == pytest.approx(17 / 3 * bytes_plain)
    assert ga.step_time_s > once.step_time_s > plain.step_time_s
    # DDP reduces once per step (no_sync on the other micro-steps).
    ddp = estimate(LLAMA_7B, ["parallel_mode"], 64, 4096, 8, "cuda", profile=H100)
    ddp_ga = estimate(LLAMA_7B, ["parallel_mode", ("gradient_accumulation", 8)], 64, 4096, 8, "cuda", profile=H100)
    assert ddp_ga.breakdown["time_communication"] == pytest.approx(ddp.breakdown["time_communication"])


@pytest.mark.parametrize("offloaded, plain", [
    (("fsdp", {"cpu_offload": True}), "fsdp"),
    (("fsdp", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}),
     ("fsdp", {"use_ds_zero": True})),
    (("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}),
     ("zero2", {"use_ds_zero": True})),
])
def test_cpu_offload_costs_host_copies_and_a_host_optimizer_step_on_a_gpu(offloaded, plain):
    strategy = ["parallel_mode", "amp_native"]
    off = estimate(LLAMA_7B, strategy + [offloaded], 64, 4096, 8, "cuda", profile=H100)
    on = estimate(LLAMA_7B, strategy + [plain], 64, 4096, 8, "cuda", profile=H100)
    # At least the host optimizer's step over this rank's 1/8 of 6.7e9 trainable parameters at 1e9/s.
    assert off.step_time_s - on.step_time_s > 0.8 * 6.7e9 / 8 / 1e9
    assert off.peak_memory_bytes < on.peak_memory_bytes
    # On a CPU the host is the device: offload moves nothing.
    assert estimate(CONFIG, strategy + [offloaded], 8, 64, 2, "cpu").step_time_s == \
        pytest.approx(estimate(CONFIG, strategy + [plain], 8, 64, 2, "cpu").step_time_s)


def test_on_several_nodes_a_group_inside_one_node_uses_the_node_link():
    spec = device_spec("h100")
    tp8 = [("parallel_mode", ([("tensor", 8), ("data", 8)], None)), "tensor_parallel"]
    known = estimate(LLAMA_7B, tp8, 64, 4096, 64, "cuda", profile=spec.profile(True, ranks_per_node=8))
    unknown = estimate(LLAMA_7B, tp8, 64, 4096, 64, "cuda", profile=spec.profile(True))
    assert known.step_time_s < unknown.step_time_s
    # The tensor group's all-reduces at 450 GB/s, not 50: its share of the communication 9x smaller.
    ratio = spec.intra_node_bytes_per_s / spec.inter_node_bytes_per_s
    assert math.isclose(ratio, 9.0)
    assert unknown.breakdown["time_communication"] / known.breakdown["time_communication"] > 2
