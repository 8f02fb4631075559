"""Model builders on the meta device (tiny Llama is real, as benchmarks/space_enumeration.py does)."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, GPT2Config


def _meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build(name):
    if name == "tiny":
        from atorch.testing import tiny_llama
        return tiny_llama()
    if name == "llama1b":
        return _meta(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                                 num_key_value_heads=4, vocab_size=32000))
    if name == "llama7b":
        return _meta(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, vocab_size=32000))
    if name == "mixtral":
        return _meta(MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
    if name == "gpt2":
        return _meta(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257))
    raise ValueError(name)
