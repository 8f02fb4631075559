"""`ModelShape.from_config` against the real model of every architecture family atorch tests.

A transformers config's parameter layout is read off its own model class built on the meta
device, so the counts match the module exactly (every family of `atorch.testing.tp_families`);
a mixture of experts multiplies only its top-k experts (counted here from the expert tensors);
anything else keeps the Llama/GPT-2 formula.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers

from atorch.auto import cost_model
from atorch.auto.cost_model import (DEVICE_PROFILES, DS_STAGE3_PERSISTENCE_ELEMENTS, ModelShape, StrategyTraits,
                                    time_breakdown)
from atorch.auto.cost_model import shape as cost_shape
from atorch.auto.cost_model.memory import _ds_persistent_elements
from atorch.auto.cost_model.shape import _largest_param_elements, _parameter_sizes
from atorch.auto.strategy import Strategy
from atorch.testing.tp_families import FAMILIES, build_family, family_config

# Two-matrix MLPs (GELU or ReLU between an up and a down projection); every other family is gated.
NOT_GATED = {"gpt2", "gpt_neox", "opt", "falcon", "bloom"}
MOE = ("mixtral", "qwen3_moe")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_config_counts_the_real_model(family):
    model, config = build_family(family)
    from_config, from_module = ModelShape.from_config(config), ModelShape.from_module(model)
    assert from_config.num_params == sum(p.numel() for p in model.parameters())
    for name in ("num_params", "embedding_params", "layer_params", "active_params", "parameter_sizes", "gated",
                 "kv_dim", "head_dim", "intermediate_size"):
        assert getattr(from_config, name) == getattr(from_module, name), name
    sizes = {}
    for p in model.parameters():
        sizes[p.numel()] = sizes.get(p.numel(), 0) + 1
    assert dict(from_config.parameter_sizes) == sizes
    assert from_config.gated == (family not in NOT_GATED)


@pytest.mark.parametrize("family", MOE)
def test_moe_active_params_are_the_top_k_experts(family):
    model, config = build_family(family)
    shape = ModelShape.from_config(config)
    k = config.num_experts_per_tok
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    moe_layers = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue        # a dense layer (Qwen3-MoE's mlp_only_layers): every parameter is active
        moe_layers += 1
        gate_up, down = experts.gate_up_proj, experts.down_proj   # (E, 2f, h) and (E, h, f)
        count = gate_up.shape[0]
        assert down.shape[0] == count
        inactive += (count - k) * (gate_up[0].numel() + down[0].numel())
    assert moe_layers == (1 if family == "qwen3_moe" else 2)
    assert inactive > 0 and shape.active_params == total - inactive
    assert shape.num_params == total     # memory counts every expert
    # The activation formula's MLP width: the k routed experts a token goes through.
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    assert shape.intermediate_size == k * expert_width


def test_moe_flops_count_the_active_parameters():
    _, config = build_family("mixtral")
    shape = ModelShape.from_config(config)
    dense = dataclasses.replace(shape, active_params=0)     # every expert multiplied
    traits = StrategyTraits.from_strategy([], 1, shape, "cpu")
    rates = DEVICE_PROFILES["cpu"]
    batch, seq = 2, 16
    sparse_s = time_breakdown(shape, traits, batch, seq, rates)["compute"]
    dense_s = time_breakdown(dense, traits, batch, seq, rates)["compute"]
    attention = 12 * shape.num_layers * seq * shape.q_dim
    expected = batch * seq * (6 * (shape.active_params - shape.embedding_params / 2) + attention)
    assert sparse_s == pytest.approx(expected / rates["flops_fp32"] * traits.compute_time_factor)
    assert dense_s > sparse_s


def test_mixtral_8x7b_matches_its_published_sizes():
    """46.7B parameters, 12.9B active per token (Mistral AI's Mixtral 8x7B announcement); meta device, no memory."""
    config = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                        num_experts_per_tok=2, vocab_size=32000)
    shape = ModelShape.from_config(config)
    assert round(shape.num_params / 1e9, 1) == 46.7
    assert round(shape.active_params / 1e9, 1) == 12.9
    # One fused expert tensor (8 x 2 x 14336 x 4096) is the largest parameter, not a 4096 x 14336 matrix.
    assert _largest_param_elements(shape) == 8 * 2 * 14336 * 4096


