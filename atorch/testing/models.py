"""Tiny Hugging Face models built from configs (the hub is never used).

Sizes are chosen so every parallel degree used in tests (2 and 4) divides heads, kv heads,
hidden and intermediate sizes, and the vocabulary covers every id of the bundled tokenizer.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

# The size the bundled tokenizer was trained to (scripts/train_tokenizer.py); the small corpus filled only 845 entries
# (ids 0..844), so every id it produces fits; the tokenizer never produces ids 845..1023.
TINY_VOCAB_SIZE = 1024


def tiny_llama_config(num_hidden_layers: int = 2, **overrides) -> LlamaConfig:
    kwargs: Dict[str, Any] = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=3)
    kwargs.update(overrides)
    config = LlamaConfig(**kwargs)
    config._attn_implementation = overrides.get("attn_implementation", "eager")
    return config


def tiny_gpt2_config(n_layer: int = 2, **overrides) -> GPT2Config:
    kwargs: Dict[str, Any] = dict(vocab_size=TINY_VOCAB_SIZE, n_embd=64, n_layer=n_layer, n_head=4, n_positions=256,
                  n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    kwargs.update(overrides)
    config = GPT2Config(**kwargs)
    config._attn_implementation = overrides.get("attn_implementation", "eager")
    return config


def tiny_bert_config(num_hidden_layers: int = 2, **overrides) -> BertConfig:
    """An encoder whose masked-LM head is tied to its word embedding (BERT names its embedding in
    `_no_split_modules` next to its layers), without dropout so that runs compare exactly."""
    kwargs: Dict[str, Any] = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                                  max_position_embeddings=256, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def tiny_bert_mlm(seed: int = 0, **overrides) -> BertForMaskedLM:
    torch.manual_seed(seed)
    return BertForMaskedLM(tiny_bert_config(**overrides))


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(**overrides))
