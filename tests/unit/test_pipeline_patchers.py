"""Patched pieces run one after another compute exactly what the Hugging Face model computes (one process).

Both ways a pipeline runs them are checked: piece by piece (DeepSpeed layers) and as native
stage modules chained together, with and without a padding mask. fp32 on CPU, same kernels
in the same order: the tolerance is 1e-6 absolute (identical up to op fusion differences).
"""

import pytest
import torch
from torch import nn

from atorch.modules.pipeline import (
    PatchedLayer,
    causal_lm_loss,
    expand_patcher,
    get_custom_patcher,
    hf_batch_fn,
    split_micro_batches,
)
from atorch.modules.pipeline.batches import CausalLMLoss, hf_inputs
from atorch.modules.pipeline.native import build_stage_module
from atorch.modules.pipeline.patchers import tied_head_paths
from atorch.testing import tiny_gpt2, tiny_llama


def _model(kind):
    return tiny_llama(seed=3, num_hidden_layers=3) if kind == "llama" else tiny_gpt2(seed=3, n_layer=3)


def _batch(with_padding):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 1024, (3, 12), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if with_padding:
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # left padding of the first row
        mask[2, -3:] = 0  # right padding of the last row
        batch["attention_mask"] = mask
    return batch


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("with_padding", [False, True])
def test_pieces_in_sequence_equal_hf_forward(kind, with_padding):
    model = _model(kind).eval()
    batch = _batch(with_padding)
    pieces = expand_patcher(model, get_custom_patcher(model))
    layers = [PatchedLayer(model.get_submodule(p.path), p.patch, p.path) for p in pieces]
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        x = hf_inputs(batch)
        for layer in layers:
            x = layer(x)
            if isinstance(x, tuple):  # between blocks: (hidden, mask, positions)
                assert x[0].is_floating_point() and not x[1].is_floating_point() and not x[2].is_floating_point()
                assert all(t.is_contiguous() for t in x)  # pipelines send them as they are
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_native_stages_chain_to_hf_logits_and_keep_hf_keys(kind):
    model = _model(kind).eval()
    batch = _batch(with_padding=True)
    stages = [build_stage_module(model, s, 3).module for s in range(3)]
    keys = [k for st in stages for k in st.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # disjoint, complete, original names
    with torch.no_grad():
        x = hf_inputs(batch)
        for st in stages:
            x = st(*x) if isinstance(x, tuple) else st(x)
        expected = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)