@pytest.mark.parametrize("family", ["gemma", "qwen3"])
def test_a_head_dim_other_than_hidden_over_heads(family):
    """Gemma-7B (hidden 3072, 16 heads of 256) and Qwen3 (heads of 128 at every width): queries and the
    attention output are num_heads x head_dim wide."""
    model_cls = {"gemma": transformers.GemmaConfig, "qwen3": transformers.Qwen3Config}[family]
    config = model_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    attention = model.model.layers[0].self_attn
    assert shape.q_dim == attention.q_proj.out_features == 128
    assert shape.kv_dim == attention.k_proj.out_features == 64
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    # The formula (no transformers) agrees on the layout Llama-style families share.
    formula = cost_shape._formula_shape(config)
    assert formula.q_dim == 128 and formula.kv_dim == 64


# Layouts beyond the tensor-parallel families: OPT-350m's narrower word embeddings (project_in/out),
# Falcon-7B's multi-query and Falcon-40B's grouped key/value heads in one fused qkv.
OTHER_LAYOUTS = {
    "opt_proj": lambda: transformers.OPTConfig(vocab_size=1000, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                               num_attention_heads=4, word_embed_proj_dim=32,
                                               max_position_embeddings=128),
    "falcon_multi_query": lambda: transformers.FalconConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, multi_query=True),
    "falcon_40b": lambda: transformers.FalconConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, new_decoder_architecture=True,
                                                    num_kv_heads=2),
}


@pytest.mark.parametrize("layout", sorted(OTHER_LAYOUTS))
def test_other_layouts_count_the_real_model(layout):
    config = OTHER_LAYOUTS[layout]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert not shape.gated
    if layout.startswith("falcon"):
        qkv = model.transformer.h[0].self_attention.query_key_value.out_features
        assert qkv == shape.q_dim + 2 * shape.kv_dim
        assert shape.kv_dim == (16 if layout == "falcon_multi_query" else 32)


def test_shared_experts_are_always_active():
    """Qwen2-MoE: 4 routed experts of width 32 (top-2) and one shared expert of width 96 with its gate."""
    config = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=100)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    inactive = sum((e.gate_up_proj.shape[0] - 2) * (e.gate_up_proj[0].numel() + e.down_proj[0].numel())
                   for e in (layer.mlp.experts for layer in model.model.layers))
    assert shape.num_params == total and shape.active_params == total - inactive
    assert shape.intermediate_size == 2 * 32 + 96


