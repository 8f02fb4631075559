"""What the memory model counts, checked against what torch actually saves and allocates.

- A decoder block's saved tensors (saved_tensors_hooks on one block of a tiny Hugging Face
  model, with and without module_replace's fused GELU and RMSNorm) against `_block_saved_bytes`:
  the fused GELU keeps one b*s*ffn tensor where Hugging Face's Python GELU keeps four (GPT-2 XL
  with fsdp+amp was predicted 1.30x too high); F.rms_norm keeps its result in fp32 in half.
- torch's AdamW step temporaries (PeakMemoryTracker, real tensors) against `adam_step_bytes`,
  for plain tensors and FSDP2's DTensor shards (fake process group, 8 ranks, one process),
  foreach (CUDA's default) and per tensor (CPU's).
- The step's moments: FSDP2's per-block backward buffers never coexist with the loss's buffers.
"""

from typing import Set

import pytest
import torch
from torch import nn

from atorch.auto.cost_model import (
    PHASES,
    ModelShape,
    adam_step_bytes,
    estimate,
    peak_bytes,
    precision_mode,
    StrategyTraits,
)
from atorch.auto.cost_model.activations import _block_saved_bytes
from atorch.auto.opt_lib.module_replace import fuse
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.fake_distributed import fake_process_group
from atorch.utils.peak_memory import PeakMemoryTracker

SEQ = 40        # not a width of any weight: a saved weight cast is told apart by its shape


def _saved_bytes_per_token(block: nn.Module, run, weight_shapes: Set[tuple], inputs) -> float:
    """Bytes per token `block` saves for backward: each storage once; parameters, weight casts and the
    model-wide inputs (the rotary cos/sin every block shares) left out."""
    params = {p.untyped_storage().data_ptr() for p in list(block.parameters()) + list(inputs)}
    seen = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and tuple(t.shape) not in weight_shapes:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values()) / SEQ


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["fp32", "autocast", "half"])
@pytest.mark.parametrize("fused", [False, True])
def test_block_saved_bytes_match_the_saved_tensors(arch, mode, fused):
    model = (tiny_gpt2(n_layer=1, attn_implementation="sdpa") if arch == "gpt2"
             else tiny_llama(num_hidden_layers=1, attn_implementation="sdpa"))
    if fused:
        fuse(model, ["attention", "norm", "activation"])
    if mode == "half":
        model = model.to(torch.bfloat16)
    model.train()
    shape = ModelShape.from_module(model)
    dtype = torch.bfloat16 if mode == "half" else torch.float32
    x = torch.randn(1, SEQ, shape.hidden_size, dtype=dtype, requires_grad=True)
    block = model.transformer.h[0] if arch == "gpt2" else model.model.layers[0]

    rotary = () if arch == "gpt2" else model.model.rotary_emb(x, torch.arange(SEQ)[None])

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            if arch == "gpt2":
                block(x)
            else:
                block(x, position_embeddings=rotary)

    weight_shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.t().shape) for p in block.parameters()
                                                                     if p.dim() == 2}
    measured = _saved_bytes_per_token(block, run, weight_shapes, rotary)
    replicated, sharded = _block_saved_bytes(shape, mode, SEQ, True, fused_activation=fused, fused_norm=fused)
    # Left out by the model: sdpa's fp32 logsumexp (4 bytes a head) and the norms' fp32
    # statistics (at most 2 vectors of 4 bytes for each of 2 norms); 1% for anything else.
    slack = 4 * shape.num_heads + 16 + 0.01 * measured
    assert abs(measured - (replicated + sharded)) <= slack, (measured, replicated + sharded)


def test_module_replace_declares_what_it_fuses():
    shape = ModelShape.from_module(tiny_gpt2(n_layer=2))
    fused = StrategyTraits.from_strategy(["parallel_mode", "module_replace"], 1, shape)
    assert fused.fused_activation and fused.fused_norm and fused.fused_attention
    plain = StrategyTraits.from_strategy(["parallel_mode", ("module_replace", ["attention"])], 1, shape)
    assert plain.fused_attention and not plain.fused_activation and not plain.fused_norm
    # GPT-2 XL's width: the fused GELU's block is much smaller in half (five b*s*ffn tensors -> two).
    xl = ModelShape(1, 48, 1600, 6400, 25, 50257, 1, 1, gated=False, fused_attention=True)
    assert sum(_block_saved_bytes(xl, "half", 1024, True, fused_activation=True)) == pytest.approx(
        0.57 * sum(_block_saved_bytes(xl, "half", 1024, True)), rel=0.01)


def _adam_step_peak(params, foreach: bool) -> int:
    """Peak bytes allocated by the third AdamW step (state already allocated) over `params`."""
    optim = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    for step in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        if step < 2:
            optim.step()
            continue
        with PeakMemoryTracker(torch.device("cpu")) as tracker:
            optim.step()
    return tracker.peak_bytes


@pytest.mark.parametrize("foreach", [False, True])
def test_adam_step_temporaries_on_plain_tensors(foreach):
    params = [nn.Parameter(torch.zeros(256, 64)), nn.Parameter(torch.zeros(64, 64)), nn.Parameter(torch.zeros(64))]
    total, largest = sum(p.numel() for p in params), 256 * 64
    expected = adam_step_bytes(total, largest, 4, foreach=foreach)
    assert _adam_step_peak(params, foreach) == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("foreach", [False, True])
