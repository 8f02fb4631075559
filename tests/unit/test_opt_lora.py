"""`lora`: only adapters train, peft defaults per model type, clear target errors, seeded adapters."""

import copy
import logging

import peft
import pytest
import torch
from torch import nn

from atorch.auto.model_context import ModelContext, call_model
from atorch.auto.opt_lib import ValidationContext, get_optimization, resolve_strategy
from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_gpt2, tiny_llama


def _validate(model, raw=None):
    opt = get_optimization("lora")()
    config = opt.parse_config(raw)
    opt.validate(config, ValidationContext(world_size=1, model=model, model_config=getattr(model, "config", None)))
    return opt, config


def _apply(model, raw=None):
    opt, config = _validate(model, raw)
    ctx = ModelContext(model=model)
    opt.apply(ctx, config)
    return ctx


def _batch():
    x = torch.randint(4, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": x, "labels": x}


@pytest.mark.parametrize("make,targets", [(tiny_llama, ["q_proj", "v_proj"]), (tiny_gpt2, ["c_attn"])],
                         ids=["llama", "gpt2"])
def test_only_adapters_are_trainable_with_default_targets(make, targets):
    ctx = _apply(make(seed=0))
    model = ctx.model
    assert isinstance(model, peft.PeftModel)
    assert ctx.summaries["lora"]["target_modules"] == targets
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # 2 layers x each target x (lora_A, lora_B)
    assert len(trainable) == 2 * len(targets) * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert all(any(f".{t}." in n for t in targets) for n in trainable)
    assert [p for p in ctx.optim_params()] == [p for p in model.parameters() if p.requires_grad]


def test_training_step_moves_adapters_only_and_hf_loss_works():
    base = tiny_llama(seed=0)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters()}
    ctx = _apply(base, {"r": 4, "alpha": 8, "target_modules": ["o_proj", "down_proj"]})
    optim = torch.optim.AdamW(ctx.optim_params(), lr=1e-2)
    # The HF loss comes through the peft wrapper with unpack_dict, as auto_accelerate calls it.
    loss = call_model(ctx.model, _batch(), "unpack_dict").loss
    loss.backward()
    optim.step()
    base_model = ctx.model.get_base_model()
    for name, p in base_model.named_parameters():
        if "lora_" in name:
            continue
        original = name.replace(".base_layer", "")
        assert p.grad is None and torch.equal(p, frozen_before[original]), name
    lora_b = [p for n, p in base_model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4 and all(p.abs().sum() > 0 for p in lora_b), "lora_B starts at 0 and must move"


def test_adapters_are_seeded_and_leave_the_global_rng_alone():
    def adapters(seed, global_seed):
        model = tiny_llama(seed=0)
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        model = add_lora_adapters(model, LoraConfig(seed=seed))
        assert torch.equal(torch.get_rng_state(), before), "the caller's random stream must not advance"
        return [p for n, p in model.named_parameters() if "lora_A" in n]

    a, b, c = adapters(7, global_seed=123), adapters(7, global_seed=999), adapters(8, global_seed=123)
    # Same seed, different global states (as on ranks that consumed randomness differently): same adapters.
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, y) for x, y in zip(a, c))


def test_composes_with_non_reentrant_checkpoint():
    # With frozen embeddings no block input requires grad; reentrant checkpointing would then
    # drop the adapter gradients. Ours is non-reentrant: gradients must equal the plain ones.
    plain = _apply(tiny_llama(seed=0)).model
    ckpt = copy.deepcopy(plain)
    ck = get_optimization("checkpoint")()
    ctx = ModelContext(model=ckpt)
    ck.apply(ctx, ck.parse_config(None))
    assert ctx.summaries["checkpoint"]["blocks"] == 2
    for model in (plain, ckpt):
        model.train()
        call_model(model, _batch(), "unpack_dict").loss.backward()
    pairs = [(n, p, q) for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()) if p.requires_grad]
    assert pairs
    for name, p, q in pairs:
        assert q.grad is not None and torch.equal(p.grad, q.grad), name


