"""Selective fusion (by kind or module class), fused MLPs, and one rule for models with nothing to replace.

Tolerance for outputs: fp32, rtol = atol = 1e-5. The fused kernels compute the same formulas
in another order (the bias is added after the matmul instead of inside it; the activation
and gate product in one compiled loop), measured differences are ~1e-7 on these models.
"""

import copy
import logging

import pytest
import torch
import transformers as T
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, get_optimization
from atorch.auto.opt_lib.module_replace import ModuleReplaceSummary, attach_fuse_method, fuse
from atorch.modules.fused import FusedMLP, FusedRMSNorm
from atorch.testing import tiny_gpt2, tiny_llama

TOL = dict(rtol=1e-5, atol=1e-5)


def _tiny(name):
    torch.manual_seed(0)
    common = dict(vocab_size=1024)
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                                  **common))
    if name == "bloom":
        return T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common))
    if name == "opt":
        return T.OPTForCausalLM(T.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                            word_embed_proj_dim=64, **common))
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  **common))
    if name == "neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, **common))
    return {"llama": tiny_llama, "gpt2": tiny_gpt2}[name](seed=0)


def _apply(model, raw=None):
    opt = get_optimization("module_replace")()
    config = opt.parse_config(raw)
    opt.validate(config, ValidationContext(world_size=1, model=model))
    ctx = ModelContext(model=model)
    opt.apply(ctx, config)
    return ctx.summaries["module_replace"]


def _logits(model, seed=0):
    x = torch.randint(4, 1024, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=x, labels=x)


# What each model gets with every kind selected (mlp included), and what it reports as left alone.
EXPECTED = {
    "llama": ({"attention": 1, "norm": 5, "activation": 0, "mlp": 2}, [], []),
    "gpt2": ({"attention": 1, "norm": 0, "activation": 0, "mlp": 2}, [], []),
    "gemma2": ({"attention": 0, "norm": 0, "activation": 0, "mlp": 2}, [],
               ["Gemma2ForCausalLM attention: the model does not support 'sdpa'", "model.norm (Gemma2RMSNorm): not"]),
    "bloom": ({"attention": 0, "norm": 0, "activation": 0, "mlp": 0}, [],
              ["BloomForCausalLM attention: the model does not support 'sdpa'",
               "transformer.h.0.mlp (BloomMLP): its forward is not a known MLP layout"]),
    "opt": ({"attention": 0, "norm": 0, "activation": 0, "mlp": 0}, ["OPTForCausalLM attention ('sdpa')"], []),
    "falcon": ({"attention": 0, "norm": 0, "activation": 0, "mlp": 0}, ["FalconForCausalLM attention ('sdpa')"],
               ["transformer.h.0.mlp (FalconMLP): the up projection has no bias"]),
    "neox": ({"attention": 0, "norm": 0, "activation": 0, "mlp": 2}, ["GPTNeoXForCausalLM attention ('sdpa')"], []),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_model_follows_one_rule_and_reports_what_was_not_replaced(name, caplog):
    model = _tiny(name)
    keys = list(model.state_dict())
    counts, already, not_replaced = EXPECTED[name]
    with caplog.at_level(logging.INFO, logger="atorch.auto.opt_lib.module_replace"):
        summary = _apply(model, ["attention", "norm", "activation", "mlp"])
    assert isinstance(summary, ModuleReplaceSummary) and summary.model == type(model).__name__
    assert summary.counts() == counts
    assert list(summary.already_fused) == already
    for prefix in not_replaced:
        assert any(entry.startswith(prefix) for entry in summary.not_replaced), (prefix, summary.not_replaced)
    # The notice lists the same things; a WARNING exactly when nothing was replaced.
    record = next(r for r in caplog.records if r.message.startswith("module_replace:"))
    assert record.levelno == (logging.INFO if any(counts.values()) else logging.WARNING)
    for entry in summary.not_replaced + summary.already_fused:
        assert entry in record.message
    assert list(model.state_dict()) == keys


def test_only_a_model_without_any_candidate_raises_naming_it():
    with pytest.raises(ValueError, match=r"nothing to replace in Sequential"):
        _apply(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), ["mlp"])
    with pytest.raises(ValueError, match=r"nothing to replace in OPTForCausalLM for kinds \['mlp'\]"):
        _apply(_tiny("opt"), ["mlp"])  # OPT's MLP is inline in the decoder layer: no MLP module
    with pytest.raises(ValueError, match=r"classes \['MistralMLP'\] do not occur in LlamaForCausalLM"):
        _apply(tiny_llama(), {"attention": False, "norm": False, "activation": False, "classes": ["MistralMLP"]})
    with pytest.raises(ValueError, match="classes must be a list"):
        _apply(tiny_llama(), {"classes": "LlamaMLP"})
    with pytest.raises(ValueError, match=r"unknown replacement kind\(s\) \['LlamaMLP'\]"):
        fuse(tiny_llama(), ["LlamaMLP"])  # a class name as a string is ambiguous with a kind: pass the class


