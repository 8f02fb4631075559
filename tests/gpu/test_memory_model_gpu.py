"""The cost model's CUDA memory paths against the CUDA allocator, on one GPU (skipped without CUDA).

On CPU the model is checked tensor by tensor (tests/distributed/test_memory_model.py) and at scale
under fake tensors (benchmarks/memory_model.py); what only a GPU shows is checked here: torch's
foreach AdamW (the CUDA default: one temporary the size of every parameter), SDPA's fused
kernels (no attention matrix saved), F.rms_norm's fused kernel, autocast's bf16 weight copies,
and the allocator's own rounding. A Llama large enough that the cuBLAS workspace (tens of MB)
is < 3% of the peak; two `train_step`s (the second with the optimizer state allocated), the
peak from `torch.cuda.max_memory_allocated` above what was allocated before the model moved.
Tolerance 15%: the issue's bound for the peak.
"""

import gc

import pytest
import torch

from atorch.auto import auto_accelerate, train_step
from atorch.auto.cost_model import estimate
from atorch.testing import tiny_llama

pytestmark = pytest.mark.gpu

PEAK_TOLERANCE = 0.15
BATCH, SEQ = 4, 512
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=SEQ)
STRATEGIES = {
    "plain fp32": [],
    "amp bf16": [("amp_native", {"dtype": torch.bfloat16})],
    "amp bf16 + checkpoint": [("amp_native", {"dtype": torch.bfloat16}), "checkpoint"],
    "module_replace + amp bf16": ["module_replace", ("amp_native", {"dtype": torch.bfloat16})],
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_predicted_peak_within_15_percent_of_the_cuda_allocator(name):
    strategy = STRATEGIES[name]
    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = tiny_llama(seed=0, **SHAPE)          # built on the host: only what auto_accelerate moves counts
    predicted = estimate(model, strategy, BATCH, SEQ, 1, "cuda")
    ok, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-4},
                                    load_strategy=strategy, ignore_dryrun_on_load_strategy=True)
    assert ok, name
    x = torch.randint(4, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(2):
        loss = train_step(result, {"input_ids": x, "labels": x})
        assert torch.isfinite(loss), name
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    ratio = predicted.peak_memory_bytes / measured
    print(f"| {name} | {measured / 2**20:.0f} MiB | {predicted.peak_memory_bytes / 2**20:.0f} MiB | {ratio:.3f} |")
    assert abs(ratio - 1) <= PEAK_TOLERANCE, (name, predicted.peak_memory_bytes, measured, ratio,
                                              {k: v for k, v in predicted.breakdown.items() if k.startswith("mem_")})
    del result, model, loss