def test_loss_matches_hf_loss_and_handles_ignored_labels():
    model = _model("llama")
    batch = _batch(with_padding=False)
    batch["labels"][1, 5:] = -100
    out = model(**batch)
    torch.testing.assert_close(causal_lm_loss(out.logits, batch["labels"]), out.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(CausalLMLoss()(out.logits, batch["labels"]), out.loss, atol=1e-6, rtol=0)


def test_tied_head_detection():
    gpt2, llama = _model("gpt2"), _model("llama")
    assert tied_head_paths(gpt2, expand_patcher(gpt2, get_custom_patcher(gpt2))) == ("transformer.wte", "lm_head")
    assert tied_head_paths(llama, expand_patcher(llama, get_custom_patcher(llama))) is None


def test_batch_helpers():
    batch = _batch(with_padding=False)
    (ids, mask), labels = hf_batch_fn(batch)
    assert ids is batch["input_ids"] and labels is batch["labels"] and bool(mask.eq(1).all())
    assert hf_batch_fn(((ids, mask), labels))[1] is labels  # already in pipeline form
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        hf_batch_fn({"labels": labels})
    parts = split_micro_batches(batch, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [1, 1, 1]
    with pytest.raises(ValueError, match="a batch of 3 rows does not split into 2 equal micro-batches"):
        split_micro_batches(batch, 2)


def test_patcher_errors_name_the_problem():
    model = _model("llama")
    with pytest.raises(ValueError, match="'model.decoder' is not a sub-module of LlamaForCausalLM"):
        expand_patcher(model, {"model.decoder": lambda m, x: x})
    # Wrong one level down: the error lists the children of the deepest prefix that exists.
    with pytest.raises(ValueError, match=r"'model.decoder_layers' is not a sub-module of LlamaForCausalLM \('model' "
                                         r"\(LlamaModel\) has the sub-modules \['embed_tokens', 'layers', 'norm'"):
        expand_patcher(model, {"model.embed_tokens": lambda m, x: x, "model.decoder_layers": lambda m, x: x})
    with pytest.raises(ValueError, match=r"'model.layers.7' .*\('model.layers' \(ModuleList\) has the sub-modules "
                                         r"\['0', '1', '2'\]\)"):
        expand_patcher(model, {"model.layers.7": lambda m, x: x})
    with pytest.raises(ValueError, match=r"'decoder' .*\(its top-level modules are \['model', 'lm_head'\]\)"):
        expand_patcher(model, {"decoder": lambda m, x: x})
    with pytest.raises(ValueError, match=r"exactly one nn.ModuleList .*or each transformer block by its own path .*"
                                         r"\['model.layers.0', 'model.layers.1'\]: the LlamaDecoderLayer layers.*"
                                         r"none of its keys is either: 'model.embed_tokens' \(Embedding\)$"):
        expand_patcher(model, {"model.embed_tokens": lambda m, x: x})
    model.other = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"exactly one nn.ModuleList .*it names 2: \['model.layers', 'other'\]"):
        expand_patcher(model, {"model.layers": lambda m, x: x, "other": lambda m, x: x})
    with pytest.raises(ValueError, match="is not callable"):
        expand_patcher(model, {"model.embed_tokens": "embed", "model.layers": lambda m, x: x})
    with pytest.raises(ValueError, match="non-empty mapping"):
        expand_patcher(model, {})

    class Other(nn.Module):
        config = type("Cfg", (), {"model_type": "t5"})()

    with pytest.raises(ValueError, match=r"no pipeline patcher preset for model_type 't5'; presets exist for "
                                         r"\[.*'gemma', 'gemma2', .*'gpt2', .*'llama', 'mistral', .*'qwen3_moe', .*\]"):
        get_custom_patcher(Other())


def test_per_module_form_finds_the_blocks_of_a_model_with_as_many_embeddings_as_blocks():
    """A 2-layer GPT-2 has two Embeddings (wte, wpe) and two GPT2Blocks: the blocks are the model's
    transformer block class, not the most common class among its layers."""
    model = _model("gpt2")
    model.transformer.h = model.transformer.h[:2]

    def forward_patcher(forward, module):
        return lambda inputs: forward(inputs[0])

    pieces = expand_patcher(model, {"transformer.h.0": forward_patcher, "transformer.h.1": forward_patcher})
    assert [(p.path, p.kind) for p in pieces] == [
        ("transformer.wte", "pre"), ("transformer.wpe", "pre"), ("transformer.drop", "pre"),
        ("transformer.h.0", "block"), ("transformer.h.1", "block"), ("transformer.ln_f", "post"), ("lm_head", "post")]


LLAMA_LAYOUT = ("mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma", "gemma2",
                # tp_families.MORE_PLAN_FAMILIES laid out as Llama:
                "olmo2", "olmoe", "glm4", "ernie4_5", "helium", "seed_oss", "nemotron", "granite", "qwen2_moe",
                "smollm3", "exaone4", "phimoe", "gemma3_text")
# A window shorter than the 12-token batch, so the sliding-window blocks mask differently.
SLIDING = {"mistral": dict(sliding_window=4), "gemma2": dict(sliding_window=4),
           "qwen2": dict(sliding_window=4, use_sliding_window=True, max_window_layers=1),
           "qwen2_moe": dict(sliding_window=4, use_sliding_window=True, max_window_layers=1),
           "smollm3": dict(sliding_window=4, use_sliding_window=True,
                           layer_types=["sliding_attention", "full_attention"]),
           "exaone4": dict(sliding_window=4, sliding_window_pattern=2),
           "phimoe": dict(sliding_window=4),
           "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
           # Not a window: Granite's scalars outside the blocks, away from their default of 1.
           "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5)}


def _family_model(name, **overrides):
    import transformers

    from atorch.testing.tp_families import FAMILIES, more_family_config

    config = FAMILIES[name]() if name in FAMILIES else more_family_config(name)
    values = config.to_dict()
    if "layer_types" not in overrides:
        values.pop("layer_types", None)      # derived again from the overrides
    values.update(overrides)
    config = type(config).from_dict(values)
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", LLAMA_LAYOUT + tuple(f"{f}+sliding" for f in SLIDING))
def test_llama_layout_families_pieces_equal_their_own_forward(family):
    """Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE, Gemma, Gemma-2: the pieces give the family's own
    logits exactly, padded or not (Gemma's scaled embedding, Gemma-2's soft-capping and its
    alternating sliding-window blocks, the fused experts)."""
    name, _, sliding = family.partition("+")
    model = _family_model(name, **(SLIDING[name] if sliding else {}))
    pieces = expand_patcher(model, get_custom_patcher(model))
    layers = [PatchedLayer(model.get_submodule(p.path), p.patch, p.path) for p in pieces]
    for with_padding in (False, True):
        batch = _batch(with_padding)
        batch["input_ids"] = batch["input_ids"] % model.config.vocab_size
        with torch.no_grad():
            expected = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
            x = hf_inputs(batch)
            for layer in layers:
                x = layer(x)
        torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)


def test_a_task_head_of_a_preset_family_is_refused_as_not_a_causal_lm():
    """Qwen2ForSequenceClassification shares qwen2's preset (found by model_type) but has no lm_head: the error
    blamed a custom_patcher the user never passed."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from atorch.modules.pipeline.patchers import resolve_patcher

    model = AutoModelForSequenceClassification.from_config(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_labels=3))
    with pytest.raises(ValueError, match=r"the 'qwen2' preset describes its causal LM .*Qwen2ForSequenceClassification "
                                         r"has no \['lm_head'\] .*Pipelines train causal LMs only"):
        resolve_patcher(model, None)
    assert list(resolve_patcher(tiny_llama(), None)) == ["model.embed_tokens", "model.layers", "model.norm", "lm_head"]
