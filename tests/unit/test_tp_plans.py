"""TPInfo from transformers' plans and the hand presets, on meta models of every family (no processes),
the errors for what cannot be honoured, and the LoRA / experts layers at a group of one."""

import math
import re

import pytest
import torch
from torch import nn

from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.strategy import Strategy
from atorch.tensor_parallel import ColumnParallelLinear, RowParallelLinear, resolve_tp_plan, tpinfo_for_model
from atorch.tensor_parallel.hf_plan import tpinfo_from_transformers_plan
from atorch.tensor_parallel.plan import COL, EXPERTS, GRAD_REDUCE, PARALLEL_DROP, ROW, VOCAB
from atorch.testing.tp_families import (FAMILIES, MORE_PLAN_FAMILIES, REFUSED_PLAN_FAMILIES, family_config,
                                         more_family_config)
from atorch.utils.meta_model_utils import record_module_init


def _meta(name, **overrides):
    from transformers import AutoModelForCausalLM

    config = family_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    with record_module_init():
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _counts(plan):
    found = {}
    for action in plan.actions.values():
        found[action.kind] = found.get(action.kind, 0) + 1
    return found


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_resolves_with_a_split_head_embedding_and_attention(name):
    model = _meta(name)
    plan = resolve_tp_plan(model, tpinfo_for_model(model), 2, gather_logits=True)
    counts = _counts(plan)
    assert plan.output_embedding is not None and plan.actions[plan.output_embedding].kind == COL
    assert plan.vocab_parallel_loss and plan.gather_logits
    assert counts.get(VOCAB) == 1, counts
    assert counts.get(ROW, 0) >= 2 and counts.get(PARALLEL_DROP, 0) + counts.get("replic_drop", 0) >= 2, counts
    if name in ("mixtral", "qwen3_moe"):
        assert counts[EXPERTS] == (2 if name == "mixtral" else 1), counts  # qwen3_moe: layer 1 is dense
    if name in ("qwen3", "qwen3_moe"):
        assert counts[GRAD_REDUCE] == 4, counts                            # q_norm, k_norm of 2 layers
    if name == "bloom":
        assert set(plan.head_inputs) == {"transformer.h.0.self_attention", "transformer.h.1.self_attention"}


@pytest.mark.parametrize("model_type", sorted(MORE_PLAN_FAMILIES))
def test_more_families_shard_their_blocks(model_type):
    """Every block has a split part (attention and MLP; PhiMoE's plan splits its experts only); the
    logits are checked on 2 ranks in tests/distributed/test_tp_families.py."""
    from transformers import AutoModelForCausalLM

    with record_module_init():
        model = AutoModelForCausalLM.from_config(more_family_config(model_type))
    counts = _counts(resolve_tp_plan(model, tpinfo_for_model(model), 2, gather_logits=True))
    assert counts.get(ROW, 0) + counts.get(EXPERTS, 0) >= model.config.num_hidden_layers, counts


@pytest.mark.parametrize("model_type", sorted(REFUSED_PLAN_FAMILIES))
def test_plans_that_would_replicate_the_blocks_or_give_wrong_results_are_refused(model_type):
    """gpt_oss and hunyuan_v1_dense ship a plan for the embedding only (tensor parallelism replicated
    every block silently); Llama-4's causal LM declares the base-model prefix of its multimodal
    sibling (the plan matched no layer, same result; now it matches and meets an expert style atorch
    cannot split); CodeGen's plan gave logits 62% off; stablelm has no plan."""
    from transformers import AutoModelForCausalLM

    with record_module_init():
        model = AutoModelForCausalLM.from_config(more_family_config(model_type))
    with pytest.raises(ValueError, match=re.escape(REFUSED_PLAN_FAMILIES[model_type][1])):
        tpinfo_for_model(model)


def test_phi3_keeps_transformers_gather_and_split_input_variants():
    tpinfo = tpinfo_from_transformers_plan(_meta("phi3"))
    assert tpinfo.col["self_attn.qkv_proj"] == {"gather_output": True}
    assert tpinfo.row["self_attn.o_proj"] == {"input_is_parallel": False}
    # The attention sees gathered (replicated) q, k, v: its dropout stream is the shared one.
    assert "self_attn" in tpinfo.replic and "self_attn" not in tpinfo.parallel and not tpinfo.shrink_attrs


def test_a_style_atorch_cannot_honour_names_module_and_style():
    model = _meta("llama")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(ValueError, match=r"cannot honour transformers plan entry 'model.layers.\*.mlp.gate_proj' -> "
                                         r"'local_colwise' on 'model.layers.0.mlp.gate_proj' \(Linear\)"):
        tpinfo_for_model(model)


def test_presets_refuse_what_they_cannot_split():
    with pytest.raises(ValueError, match=r"Falcon with multi_query=True"):
        tpinfo_for_model(_meta("falcon", multi_query=True))
    with pytest.raises(ValueError, match=r"no tensor-parallel preset for model_type=None \(Linear\) and no "
                                         r"transformers plan"):
        tpinfo_for_model(nn.Linear(2, 2))