def test_target_errors_list_the_layer_names():
    with pytest.raises(ValueError, match=r"target module\(s\) \['qkv'\] match no layer of LlamaForCausalLM; its "
                                         r"adaptable layer names are \['down_proj', .*'v_proj'\]"):
        _validate(tiny_llama(), {"target_modules": ["q_proj", "qkv"]})
    with pytest.raises(ValueError, match=r"target 'mlp' matches LlamaMLP modules \(e.g. 'model.layers.0.mlp'\), "
                                         r"which LoRA cannot adapt"):
        _validate(tiny_llama(), {"target_modules": "mlp"})

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"no default target modules for Custom .*adaptable layer names \['proj'\]"):
        _validate(Custom())
    _validate(Custom(), {"target_modules": ["proj"]})


def test_never_called_layers_are_not_suggested_and_refused_as_targets():
    """nn.MultiheadAttention reads out_proj.weight directly: an adapter on out_proj would never run (peft adds it
    silently; alone it fails torch's backward). Bare index names ('0') are suggested with their parent ('ff.0')."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 4)

    with pytest.raises(ValueError, match=r"adaptable layer names \['attn', 'ff.0', 'ff.2', 'head'\]$"):
        _validate(Plain())
    with pytest.raises(ValueError, match=r"target 'out_proj' matches 'layers.0.attn.out_proj', the output projection "
                                         r"of nn.MultiheadAttention, .* never run"):
        _validate(Plain(), {"target_modules": ["ff.0", "out_proj"]})
    _validate(Plain(), {"target_modules": ["ff.0", "head"]})


@pytest.mark.parametrize("raw,message", [
    ({"r": 0}, r"r=0; expected an integer >= 1"),
    ({"r": 2.5}, r"r=2.5; expected an integer >= 1"),
    ({"alpha": 0}, r"alpha=0; expected a finite number > 0"),
    ({"alpha": float("nan")}, r"alpha=nan; expected a finite number > 0"),    # NaN passed `alpha <= 0`
    ({"alpha": float("inf")}, r"alpha=inf; expected a finite number > 0"),
    ({"seed": 1.5}, r"seed=1.5; expected an integer in \[0, 2\*\*64\) \(torch.manual_seed's range\)"),
    ({"seed": -1}, r"seed=-1; expected an integer in \[0, 2\*\*64\)"),
    ({"seed": 2 ** 70}, r"seed=1180591620717411303424; expected an integer in \[0, 2\*\*64\)"),
    ({"seed": True}, r"seed=True; expected an integer"),
    ({"dropout": 1.0}, r"dropout=1.0; expected a probability in \[0, 1\)"),
    ({"target_modules": []}, r"target_modules=\(\); expected None or a non-empty list"),
    ({"rank": 4}, r"unknown config key\(s\) \['rank'\]; valid keys are \['r', 'alpha', 'target_modules', "
                  r"'dropout', 'seed', 'modules_to_save'\]"),
    ({"modules_to_save": []}, r"modules_to_save=\(\); expected None or a non-empty list of module names"),
    ({"modules_to_save": ["lm_head", ""]}, r"modules_to_save=\('lm_head', ''\); expected None or a non-empty list"),
])
def test_config_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        _validate(tiny_llama(), raw)


def test_lora_combines_with_tensor_parallel_without_dropout():
    # LoRA adapts the sharded linears (atorch.tensor_parallel.lora; parity in test_tp_lora.py); its
    # adapter dropout would need per-layer random streams, so it is refused with tensor parallelism.
    model = tiny_llama()
    pm = ("parallel_mode", ([("tensor", 2)], None))
    names = [r.name for r in resolve_strategy(Strategy([pm, "tensor_parallel", "lora"]),
                                              ValidationContext(world_size=2, model=model))]
    assert names == ["parallel_mode", "tensor_parallel", "lora"]
    with pytest.raises(ValueError, match=r"lora: dropout=0.1 with tensor_parallel is not supported"):
        resolve_strategy(Strategy([pm, "tensor_parallel", ("lora", {"dropout": 0.1})]),
                         ValidationContext(world_size=2, model=model))


def test_already_a_peft_model_is_refused():
    model = add_lora_adapters(tiny_llama(), LoraConfig())
    with pytest.raises(ValueError, match="already a peft PeftModel"):
        _validate(model)


def test_an_adapted_layer_that_does_not_run_in_the_first_forward_is_warned_about_once(caplog):
    """Its adapter gets no gradient: named in one warning after the first forward; the hooks are then gone."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.skipped = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    model = add_lora_adapters(Branchy(), LoraConfig(target_modules=("proj", "skipped")))
    with caplog.at_level(logging.WARNING, logger="atorch.auto.opt_lib.lora"):
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    assert len(caplog.records) == 1, caplog.text
    assert "1 adapted layer(s) did not run in the first forward" in caplog.text
    assert "['base_model.model.skipped']" in caplog.text
    assert not any(m._forward_hooks for m in model.modules())
    copy.deepcopy(model)


