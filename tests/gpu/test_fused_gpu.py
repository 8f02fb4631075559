"""GPU paths of checkpoint, module_replace and fp8 (skipped without CUDA by tests/conftest.py).

On CUDA the fused kernels are the real ones (flash/memory-efficient SDPA, fused RMSNorm),
activation memory is measured by the allocator, and fp8 either trains or, on a GPU or
environment that cannot, raises the documented error: never skipped silently.
"""

import copy
import importlib.util

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, get_optimization
from atorch.modules.fused import FusedRMSNorm
from atorch.testing import tiny_gpt2, tiny_llama

DEVICE = torch.device("cuda")


def _apply(name, model, raw=None):
    opt = get_optimization(name)()
    config = opt.parse_config(raw)
    opt.validate(config, ValidationContext(world_size=1, model=model, device_type="cuda"))
    ctx = ModelContext(model=model, device=DEVICE)
    opt.apply(ctx, config)
    return ctx


def _batch(batch=4, seq=128):
    x = torch.randint(4, 1024, (batch, seq), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return {"input_ids": x, "labels": x}


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_module_replace_bf16_logits_and_grads(make):
    reference = make(seed=0).to(DEVICE, torch.bfloat16)
    fused = copy.deepcopy(reference)
    _apply("module_replace", fused)
    batch = _batch()
    ref_out, out = reference(**batch), fused(**batch)
    # bf16 has 8 significant bits; fused kernels round at different points (a few ulps).
    torch.testing.assert_close(out.logits.float(), ref_out.logits.float(), rtol=2e-2, atol=2e-2)
    ref_out.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), fused.parameters()):
        scale = p.grad.float().abs().max().item()
        assert (q.grad.float() - p.grad.float()).abs().max().item() <= 5e-2 * scale + 1e-6, name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_fused_rms_norm_cuda(dtype, tol):
    ref = LlamaRMSNorm(256).to(DEVICE, dtype)
    torch.nn.init.normal_(ref.weight)
    fused = FusedRMSNorm.from_module(ref)
    x = torch.randn(8, 128, 256, device=DEVICE, dtype=dtype)
    expected, actual = ref(x).float(), fused(x).float()
    assert (actual - expected).abs().max().item() <= tol * expected.abs().max().item()


def test_checkpoint_lowers_peak_memory_with_identical_gradients():
    plain = tiny_llama(seed=0, num_hidden_layers=4).to(DEVICE)
    ckpt = copy.deepcopy(plain)
    _apply("checkpoint", ckpt)
    batch = _batch(batch=8, seq=256)
    peaks, losses = [], []
    for model in (plain, ckpt):
        model.train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(**batch).loss
        peaks.append(torch.cuda.max_memory_allocated() - base)
        loss.backward()
        losses.append(loss.detach())
    assert peaks[1] < 0.7 * peaks[0], f"forward peak with checkpointing {peaks[1]} vs {peaks[0]} without"
    # The forward pass is the same computation: the same loss bit for bit. Gradients flow through
    # recomputed activations, and CUDA kernels need not be bitwise deterministic: fp32 rounding.
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fp8_trains_or_raises_the_documented_error():
    model = tiny_llama(seed=0).to(DEVICE)
    opt = get_optimization("fp8")()
    config = opt.parse_config(None)
    context = ValidationContext(world_size=1, model=model, device_type="cuda")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        with pytest.raises(ValueError, match=rf"has compute capability {capability[0]}\.{capability[1]}"):
            opt.validate(config, context)
        return
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ValueError, match="torchao is not installed"):
            opt.validate(config, context)
        return
    reference = copy.deepcopy(model)
    opt.validate(config, context)
    ctx = ModelContext(model=model, device=DEVICE)
    opt.apply(ctx, config)
    # Every linear of the blocks (7 per layer, 2 layers); lm_head stays in high precision.
    assert ctx.summaries["fp8"]["converted"] == 14
    batch = _batch(batch=2, seq=64)
    losses = {}
    for key, m in (("bf16", reference), ("fp8", model)):
        optim = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[key] = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(**batch).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[key].append(loss.item())
    # e4m3 keeps 3 mantissa bits: a few percent per matmul, far less on the loss of a tiny model.
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert abs(a - b) <= 5e-2 * abs(b), losses