def test_fuse_by_class_replaces_only_those_classes():
    model = tiny_llama()
    summary = fuse(model, [LlamaMLP])
    assert summary.counts() == {"attention": 0, "norm": 0, "activation": 0, "mlp": 2}
    assert model.config._attn_implementation == "eager"
    assert all(isinstance(layer.mlp, FusedMLP) for layer in model.model.layers)
    assert isinstance(model.model.norm, LlamaRMSNorm)
    assert [name for _, name, _ in summary.replaced] == ["model.layers.0.mlp", "model.layers.1.mlp"]

    model = attach_fuse_method(tiny_llama())
    summary = model.fuse([LlamaAttention, "norm"])
    assert summary.counts() == {"attention": 1, "norm": 5, "activation": 0, "mlp": 0}
    assert model.config._attn_implementation == "sdpa" and isinstance(model.model.norm, FusedRMSNorm)
    # The same through the strategy config: classes by name.
    assert _apply(tiny_llama(), {"attention": False, "norm": False, "activation": False,
                                 "classes": ["LlamaMLP", "LlamaRMSNorm"]}).counts() == {
        "attention": 0, "norm": 5, "activation": 0, "mlp": 2}
    assert _apply(tiny_llama(), ["mlp"]).counts()["mlp"] == 2


def test_fused_mlp_keeps_the_children_and_parameters():
    model = tiny_gpt2()
    c_fc = model.transformer.h[0].mlp.c_fc
    fuse(model, [GPT2MLP])
    mlp = model.transformer.h[0].mlp
    assert isinstance(mlp, FusedMLP) and mlp.c_fc is c_fc and mlp.activation == "gelu_tanh"
    assert "fused from GPT2MLP" in repr(mlp)


@pytest.mark.heavy  # torch.compile of each fused kernel: seconds on CPU the first time
@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2", "neox"])
def test_fused_model_gives_the_unfused_outputs_and_gradients(name):
    reference = _tiny(name)
    if name == "gpt2":  # dropout on, p=0: the fused bias + dropout path runs, deterministically
        reference.train()
    fused = copy.deepcopy(reference)
    fuse(fused)
    assert any(isinstance(m, FusedMLP) for m in fused.modules())
    ref_out, out = _logits(reference), _logits(fused)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    ref_out.loss.backward()
    out.loss.backward()
    for (pname, p), q in zip(reference.named_parameters(), fused.parameters()):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= 1e-5 * scale + 1e-12, pname


@pytest.mark.heavy
def test_fused_bias_dropout_drops_in_training():
    model = tiny_gpt2(resid_pdrop=0.5)
    fuse(model, ["mlp"])
    mlp = model.transformer.h[0].mlp.train()
    x = torch.randn(4, 8, 64)
    out = mlp(x)
    zero_fraction = (out == 0).float().mean().item()
    assert 0.35 < zero_fraction < 0.65, zero_fraction  # 1024 outputs, p=0.5
    mlp.eval()
    expected = mlp.c_proj(mlp.act(mlp.c_fc(x)))
    torch.testing.assert_close(mlp(x), expected, **TOL)