def test_a_frozen_task_head_without_an_adapter_is_warned_about(caplog):
    """LoRA freezes the base model, the task head included: a classifier head new for the task (random, as
    from_pretrained adds it for fine-tuning) would never train. Warned, naming the head and the remedy; not
    when the head has an adapter, nor for a model without such a head."""
    from transformers import BertForSequenceClassification

    from atorch.testing import tiny_bert_config

    def bert_classifier():
        torch.manual_seed(0)
        return BertForSequenceClassification(tiny_bert_config(num_labels=3))

    from atorch.auto.opt_lib import lora

    lora._WARNED_HEADS.clear()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.opt_lib.lora"):
        _apply(bert_classifier())
        _apply(bert_classifier())            # once per model class and head: a search applies lora per dry run
    assert caplog.text.count("has no adapter and stays frozen") == 1
    assert "lora: the task head 'base_model.model.classifier' (Linear) has no adapter and stays frozen" in caplog.text
    assert "add 'classifier' to modules_to_save to train it whole (or to target_modules to adapt it)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.opt_lib.lora"):
        ctx = _apply(bert_classifier(), {"target_modules": ["query", "value", "classifier"]})
        saved = _apply(bert_classifier(), {"target_modules": ["query", "value"], "modules_to_save": ["classifier"]})
        _apply(tiny_llama())
    assert "task head" not in caplog.text
    assert any(p.requires_grad for n, p in ctx.model.named_parameters() if "classifier" in n)
    assert any(p.requires_grad for n, p in saved.model.named_parameters() if "classifier" in n)


def _seq_cls_llama():
    from transformers import LlamaForSequenceClassification

    config = copy.deepcopy(tiny_llama().config)
    config.num_labels, config.pad_token_id = 3, 0
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config)


