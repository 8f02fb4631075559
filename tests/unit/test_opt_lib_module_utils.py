"""Transformer-block detection: the unit FSDP wraps and checkpointing recomputes."""

import pytest
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from atorch.testing import tiny_gpt2, tiny_llama
from atorch.utils.module_utils import find_transformer_block_classes, modules_of_classes, resolve_module_classes


class _Stack(nn.Module):
    """No `_no_split_modules`: the largest uniform ModuleList decides."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.ReLU()])
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Tanh(), nn.GELU()])


def test_hf_models_use_no_split_modules():
    assert find_transformer_block_classes(tiny_llama()) == [LlamaDecoderLayer]
    assert find_transformer_block_classes(tiny_gpt2()) == [GPT2Block]


def test_plain_model_uses_largest_uniform_module_list():
    assert find_transformer_block_classes(_Stack()) == [nn.Linear]
    assert find_transformer_block_classes(nn.Linear(2, 2)) == []


def test_resolve_names_and_classes():
    model = tiny_llama()
    assert resolve_module_classes(model, None) == [LlamaDecoderLayer]
    assert resolve_module_classes(model, ["LlamaMLP", LlamaDecoderLayer]) == [LlamaMLP, LlamaDecoderLayer]
    assert len(modules_of_classes(model, [LlamaDecoderLayer])) == 2
    with pytest.raises(ValueError, match=r"'NoSuchBlock'.*LlamaDecoderLayer"):
        resolve_module_classes(model, ["NoSuchBlock"])
    with pytest.raises(ValueError, match="must be an nn.Module subclass"):
        resolve_module_classes(model, [3])