def test_adam_step_temporaries_on_fsdp2_shards(foreach):
    from torch.distributed.fsdp import fully_shard

    with fake_process_group(0, 8):
        model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 128, bias=False))
        fully_shard(model)
        params = list(model.parameters())
        local = [p.to_local().numel() for p in params]
        expected = adam_step_bytes(sum(local), max(local), 4, foreach=foreach)
        assert _adam_step_peak(params, foreach) == pytest.approx(expected, rel=0.02)


def test_forward_end_and_block_backward_are_different_moments():
    breakdown = {"params": 10.0, "optimizer": 20.0, "grads": 10.0, "activations": 100.0, "loss_softmax": 30.0,
                 "loss_buffers": 40.0, "gathered_params": 5.0, "prefetch": 2.0, "unit_grads": 25.0,
                 "held_root_grads": 6.0, "reduce_scatter": 60.0, "optimizer_step": 10.0}
    # always 30; forward end 100+30+40+5 = 175; backward start 100+5+2+25+6 = 138; end of backward
    # 10+5+2+25+6 = 48; after backward 10+60 = 70; step 10+10 = 20.
    assert peak_bytes(breakdown) == 30 + 175
    assert peak_bytes(dict(breakdown, loss_buffers=0.0)) == 30 + 138
    assert peak_bytes(dict(breakdown, activations=0.0, loss_softmax=0.0, loss_buffers=0.0)) == 30 + 70
    assert peak_bytes(dict(breakdown, optimizer_step=500.0)) == 30 + 510
    assert peak_bytes(dict(breakdown, optimizer_step=500.0), PHASES[:-1]) == 30 + 175


def test_the_optimizer_step_follows_the_device_default():
    shape = ModelShape.from_module(tiny_llama(num_hidden_layers=2))
    strategy = ["parallel_mode", "fsdp"]
    cuda = estimate(shape, strategy, 8, 32, 8, "cuda").breakdown
    cpu = estimate(shape, strategy, 8, 32, 8, "cpu").breakdown
    # foreach on CUDA: one fp32 copy of every local parameter; per tensor on CPU (DTensor shards):
    # 2 copies of the largest shard (the embedding's).
    assert cuda["mem_optimizer_step"] == pytest.approx(shape.num_params / 8 * 4)
    assert cpu["mem_optimizer_step"] == pytest.approx(2 * shape.vocab_size * shape.hidden_size / 8 * 4)
    assert precision_mode(StrategyTraits.from_strategy(strategy, 8, shape)) == "fp32"


def test_a_deepspeed_step_counts_the_users_optimizer_on_the_flat_partition():
    """Inside a ZeRO engine the user's AdamW steps one flat fp32 partition: per tensor (CPU) that is two
    copies of the whole partition (a ZeRO-2 bf16 step measured 4.9 MB above what was held, where only the
    fp32 gradient copy, 2.0 MB, was counted); foreach (CUDA) one; DeepSpeed's CPU Adam (offload) none."""
    shape = ModelShape.from_module(tiny_llama(num_hidden_layers=2))
    bf16 = ("amp_native", {"dtype": torch.bfloat16})
    for stage in ("zero1", "zero2", "fsdp"):
        strategy = ["parallel_mode", bf16, (stage, {"use_ds_zero": True})]
        partition = shape.num_params / 8 * 4
        cpu = estimate(shape, strategy, 8, 32, 8, "cpu").breakdown
        cuda = estimate(shape, strategy, 8, 32, 8, "cuda").breakdown
        assert cpu["mem_optimizer_step"] == pytest.approx(2 * partition), stage
        assert cuda["mem_optimizer_step"] == pytest.approx(partition), stage
    offload = ["parallel_mode", bf16, ("zero2", {"use_ds_zero": True, "ds_config": {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}})]
    assert estimate(shape, offload, 8, 32, 8, "cuda").breakdown.get("mem_optimizer_step", 0.0) == 0.0


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_training_forward_with_the_kv_cache_saves_what_the_model_counts(arch):
    layers = 2
    model = (tiny_gpt2(n_layer=layers, attn_implementation="sdpa") if arch == "gpt2"
             else tiny_llama(num_hidden_layers=layers, attn_implementation="sdpa"))
    model.train()
    ids = torch.randint(0, 100, (1, SEQ))

    def saved(use_cache: bool) -> float:
        return _saved_bytes_per_token(model, lambda: model(input_ids=ids, use_cache=use_cache), set(), ())

    shape = ModelShape.from_module(model)
    assert shape.kv_cache                   # Hugging Face's default: use_cache=True
    with_cache = sum(_block_saved_bytes(shape, "fp32", SEQ, True, kv_cache=True))
    without = sum(_block_saved_bytes(shape, "fp32", SEQ, True))
    # GPT-2: the cache's copies of k and v are saved on top (its q/k/v are views of one c_attn
    # output); Llama: the copies replace k and v, the same bytes.
    assert saved(True) - saved(False) == pytest.approx(layers * (with_cache - without))
    assert (with_cache > without) == (arch == "gpt2")
    # compile turns the cache off, and checkpointed blocks run without it.
    traits = StrategyTraits.from_strategy(["parallel_mode", "compile"], 1, shape)
    assert traits.kv_cache_off
