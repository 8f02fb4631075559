"""Dataset samples a Hugging Face model cannot be called with are refused at the arguments check, and a
batch of samples of unequal lengths says how to pad them (each failed deep inside torch or transformers)."""

import pytest
import torch
from torch.utils.data import Dataset

from atorch.auto import auto_accelerate
from atorch.auto.arguments import check_sample_format
from atorch.auto.engine import stack_samples
from atorch.testing import tiny_llama


class Samples(Dataset):
    def __init__(self, make):
        self.make = make

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.make(i)


def test_a_tuple_sample_under_the_default_format_is_refused_for_a_hugging_face_model():
    ids = torch.randint(4, 100, (16,))
    with pytest.raises(TypeError, match=r"dataset\[0\] is tuple .* passed to the model as one argument, which "
                                        r"LlamaForCausalLM cannot take: return a dict .* model_input_format="
                                        r"'unpack_sequence'"):
        check_sample_format(Samples(lambda i: (ids, ids)), None, {}, None, tiny_llama())
    check_sample_format(Samples(lambda i: (ids, ids)), "unpack_sequence", {}, None, tiny_llama())
    check_sample_format(Samples(lambda i: (ids, ids)), None, {}, None, torch.nn.Linear(2, 2))   # a model of one's own


def test_an_untokenized_text_sample_is_refused_naming_the_key():
    with pytest.raises(TypeError, match=r"dataset\[0\] has keys \['text'\], none of which LlamaForCausalLM.forward "
                                        r"takes; it needs 'input_ids' .* \('text' holds text: tokenize it first"):
        check_sample_format(Samples(lambda i: {"text": "hello"}), None, {}, None, tiny_llama())
    # A collate_fn (or prepare_input) may tokenize it: left to them.
    check_sample_format(Samples(lambda i: {"text": "hello"}), None, {"collate_fn": list}, None, tiny_llama())


def test_samples_of_unequal_lengths_say_how_to_pad():
    with pytest.raises(ValueError, match=r"dataloader: the samples of one batch differ in length .* pass "
                                         r"dataloader_args=\{'collate_fn': ...\} that pads each batch"):
        stack_samples([{"input_ids": torch.ones(3, dtype=torch.long)}, {"input_ids": torch.ones(5, dtype=torch.long)}])
    batch = stack_samples([{"input_ids": torch.ones(3, dtype=torch.long)}] * 2)
    assert batch["input_ids"].shape == (2, 3)
    ragged = Samples(lambda i: {"input_ids": torch.randint(4, 100, (8 + i,)), "labels": torch.randint(4, 100, (8 + i,))})
    status, result, _ = auto_accelerate(tiny_llama(), optim_func=torch.optim.AdamW, dataset=ragged,
                                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    with pytest.raises(ValueError, match=r"differ in length"):
        next(iter(result.dataloader))