def test_gather_logits_is_validated_and_lora_dropout_refused():
    model = _meta("llama")
    pm = ("parallel_mode", ([("tensor", 2)], None))
    ctx = ValidationContext(world_size=2, model=model, model_config=model.config)
    with pytest.raises(ValueError, match=r"gather_logits='no' must be True or False"):
        resolve_strategy(Strategy([pm, ("tensor_parallel", {"gather_logits": "no"})]), ctx)
    names = [r.name for r in resolve_strategy(Strategy([pm, ("tensor_parallel", {"gather_logits": False})]), ctx)]
    assert names == ["parallel_mode", "tensor_parallel"]


def test_lora_layers_at_a_group_of_one_compute_base_plus_scaled_adapter():
    from atorch.tensor_parallel.lora import add_lora
    from atorch.utils.lora_init import lora_a_init

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        full = nn.Linear(8, 6)
        layer = add_lora(cls.from_full(full, None), r=2, alpha=4, a_full=lora_a_init(1, "fc", 2, 8))
        assert torch.equal(layer.lora_B, torch.zeros(6, 2))                     # starts at the base model
        assert layer.lora_A.abs().max() <= 1 / math.sqrt(8)                     # kaiming-uniform(a=sqrt(5)) bound
        with torch.no_grad():
            layer.lora_B.normal_()
        expected = full(x) + 2.0 * x @ layer.lora_A.t() @ layer.lora_B.t()
        torch.testing.assert_close(layer(x), expected)
        assert set(layer.shard_specs()) >= {"weight"}


def _more_meta(model_type, **overrides):
    from transformers import AutoModelForCausalLM

    config = more_family_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    with record_module_init():
        return AutoModelForCausalLM.from_config(config)


def test_per_head_norms_the_plan_leaves_out_get_their_gradients_summed():
    """Phi's `qk_layernorm` norms (one weight of head_dim for all heads) act on this rank's heads only;
    transformers' plan does not list them, and without the sum each rank trained its own copy."""
    model = _more_meta("phi", qk_layernorm=True)
    tpinfo = tpinfo_for_model(model)
    assert set(tpinfo.grad_reduce) == {"self_attn.q_layernorm", "self_attn.k_layernorm"}
    counts = _counts(resolve_tp_plan(model, tpinfo, 2, gather_logits=True))
    assert counts[GRAD_REDUCE] == 2 * model.config.num_hidden_layers, counts
    assert not tpinfo_for_model(_more_meta("phi")).grad_reduce      # without the norms: nothing to sum


def test_a_weight_per_head_the_plan_leaves_out_is_refused_naming_it():
    """Cohere's `use_qk_norm` holds one norm row per head ([heads, head_dim]): a split the plan does not
    describe (it failed in the first forward with a shape error)."""
    model = _more_meta("cohere", use_qk_norm=True)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_norm' \(CohereLayerNorm, parameters "
                                         r"\['weight \(4, 16\)'\].*Leave tensor parallelism out"):
        tpinfo_for_model(model)


def _stablelm_tpinfo():
    """The README's route for a model without a plan: a hand-written TPInfo that splits StableLM's attention."""
    from atorch.tensor_parallel import TPInfo

    tpinfo = TPInfo().shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                "mlp.up_proj", {"lm_head": {"gather_output": False}})
    tpinfo.shard_row("self_attn.o_proj", "mlp.down_proj").shard_vocab("embed_tokens").parallel_drop("self_attn")
    return tpinfo.shrink({"self_attn": {"num_heads", "num_key_value_heads"}})


def test_a_hand_tpinfo_that_splits_heads_refuses_per_head_norms_and_sums_shared_ones():
    """StableLM's `qk_layernorm` keeps one LayerNorm per head in a list: each rank zipped its own heads with
    the first norms (logits 30% off) until the TPInfo path refused it, as the transformers-plan path refuses
    Cohere's per-head `q_norm`. A norm shared by the heads (Phi's) gets its gradients summed, as there."""
    from transformers import AutoModelForCausalLM, StableLmConfig

    config = StableLmConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True)
    with record_module_init():
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"the TPInfo splits the heads of 'model\.layers\.0\.self_attn' "
                                         r"\(column-parallel 'model\.layers\.0\.self_attn\.q_proj'\), but not "
                                         r"'model\.layers\.0\.self_attn\.q_layernorm' \(StableLmLayerNormPerHead, "
                                         r"parameters \['norms\.0\.weight \(16,\)'.*Leave the attention whole"):
        resolve_tp_plan(model, _stablelm_tpinfo(), 2)
    config.qk_layernorm = False
    with record_module_init():
        plain = AutoModelForCausalLM.from_config(config)
    assert GRAD_REDUCE not in _counts(resolve_tp_plan(plain, _stablelm_tpinfo(), 2))

    from atorch.tensor_parallel import TPInfo

    phi = _more_meta("phi", qk_layernorm=True)
    tpinfo = TPInfo().shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj").shard_row("self_attn.dense")
    plan = resolve_tp_plan(phi, tpinfo, 2)
    reduced = sorted(n for n, a in plan.actions.items() if a.kind == GRAD_REDUCE)
    assert reduced == [f"model.layers.{i}.self_attn.{n}_layernorm" for i in range(2) for n in ("k", "q")], reduced