def test_experts_a_config_names_but_its_model_lacks_are_not_counted(caplog):
    """A dense Llama whose config carries Mixtral's expert fields (e.g. copied between configs)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=100, num_local_experts=4,
                                      num_experts_per_tok=2)
    with caplog.at_level(logging.INFO, logger="atorch.auto.cost_model"):
        shape = ModelShape.from_config(config)
    assert shape.compute_params == shape.num_params and shape.intermediate_size == 128
    assert any("no module is named 'experts'" in r.getMessage() for r in caplog.records)


def test_largest_and_persistent_parameters_are_the_real_tensors():
    model, config = build_family("qwen3_moe")
    shape = ModelShape.from_config(config)
    numels = [p.numel() for p in model.parameters()]
    assert _largest_param_elements(shape) == max(numels)
    assert _ds_persistent_elements(shape) == sum(n for n in numels if n < DS_STAGE3_PERSISTENCE_ELEMENTS)


def test_a_config_that_is_not_transformers_keeps_the_formula():
    h, f, layers, vocab = 64, 128, 2, 1000
    config = SimpleNamespace(hidden_size=h, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=4,
                             vocab_size=vocab)
    shape = ModelShape.from_config(config)
    layer = 4 * h * h + 3 * h * f + 2 * h       # Llama: q, k, v, o, gate, up, down, two norms
    assert shape.num_params == layers * layer + 2 * vocab * h + h
    assert shape.layer_params == layer and shape.embedding_params == 2 * vocab * h
    assert shape.parameter_sizes == () and shape.active_params == 0 and shape.compute_params == shape.num_params
    assert sum(n * c for n, c in _parameter_sizes(shape)) == shape.num_params   # the formula's own tensors
    assert _largest_param_elements(shape) == vocab * h


class _UnknownConfig(transformers.PretrainedConfig):
    model_type = "atorch_test_unknown"


def test_a_transformers_config_without_a_causal_lm_falls_back_and_says_why_once(caplog):
    config = _UnknownConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=1000)
    with caplog.at_level(logging.INFO, logger="atorch.auto.cost_model"):
        first = ModelShape.from_config(config)
        second = ModelShape.from_config(config)
    assert first == second and first.parameter_sizes == ()
    assert first.num_params == ModelShape.from_config(SimpleNamespace(**config.to_dict())).num_params
    messages = [r.getMessage() for r in caplog.records if "Llama/GPT-2 formula" in r.getMessage()]
    assert len(messages) == 1 and "_UnknownConfig" in messages[0]


def test_layouts_are_cached_by_content_and_bounded(monkeypatch):
    real = sum(p.numel() for p in build_family("llama")[0].parameters())
    monkeypatch.setattr(cost_shape, "_LAYOUTS", type(cost_shape._LAYOUTS)())
    monkeypatch.setattr(cost_shape, "_LAYOUTS_MAX", 2)
    built = []
    original = transformers.AutoModelForCausalLM.from_config

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", counting)
    a, b = FAMILIES["llama"](), FAMILIES["llama"]()     # equal content, two objects
    attention = a._attn_implementation
    ModelShape.from_config(a)
    ModelShape.from_config(b)
    assert len(built) == 1 and a._attn_implementation == attention   # the user's config is left as it was
    for layers in (3, 4, 5):
        ModelShape.from_config(transformers.LlamaConfig(**{**a.to_dict(), "num_hidden_layers": layers}))
    assert len(built) == 4 and len(cost_shape._LAYOUTS) == 2
    assert ModelShape.from_config(a).num_params == real
    assert len(built) == 5      # evicted: built again


def test_parameter_sizes_do_not_change_the_module_path():
    """from_module records its own tensors, which the persistence threshold then reads."""
    model, _ = build_family("gpt2")
    shape = ModelShape.from_module(model)
    assert sum(n * c for n, c in shape.parameter_sizes) == shape.num_params


def _tiny_gemma3():
    return transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)


def test_a_composite_config_is_read_through_its_text_config():
    """Gemma-3, Llama-4, Mllama, Qwen3.5: the language model's widths live in `text_config`; the
    top-level config has no hidden_size and the cost model refused it ("has none of ...")."""
    config = _tiny_gemma3()
    assert getattr(config, "hidden_size", None) is None
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.head_dim) == (64, 2, 4, 32)
    assert shape.num_params == sum(p.numel() for p in model.parameters())      # the vision tower too
    assert ModelShape.from_module(model).num_params == shape.num_params
    est = cost_model.estimate(config, Strategy(["parallel_mode", "amp_native", "fsdp"]), 8, 64, 2)
    assert est.peak_memory_bytes > 0 and est.step_time_s > 0


def test_a_heterogeneous_config_reads_per_layer_attributes_as_the_widest_layer():
    """transformers' heterogeneous configs (Gemma-4: head_dim 256 on sliding layers, 512 on full
    ones) raise on a global read of a per-layer attribute; the formula takes the widest layer, and
    the parameter counts come from the model built on the meta device."""
    config = transformers.AutoConfig.for_model(
        "gemma4_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256)
    per_layer = [layer.head_dim for layer in config.per_layer_config]
    assert len(set(per_layer)) == 2
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        config.head_dim
    shape = ModelShape.from_config(config)
    assert shape.head_dim == max(per_layer) and shape.num_heads == 4
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert cost_model.estimate(config, Strategy(["parallel_mode", "checkpoint"]), 8, 64, 2).peak_memory_bytes > 0


def test_a_model_without_attention_heads_is_refused_with_what_is_missing():
    """Attention-free families (Mamba, RWKV, xLSTM) have no heads for the block formula: a
    ValueError that names the fields (the search then runs without the cost model's prediction)."""
    config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"MambaConfig has none of \['num_attention_heads', 'n_head'\]"):
        ModelShape.from_config(config)


TENSOR_2 = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]


@pytest.mark.parametrize("model_type", sorted(FAMILIES) + ["olmoe", "phimoe", "qwen2_moe"])
def test_tensor_parallel_parameters_per_rank_are_what_the_plan_leaves(model_type):
    """The memory model's parameters per rank under tensor=2 are the ones `apply_tensor_parallel` leaves on
    a rank (one of 2 fake ranks): Qwen2-MoE's plan leaves its shared expert whole (22% of this model),
    Mixtral's its routers, Gemma2's its four norms a block; the formula knew norms and biases only."""
    from atorch.tensor_parallel import apply_tensor_parallel
    from atorch.testing.fake_distributed import fake_process_group
    from atorch.testing.tp_families import more_family_config

    config = family_config(model_type) if model_type in FAMILIES else more_family_config(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    predicted = cost_model.estimate(ModelShape.from_module(model), TENSOR_2, 4, 16, 2, "cpu").breakdown["mem_params"]
    with fake_process_group(0, 2):
        sharded = apply_tensor_parallel(model, torch.distributed.group.WORLD).model
        per_rank = sum(p.numel() * p.element_size() for p in sharded.parameters())
    assert predicted == pytest.approx(per_rank, rel=0.002)     # a vocabulary padded to a multiple of 2
