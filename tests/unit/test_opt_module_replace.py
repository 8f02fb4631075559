"""`module_replace`: fused attention / RMSNorm / GELU give the same logits and gradients, same state dict."""

import copy
import logging

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, get_optimization
from atorch.auto.opt_lib.module_replace import ModuleReplaceConfig, replace_modules
from atorch.modules.fused import FusedRMSNorm, is_llama_style_rms_norm
from atorch.testing import tiny_gpt2, tiny_llama


def _apply(model, raw=None):
    opt = get_optimization("module_replace")()
    config = opt.parse_config(raw)
    opt.validate(config, ValidationContext(world_size=1, model=model))
    ctx = ModelContext(model=model)
    opt.apply(ctx, config)
    return ctx


def _assert_close_relative(actual, expected, rel, what):
    """|a - e| <= rel * max|e|: gradients of different parameters differ in scale by orders of magnitude."""
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max abs error {err} vs rel {rel} of scale {scale}"


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_same_logits_and_gradients(make):
    reference = make(seed=0)
    fused = copy.deepcopy(reference)
    keys = list(fused.state_dict())
    _apply(fused)
    assert list(fused.state_dict()) == keys
    x = torch.randint(4, 1024, (3, 32), generator=torch.Generator().manual_seed(0))
    reference.train()
    fused.train()
    ref_out = reference(input_ids=x, labels=x)
    out = fused(input_ids=x, labels=x)
    # fp32: the fused kernels reorder the same arithmetic (measured max diff 2.4e-7).
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    ref_out.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), fused.parameters()):
        _assert_close_relative(q.grad, p.grad, 1e-5, name)


def test_llama_replacements_keep_parameters():
    model = tiny_llama(seed=0)
    final_norm_weight = model.model.norm.weight
    ctx = _apply(model)
    # 2 layers x (input, post-attention) + the final norm.
    assert ctx.summaries["module_replace"].counts() == {"attention": 1, "norm": 5, "activation": 0, "mlp": 0}
    assert model.config._attn_implementation == "sdpa"
    assert isinstance(model.model.norm, FusedRMSNorm)
    assert model.model.norm.weight is final_norm_weight, "the same Parameter object, not a copy"
    assert not any(isinstance(m, LlamaRMSNorm) for m in model.modules())


def test_gpt2_replacements():
    model = tiny_gpt2(seed=0)
    ctx = _apply(model)
    assert ctx.summaries["module_replace"].counts() == {"attention": 1, "norm": 0, "activation": 2, "mlp": 0}
    assert model.config._attn_implementation == "sdpa"
    acts = [m for m in model.modules() if isinstance(m, nn.GELU)]
    assert len(acts) == 2 and all(a.approximate == "tanh" for a in acts)


def test_config_selects_kinds():
    only_norm = tiny_llama()
    assert _apply(only_norm, ["norm"]).summaries["module_replace"].counts() == {"attention": 0, "norm": 5, "activation": 0,
                                                                      "mlp": 0}
    assert only_norm.config._attn_implementation == "eager"
    no_attention = tiny_llama()
    assert _apply(no_attention, {"attention": False}).summaries["module_replace"].counts()["attention"] == 0
    with pytest.raises(ValueError, match=r"unknown replacement kind\(s\) \['flash'\]; valid kinds are "
                                         r"\['attention', 'norm', 'activation', 'mlp'\]"):
        _apply(tiny_llama(), ["flash"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['rmsnorm'\]; valid keys are "
                                         r"\['attention', 'norm', 'activation', 'mlp', 'classes'\]"):
        _apply(tiny_llama(), {"rmsnorm": True})
    with pytest.raises(ValueError, match="enables no replacement"):
        _apply(tiny_llama(), [])


def test_nothing_to_replace_names_the_model():
    with pytest.raises(ValueError, match=r"nothing to replace in Sequential"):
        _apply(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    # GPT-2 has no RMSNorm: asking for norms only finds nothing.
    with pytest.raises(ValueError, match=r"nothing to replace in GPT2LMHeadModel for kinds \['norm'\]"):
        _apply(tiny_gpt2(), ["norm"])


def test_already_fused_attention_is_logged_not_an_error(caplog):
    model = tiny_llama(attn_implementation="sdpa")
    with caplog.at_level(logging.INFO, logger="atorch.auto.opt_lib.module_replace"):
        ctx = _apply(model, ["attention"])
    assert ctx.summaries["module_replace"].counts()["attention"] == 0
    assert "already fused" in caplog.text and "'sdpa'" in caplog.text


def test_shared_module_is_replaced_everywhere():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaRMSNorm(8)
            self.blocks = nn.ModuleList([nn.Linear(8, 8)])
            self.again = self.norm  # the same module under a second name

        def forward(self, x):
            return self.again(self.blocks[0](self.norm(x)))

    net = Net()
    _apply(net, ["norm"])
    assert isinstance(net.norm, FusedRMSNorm) and net.again is net.norm


@pytest.mark.parametrize("dtype,weight_dtype,tol", [
    (torch.float32, torch.float32, 0.0),     # same formula, same order: exact
    (torch.bfloat16, torch.bfloat16, 2 ** -7),  # HF rounds twice (normalize, then scale): 1 bf16 ulp
    (torch.bfloat16, torch.float32, 0.0),    # mixed: normalized input times fp32 weight, like HF
])
def test_fused_rms_norm_matches_llama_rms_norm(dtype, weight_dtype, tol):
    torch.manual_seed(0)
    ref = LlamaRMSNorm(64, eps=1e-5).to(weight_dtype)
    nn.init.normal_(ref.weight)
    fused = FusedRMSNorm.from_module(ref)
    x = torch.randn(4, 7, 64).to(dtype)
    expected, actual = ref(x), fused(x)
    assert actual.dtype == expected.dtype
    assert (actual.float() - expected.float()).abs().max().item() <= tol * expected.float().abs().max().item()


def test_llama_style_rms_norm_detection():
    # Copies of LlamaRMSNorm under other names are recognised; Gemma's (1 + weight) variant is not.
    assert all(is_llama_style_rms_norm(cls(16)) for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm))
    assert not is_llama_style_rms_norm(GemmaRMSNorm(16))
    assert not is_llama_style_rms_norm(FusedRMSNorm(16))
    assert not is_llama_style_rms_norm(nn.LayerNorm(16))


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_a_pipeline_stage_switches_its_layers_to_sdpa(factory):
    """A pipeline stage holds the model's layers but no PreTrainedModel: module_replace switches the config its
    layers read (before, the stage stayed on eager attention while the strategy said module_replace)."""
    from atorch.modules.pipeline.native import build_stage_module

    model = factory(seed=0)
    expected = model(input_ids=torch.arange(16).reshape(2, 8)).logits
    stages = [build_stage_module(factory(seed=0), index, 2).module for index in range(2)]
    for stage in stages:
        summary = replace_modules(stage, ModuleReplaceConfig(norm=False, activation=False))
        assert summary.counts()["attention"] == 1
    attentions = [m for stage in stages for m in stage.modules() if type(m).__name__.endswith("Attention")]
    assert attentions and {m.config._attn_implementation for m in attentions} == {"sdpa"}
    with torch.no_grad():
        hidden = stages[0](torch.arange(16).reshape(2, 8), torch.ones(2, 8, dtype=torch.long))
        logits = stages[1](*hidden) if isinstance(hidden, tuple) else stages[1](hidden)
    torch.testing.assert_close(logits, expected.detach(), rtol=1e-4, atol=1e-5)
