"""atorch.utils.metrics against hand-computed values."""

import math

import pytest
import torch

from atorch.testing import tiny_gpt2, tiny_llama
from atorch.utils.metrics import (
    DevicePeak,
    StepMetrics,
    ThroughputMeter,
    TransformerFlops,
    compute_step_metrics,
    device_peak,
    dtype_name,
    gpu_peak_tflops,
    matmul_parameter_count,
    parse_metrics_line,
    peak_memory_mb,
)

# tiny Llama (hidden 64, intermediate 128, 2 layers, vocab 1024, untied, no biases):
#   per layer: q,k,v,o 4*64*64 = 16384; gate,up,down 3*64*128 = 24576; 2 RMSNorms 2*64 = 128 -> 41088
#   2 layers 82176 + final norm 64 + lm_head 1024*64 = 65536 -> 147776; embed_tokens (65536) excluded.
TINY_LLAMA_N = 147776
TINY_LLAMA_BLOCK_N = 82176


def test_matmul_parameters_of_tiny_llama_exclude_the_embedding_only():
    model = tiny_llama()
    assert matmul_parameter_count(model) == TINY_LLAMA_N
    assert sum(p.numel() for p in model.parameters()) == TINY_LLAMA_N + 1024 * 64


def test_tied_lm_head_counts_once_and_position_embeddings_are_excluded():
    # tiny GPT-2: per layer ln_1 128, c_attn 64*192+192, attn c_proj 64*64+64, ln_2 128,
    # c_fc 64*128+128, mlp c_proj 128*64+64 = 33472; 2 layers 66944 + ln_f 128 + wte (tied LM head)
    # 65536 = 132608. wpe (256*64) is a lookup only.
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert matmul_parameter_count(model) == 132608


def test_frozen_parameters_are_not_trainable_matmul_parameters():
    model = tiny_llama()
    for name, p in model.named_parameters():
        p.requires_grad = "lm_head" in name
    assert matmul_parameter_count(model, trainable_only=True) == 1024 * 64


def test_flops_per_token_by_hand():
    # seq 64: 6N = 886656; attention 12 * 2 layers * 64 hidden * 64 tokens = 98304.
    flops = TransformerFlops(matmul_params=TINY_LLAMA_N, num_layers=2, hidden_size=64, seq_len=64)
    assert flops.attention_flops_per_token == 98304
    assert flops.model_flops_per_token == 6 * TINY_LLAMA_N + 98304 == 984960
    assert flops.hardware_flops_per_token == flops.model_flops_per_token  # nothing recomputed


def test_checkpointing_adds_one_forward_of_the_blocks_to_hardware_flops_only():
    flops = TransformerFlops.from_model(tiny_llama(), seq_len=64, checkpointing_enabled=True)
    assert (flops.recomputed_params, flops.recomputed_layers) == (TINY_LLAMA_BLOCK_N, 2)
    assert flops.model_flops_per_token == 984960
    # + 2 * 82176 (block forward) + 4 * 2 * 64 * 64 (attention forward) = 164352 + 32768
    assert flops.hardware_flops_per_token == 984960 + 197120


def test_frozen_weights_skip_their_weight_gradients():
    # 4N + 2 N_trainable + attention = 4000 + 200 + 12*2*8*16 (3072)
    flops = TransformerFlops(matmul_params=1000, num_layers=2, hidden_size=8, seq_len=16, trainable_matmul_params=100)
    assert flops.model_flops_per_token == 7272


@pytest.mark.parametrize("field,value,needle", [
    ("seq_len", 0, "seq_len=0 must be >= 1"),
    ("trainable_matmul_params", 2000, "trainable_matmul_params=2000 exceeds matmul_params=1000"),
    ("recomputed_layers", 3, "recomputed_layers=3 exceeds num_layers=2"),
    ("matmul_params", -1, "matmul_params=-1 must be >= 0"),
])
def test_invalid_flops_inputs_name_the_values(field, value, needle):
    kwargs = dict(matmul_params=1000, num_layers=2, hidden_size=8, seq_len=16)
    kwargs[field] = value
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        TransformerFlops(**kwargs).validate()


def test_step_metrics_by_hand():
    flops = TransformerFlops(matmul_params=TINY_LLAMA_N, num_layers=2, hidden_size=64, seq_len=64)
    # 10 steps in 5 s: 0.5 s/step; global batch 8 -> 16 samples/s -> 1024 tokens/s -> 512 per device (2).
    m = compute_step_metrics(step=20, loss=2.5, seconds=5.0, steps=10, global_batch_size=8, seq_len=64,
                             num_devices=2, flops=flops, peak=DevicePeak(0.01, "test"), peak_mem_mb=100.0)
    assert m.step_s == 0.5 and m.samples_s == 16.0 and m.tokens_s_per_device == 512.0
    assert m.tflops_model == pytest.approx(512 * 984960 / 1e12)
    assert m.mfu == pytest.approx(512 * 984960 / 1e12 / 0.01)
    assert m.hfu == m.mfu  # no recomputation


