"""Tiny configs of every architecture family the tensor-parallel tests cover (the hub is never used).

Sizes: hidden 64, 4 query heads with 2 key/value heads where the family has grouped-query
attention, 2 layers, so a tensor size of 2 divides every head count and width. Dropout is
off (the dropout streams have their own tests). Some vocabularies are odd (1001, 1003), so
the LM head's vocabulary padding is exercised too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

COMMON: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)


def _llama_like(config_cls_name: str, **extra: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        kwargs = dict(COMMON, vocab_size=1024, num_key_value_heads=2, tie_word_embeddings=False)
        kwargs.update(extra)
        return getattr(transformers, config_cls_name)(**kwargs)
    return make


def _gpt2() -> Any:
    from atorch.testing.models import tiny_gpt2_config

    return tiny_gpt2_config(vocab_size=1003)


def _gpt_neox() -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0, **COMMON)


def _opt() -> Any:
    from transformers import OPTConfig

    return OPTConfig(vocab_size=1024, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                     pad_token_id=1)


def _falcon() -> Any:
    from transformers import FalconConfig

    return FalconConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        new_decoder_architecture=False, multi_query=False, alibi=False, hidden_dropout=0.0,
                        attention_dropout=0.0, parallel_attn=True, bias=True)


def _bloom() -> Any:
    from transformers import BloomConfig

    return BloomConfig(vocab_size=1001, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)


def _mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=1024, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=False, **COMMON)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # Layer 1 is a dense MLP (mlp_only_layers), layer 0 a mixture of experts.
    # head_dim is accepted at run time (transformers' config takes extra attributes) but absent from the
    # generated __init__ signature the checker reads.
    return Qwen3MoeConfig(vocab_size=1024, num_key_value_heads=2, head_dim=16, num_experts=4,  # type: ignore[call-arg]
                          num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1], decoder_sparse_step=1,
                          tie_word_embeddings=False, **COMMON)


FAMILIES: Dict[str, Callable[[], Any]] = {
    "llama": _llama_like("LlamaConfig"),
    "mistral": _llama_like("MistralConfig"),
    "qwen2": _llama_like("Qwen2Config"),
    "qwen3": _llama_like("Qwen3Config", head_dim=16),
    "gemma": _llama_like("GemmaConfig", head_dim=16, tie_word_embeddings=True, vocab_size=1001),
    "gemma2": _llama_like("Gemma2Config", head_dim=16, tie_word_embeddings=True, final_logit_softcapping=30.0,
                          attn_logit_softcapping=50.0, query_pre_attn_scalar=16),
    "phi3": _llama_like("Phi3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "falcon": _falcon,
    "bloom": _bloom,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}


def family_config(name: str) -> Any:
    config = FAMILIES[name]()
    config._attn_implementation = "eager"
    return config


def build_family(name: str, seed: int = 0) -> Tuple[nn.Module, Any]:
    """`torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)` for family `name`, and its config."""
    from transformers import AutoModelForCausalLM

    config = family_config(name)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager"), config


# More model types with a transformers plan, checked for logits only (tests/distributed/
# test_tp_families.py): tiny configs through `AutoConfig.for_model`, with what each family needs
# beyond COMMON (pad ids inside the vocabulary, a rotary width that fits head_dim 16).
_SMALL: Dict[str, Any] = dict(COMMON, num_key_value_heads=2, vocab_size=1024, head_dim=16, pad_token_id=0)
MORE_PLAN_FAMILIES: Dict[str, Dict[str, Any]] = {
    "gemma3_text": {}, "olmo2": {}, "cohere": {}, "starcoder2": {}, "phi": {}, "granite": {}, "qwen2_moe": {},
    "olmoe": {}, "glm4": {}, "smollm3": {}, "gptj": {"rotary_dim": 8}, "ernie4_5": {}, "exaone4": {},
    "helium": {}, "seed_oss": {}, "nemotron": {}, "phimoe": {},
}
# Model types whose plan atorch refuses, and a phrase of the reason.
REFUSED_PLAN_FAMILIES: Dict[str, Tuple[Dict[str, Any], str]] = {
    "codegen": ({"rotary_dim": 8}, "mp_num=4"),
    "gpt_oss": ({}, "shards no layer of its transformer blocks"),
    "hunyuan_v1_dense": ({}, "shards no layer of its transformer blocks"),
    "llama4_text": ({}, "cannot honour style 'packed_rowwise'"),
    "stablelm": ({}, "no tensor-parallel preset"),
}


def more_family_config(model_type: str) -> Any:
    """The tiny config of a MORE_PLAN_FAMILIES or REFUSED_PLAN_FAMILIES model type (dropout off)."""
    from transformers import AutoConfig

    extra = MORE_PLAN_FAMILIES.get(model_type)
    if extra is None:
        extra = REFUSED_PLAN_FAMILIES[model_type][0]
    config = AutoConfig.for_model(model_type, **_SMALL, **extra)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    config._attn_implementation = "eager"
    return config
