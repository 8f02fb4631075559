"""Ready-made TPInfo for Hugging Face model families, found by `config.model_type`.

Each preset is a function of the model, not a constant, so it can follow the installed
transformers version: attributes that attention modules use to reshape (older releases kept
`num_heads` / `hidden_size` on Llama attention; 5.x reshapes with -1) are shrunk only where
they exist. `resolve_tp_plan` still checks every suffix against the model.

Choices shared by all presets: the LM head keeps its output split over the vocabulary and
the model's loss becomes the vocabulary-parallel cross entropy (no rank holds full logits;
`output.logits` is this rank's vocabulary slice, `gather_tp_logits` rebuilds it). The
attention module forks the per-rank dropout stream (its attention-probability dropout is
functional, on this rank's heads); dropouts on the replicated residual stream fork the
stream shared by the tensor group.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List

from torch import nn

from atorch.utils.manual_tp_utils import TPInfo

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


def llama_tpinfo(model: nn.Module) -> TPInfo:
    """Llama and the models built like it (Mistral, Qwen2): separate q/k/v (kv heads split too), gate/up/down."""
    tpinfo = TPInfo()
    tpinfo.shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                     *_head(model))
    tpinfo.shard_row("self_attn.o_proj", "mlp.down_proj")
    tpinfo.shard_vocab("embed_tokens")
    tpinfo.parallel_drop("self_attn")
    reshaping = _present(model, "self_attn", ("num_heads", "num_key_value_heads", "hidden_size"))
    if reshaping:
        tpinfo.shrink({"self_attn": reshaping})
    return tpinfo


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


def gpt_neox_tpinfo(model: nn.Module) -> TPInfo:
    """GPT-NeoX: query_key_value is laid out head by head ([q k v] per head), so a plain split keeps whole heads."""
    tpinfo = TPInfo()
    tpinfo.shard_col("attention.query_key_value", "mlp.dense_h_to_4h", *_head(model))
    tpinfo.shard_row("attention.dense", "mlp.dense_4h_to_h")
    tpinfo.shard_vocab("embed_in")
    tpinfo.replic_drop("emb_dropout", "post_attention_dropout", "post_mlp_dropout")
    tpinfo.parallel_drop("attention")
    reshaping = _present(model, "attention", ("num_attention_heads", "hidden_size"))
    if reshaping:
        tpinfo.shrink({"attention": reshaping})
    return tpinfo


TP_PRESETS: Dict[str, Callable[[nn.Module], TPInfo]] = {
    "llama": llama_tpinfo,
    "mistral": llama_tpinfo,
    "qwen2": llama_tpinfo,
    "gpt2": gpt2_tpinfo,
    "gpt_neox": gpt_neox_tpinfo,
}


def tpinfo_for_model(model: nn.Module) -> TPInfo:
    """The preset for `model.config.model_type`; ValueError naming the supported types otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    preset = TP_PRESETS.get(model_type)
    if preset is None:
        raise ValueError(f"no tensor-parallel preset for model_type={model_type!r} ({type(model).__name__}); presets "
                         f"exist for {sorted(TP_PRESETS)}. Pass your own TPInfo: "
                         "('tensor_parallel', {'tpinfo': TPInfo()...})")
    return preset(model)
