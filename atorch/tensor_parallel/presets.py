"""Hand-written TPInfo for Hugging Face families that ship no tensor-parallel plan, and the lookup.

`tpinfo_for_model` takes the hand preset of `config.model_type` (GPT-2, OPT, Falcon, BLOOM)
or else translates the plan transformers ships (`hf_plan.tpinfo_from_transformers_plan`:
Llama, Mistral, Qwen2/3, Gemma/Gemma2, Phi-3, GPT-NeoX, Mixtral, Qwen3-MoE, ...). Each preset
is a function of the model, so it can follow the installed transformers version: attributes
that attention modules reshape with are shrunk only where they exist, and
`resolve_tp_plan` still checks every suffix against the model.

Choices shared by all presets: the LM head is column-parallel over the vocabulary and the
model's loss the vocabulary-parallel cross entropy (whether the returned logits are then
gathered is `gather_logits`, decided when sharding). The attention module forks the
per-rank dropout stream (its attention-probability dropout acts on this rank's heads);
dropouts on the replicated residual stream fork the stream shared by the tensor group.

To add a model without a plan: write a function `model -> TPInfo` like the ones below and
pass its result as `("tensor_parallel", {"tpinfo": my_tpinfo(model)})`.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List

from torch import nn

from atorch.tensor_parallel.hf_plan import has_transformers_plan, tpinfo_from_transformers_plan
from atorch.tensor_parallel.plan import TPInfo

_LM_HEAD_SPLIT = {"gather_output": False}


def _present(model: nn.Module, suffix: str, attrs: Iterable[str]) -> List[str]:
    """The attributes among `attrs` that the first module named `*suffix` has as integers."""
    for name, module in model.named_modules():
        if name.endswith("." + suffix):
            return sorted(a for a in attrs if isinstance(getattr(module, a, None), int))
    return []


def _head(model: nn.Module) -> List[Dict[str, Dict[str, bool]]]:
    """The LM head entry, by the head's own name (GPT-NeoX renamed `embed_out` to `lm_head` in
    transformers 5); none for a base model (LlamaModel, GPT2Model) that has no head."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if head is None:
        return []
    name = next((n for n, m in model.named_modules() if m is head), None)
    return [{name: _LM_HEAD_SPLIT}] if name else []


def gpt2_tpinfo(model: nn.Module) -> TPInfo:
    """GPT-2: Conv1D weights ([in, out]), fused q|k|v split per block (stride 3), LM head tied to wte."""
    tpinfo = TPInfo()
    tpinfo.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc", *_head(model))
    tpinfo.shard_row("attn.c_proj", "mlp.c_proj")
    tpinfo.shard_vocab("wte")
    tpinfo.replic_drop("attn.resid_dropout", "mlp.dropout", "drop")
    tpinfo.parallel_drop("attn")
    # GPT2Attention splits c_attn's output with split_size; the other two keep it consistent.
    tpinfo.shrink({"attn": _present(model, "attn", ("embed_dim", "split_size", "num_heads"))})
    return tpinfo


def opt_tpinfo(model: nn.Module) -> TPInfo:
    """OPT: separate q/k/v (attention reshapes with num_heads), fc1/fc2, LM head tied to embed_tokens.

    OPT's residual and activation dropouts are functional (not modules): they draw from the
    stream the tensor group shares, in which the sharded model's whole forward runs
    (`randomizer.fork_model_rng`). The attention-probability dropout is functional too, inside
    the split attention module, which forks the per-rank stream.
    """
    tpinfo = TPInfo()
    tpinfo.shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1", *_head(model))
    tpinfo.shard_row("self_attn.out_proj", "fc2")
    tpinfo.shard_vocab("embed_tokens")
    tpinfo.parallel_drop("self_attn")
    tpinfo.shrink({"self_attn": _present(model, "self_attn", ("num_heads", "embed_dim"))})
    return tpinfo