def test_modules_to_save_trains_the_head_whole_and_only_it_besides_the_adapters():
    """peft's `modules_to_save`: a trainable copy of the head (the loaded one kept frozen beside it); one
    optimizer step moves the copy and the adapters' B, nothing of the base model."""
    model = _seq_cls_llama()
    ctx = _apply(model, {"modules_to_save": ["score"]})
    assert ctx.summaries["lora"]["modules_to_save"] == ["score"]
    trainable = {n for n, p in ctx.model.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert {n for n in trainable if "lora_" not in n} == {"base_model.model.score.modules_to_save.default.weight"}
    before = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    optim = torch.optim.SGD(ctx.optim_params(), lr=0.5)
    x = _batch()["input_ids"]
    loss = call_model(ctx.model, {"input_ids": x, "labels": torch.tensor([0, 2])}, "unpack_dict").loss
    loss.backward()
    optim.step()
    moved = {n for n, p in ctx.model.named_parameters() if not torch.equal(p, before[n])}
    assert "base_model.model.score.modules_to_save.default.weight" in moved
    assert all(n in trainable for n in moved), sorted(moved - trainable)
    assert "base_model.model.score.original_module.weight" not in moved


@pytest.mark.parametrize("saved,message", [
    (["scores"], r"modules_to_save 'scores' matches no module of LlamaForSequenceClassification; name a module to "
                 r"train whole, e.g. one of \['model', 'model.embed_tokens', .*'score'\]"),
    (["proj"], r"modules_to_save 'proj' would also make peft train 'model.layers.0.self_attn.q_proj' whole"),
    (["self_attn"], r"modules_to_save 'self_attn' \('model.layers.0.self_attn'\) overlaps the adapted layer "
                    r"'model.layers.0.self_attn.q_proj'"),
    (["q_proj"], r"modules_to_save 'q_proj' \('model.layers.0.self_attn.q_proj'\) overlaps the adapted layer"),
    (["rotary_emb"], r"modules_to_save 'rotary_emb' matches 'model.rotary_emb' \(LlamaRotaryEmbedding\), which has no "
                     r"parameters to train"),
])
def test_modules_to_save_that_peft_would_apply_otherwise_than_meant_are_refused(saved, message):
    # peft skips an unmatched name silently and matches by plain suffix: each refused before anything is applied.
    with pytest.raises(ValueError, match=message):
        _validate(_seq_cls_llama(), {"modules_to_save": saved})


def test_modules_to_save_with_tensor_parallel_is_refused():
    pm = ("parallel_mode", ([("tensor", 2)], None))
    with pytest.raises(ValueError, match=r"lora: modules_to_save=\['lm_head'\] with tensor_parallel is not supported"):
        resolve_strategy(Strategy([pm, "tensor_parallel", ("lora", {"modules_to_save": "lm_head"})]),
                         ValidationContext(world_size=2, model=tiny_llama()))


def _qwen3_moe(mlp_only_layers):
    from transformers import AutoModelForCausalLM

    from atorch.testing.tp_families import family_config

    config = family_config("qwen3_moe")
    config.mlp_only_layers = mlp_only_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


MOE_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def test_expert_names_on_fused_experts_follow_peft_on_every_layout(caplog):
    """transformers 5 fuses a MoE layer's experts into stacked weights; peft maps the expert projection names
    onto them. An all-MoE model was refused ("match no layer"); a model part without a config (a pipeline
    stage) adapted the dense MLP instead. Both now adapt what peft adapts on the whole model."""
    from atorch.auto.opt_lib import lora

    _validate(_qwen3_moe([]), {"target_modules": MOE_TARGETS})      # every layer MoE: accepted
    whole = _qwen3_moe([1])
    lora._WARNED_EXPERTS.clear()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.opt_lib.lora"):
        reference = add_lora_adapters(copy.deepcopy(whole), LoraConfig(target_modules=tuple(MOE_TARGETS)))
        part = nn.Module()              # what a stage holds, without the model's config
        part.layers = copy.deepcopy(whole.model.layers)
        staged = add_lora_adapters(part, LoraConfig(target_modules=tuple(MOE_TARGETS)), model_config=whole.config,
                                   on_stage=True)
    assert caplog.text.count("get no adapter") == 1, caplog.text
    assert "the 3 dense layer(s) of those names get no adapter, e.g. 'model.layers.1.mlp.gate_proj'" in caplog.text

    def adapted(model, prefix):
        return sorted({n.split(".lora_")[0].replace(prefix, "") for n, p in model.named_parameters() if p.requires_grad})

    assert adapted(staged, "base_model.model.") == adapted(reference, "base_model.model.model.")
    assert "layers.0.mlp.experts" in adapted(staged, "base_model.model.")
    assert staged.peft_config["default"].target_parameters == {"gate_up_proj", "down_proj"}


def test_expert_names_that_peft_cannot_map_or_tensor_parallel_cannot_adapt_are_refused():
    with pytest.raises(ValueError, match=r"lora: target_modules \['gate_proj'\]: Cannot convert PEFT target\(s\) "
                                         r"gate_proj without also targeting up_proj"):
        _validate(_qwen3_moe([]), {"target_modules": ["gate_proj"]})
    pm = ("parallel_mode", ([("tensor", 2)], None))
    with pytest.raises(ValueError, match=r"lora with tensor_parallel adapts linear layers; peft maps the targets "
                                         r"\['down_proj', 'gate_proj', 'up_proj'\] to the fused expert weights "
                                         r"\['down_proj', 'gate_up_proj'\] of Qwen3MoeForCausalLM"):
        resolve_strategy(Strategy([pm, "tensor_parallel", ("lora", {"target_modules": MOE_TARGETS})]),
                         ValidationContext(world_size=2, model=_qwen3_moe([1])))
    # The attention projections alone stay adaptable under tensor parallelism.
    resolve_strategy(Strategy([pm, "tensor_parallel", ("lora", {"target_modules": ["q_proj", "v_proj"]})]),
                     ValidationContext(world_size=2, model=_qwen3_moe([1])))


def test_fused_expert_names_are_suggested_for_a_mixture_of_experts():
    """transformers 5 keeps OLMoE's experts as stacked parameters, not layers: the suggestion listed only the
    attention projections, while gate_proj / up_proj / down_proj adapt the experts (`convert_like_peft`)."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    model = AutoModelForCausalLM.from_config(OlmoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
        num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"adaptable layer names are \['down_proj', 'embed_tokens', 'gate_proj', "
                                         r"'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        _validate(model, {"target_modules": ["nothing_of_that_name"]})