def test_unknown_peak_gives_nan_utilization_not_an_error():
    flops = TransformerFlops(matmul_params=10, num_layers=1, hidden_size=2, seq_len=4)
    m = compute_step_metrics(1, 1.0, 1.0, 1, 1, 4, 1, flops, DevicePeak(None, "unknown"), 0.0)
    assert math.isnan(m.mfu) and math.isnan(m.hfu) and m.tflops_model > 0


def test_metrics_line_round_trips():
    m = StepMetrics(step=20, loss=3.12345, step_s=0.21, samples_s=76.2, tokens_s_per_device=2438.4,
                    tflops_model=2.4e-3, tflops_hw=2.9e-3, mfu=0.11, hfu=0.13, peak_mem_mb=812.5)
    line = m.format()
    assert line.startswith("step=20 loss=3.1235 step_s=0.2100 samples_s=76.20 ")
    parsed = parse_metrics_line(f"[rank0] {line}")
    assert parsed["step"] == 20 and parsed["loss"] == 3.1235 and parsed["tflops_model"] == 2.4e-3
    assert parsed["peak_mem_mb"] == 812.5
    assert parse_metrics_line("step=20 loss=3.0") is None
    assert parse_metrics_line(line.replace("mfu=0.11", "mfu=oops")) is None
    nan_line = StepMetrics(1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, math.nan, math.nan, 1.0).format()
    assert math.isnan(parse_metrics_line(nan_line)["mfu"])


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H20", "bf16", 148.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA A10G", "bf16", None),      # not in the table: must not borrow A10's or A100's peak
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L4", "bf16", 121.0),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Some Future GPU", "bf16", None),
])
def test_gpu_peak_table_lookup(name, dtype, expected):
    assert gpu_peak_tflops(name, dtype) == expected


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bf16"
    assert dtype_name(None) == "fp32"
    assert dtype_name(None, tf32_enabled=True) == "tf32"
    with pytest.raises(ValueError, match="no peak-table entry"):
        dtype_name(torch.int8)


def test_cpu_peak_is_a_named_measured_probe_taken_once():
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.source.startswith("measured CPU matmul peak")
    assert 0 < peak.tflops < 100
    assert device_peak(torch.device("cpu"), "fp32").tflops == peak.tflops  # cached, not re-measured
    assert device_peak(torch.device("cpu"), "bf16", override_tflops=2.0) == DevicePeak(2.0, "user-given peak (bf16)")
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        device_peak(torch.device("cpu"), override_tflops=0.0)


def test_cpu_peak_memory_is_the_rss_high_water_mark():
    before, what = peak_memory_mb(torch.device("cpu"))
    assert what == "process RSS high-water mark" and before > 10
    block = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
    assert peak_memory_mb(torch.device("cpu"))[0] >= block.numel() * 4 / 2 ** 20
    del block


def test_throughput_meter_windows():
    clock = iter([100.0, 104.0, 105.0])
    flops = TransformerFlops(matmul_params=10, num_layers=1, hidden_size=2, seq_len=4)
    meter = ThroughputMeter(flops, global_batch_size=2, seq_len=4, num_devices=1, peak=DevicePeak(None, "x"),
                            device=torch.device("cpu"), clock=lambda: next(clock))
    with pytest.raises(RuntimeError, match="needs start"):
        meter.report(0, 0.0)
    meter.start()                        # t=100
    for _ in range(4):
        meter.step()
    first = meter.report(4, 1.0)         # t=104: 4 steps in 4 s; the next window starts at 104
    assert first.step_s == 1.0 and first.samples_s == 2.0
    meter.step()
    second = meter.report(5, 0.5)        # t=105: 1 step in 1 s
    assert second.step_s == 1.0 and second.step == 5


def test_paused_time_is_left_out_of_the_window():
    clock = iter([0.0, 2.0, 10.0, 12.0])
    flops = TransformerFlops(matmul_params=10, num_layers=1, hidden_size=2, seq_len=4)
    meter = ThroughputMeter(flops, 1, 4, 1, DevicePeak(None, "x"), torch.device("cpu"), clock=lambda: next(clock))
    meter.start()                        # t=0
    meter.step()
    meter.step()
    with meter.paused():                 # t=2 .. 10: a checkpoint save
        pass
    assert meter.report(2, 1.0).step_s == 2.0   # (12 - 0 - 8) s over 2 steps