def falcon_tpinfo(model: nn.Module) -> TPInfo:
    """Falcon: fused query_key_value laid out per head ([q k v] per head) or per kv group ([q.. k v] per group
    with new_decoder_architecture), so a plain split keeps whole heads or groups; multi-query (one kv head
    shared by all query heads) cannot be split."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture",
                                                                                   False):
        raise ValueError("tensor parallel: Falcon with multi_query=True (one key/value head shared by every query "
                         "head, new_decoder_architecture=False) cannot be split over ranks; use a config with "
                         "new_decoder_architecture=True or multi_query=False, or pass your own TPInfo")
    if config is not None and getattr(config, "alibi", False):
        raise ValueError("tensor parallel: Falcon with alibi=True is not supported (its ALiBi bias is built for all "
                         "heads inside the attention module); pass your own TPInfo")
    tpinfo = TPInfo()
    tpinfo.shard_col("self_attention.query_key_value", "mlp.dense_h_to_4h", *_head(model))
    tpinfo.shard_row("self_attention.dense", "mlp.dense_4h_to_h")
    tpinfo.shard_vocab("word_embeddings")
    tpinfo.parallel_drop("self_attention")
    tpinfo.shrink({"self_attention": _present(model, "self_attention", ("num_heads", "num_kv_heads"))})
    return tpinfo


def bloom_tpinfo(model: nn.Module) -> TPInfo:
    """BLOOM: fused query_key_value laid out per head; the ALiBi bias the model builds for all heads is sliced
    to this rank's heads on its way into each attention module."""
    tpinfo = TPInfo()
    tpinfo.shard_col("self_attention.query_key_value", "mlp.dense_h_to_4h", *_head(model))
    tpinfo.shard_row("self_attention.dense", "mlp.dense_4h_to_h")
    tpinfo.shard_vocab("word_embeddings")
    tpinfo.parallel_drop("self_attention")
    tpinfo.shrink({"self_attention": _present(model, "self_attention", ("num_heads", "hidden_size", "split_size"))})
    tpinfo.split_head_inputs({"self_attention": ("alibi",)})
    return tpinfo


def llama_tpinfo(model: nn.Module) -> TPInfo:
    """Llama and the models built like it: transformers' own plan, translated (kept for `get_llama_tpinfo`)."""
    return tpinfo_from_transformers_plan(model)


# Hand-written plans, only for architectures transformers ships no plan for.
TP_PRESETS: Dict[str, Callable[[nn.Module], TPInfo]] = {
    "gpt2": gpt2_tpinfo,
    "opt": opt_tpinfo,
    "falcon": falcon_tpinfo,
    "bloom": bloom_tpinfo,
}


# Architectures whose transformers plan cannot be honoured by splitting weights (found by running
# every family with a plan on 2 ranks against the unsharded model, tests/distributed/test_tp_families.py).
PLANS_THAT_GIVE_WRONG_RESULTS: Dict[str, str] = {
    "codegen": "CodeGen's fused qkv_proj output is split into 4 groups by a constant of its forward (mp_num=4), so "
               "a column split of qkv_proj hands each rank pieces of every group instead of whole heads (the "
               "plan's 'colwise' gave logits 62% off the unsharded model's on 2 ranks)",
}


def tpinfo_for_model(model: nn.Module) -> TPInfo:
    """The TPInfo for `model`: a hand preset for its `config.model_type`, else its transformers plan.

    ValueError when there is neither, or when the plan is known to give wrong results
    (PLANS_THAT_GIVE_WRONG_RESULTS), naming the presets and how to pass a TPInfo.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PLANS_THAT_GIVE_WRONG_RESULTS:
        raise ValueError(f"tensor parallel: no tensor-parallel plan for model_type={model_type!r} "
                         f"({type(model).__name__}): {PLANS_THAT_GIVE_WRONG_RESULTS[model_type]}. Pass your own "
                         "TPInfo ('tensor_parallel', {'tpinfo': ...}) or leave tensor parallelism out for this model")
    preset = TP_PRESETS.get(model_type) if model_type is not None else None
    if preset is not None:
        return preset(model)
    if has_transformers_plan(model):
        return tpinfo_from_transformers_plan(model)
    raise ValueError(f"no tensor-parallel preset for model_type={model_type!r} ({type(model).__name__}) and no "
                     f"transformers plan (config.base_model_tp_plan); presets exist for {sorted(TP_PRESETS)}. Pass "
                     "your own TPInfo: ('tensor_parallel', {'tpinfo': TPInfo()...})")
