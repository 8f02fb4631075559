"""train_step refuses token ids the model cannot embed, in any batch (the arguments check reads dataset[0] only).

An id at or above the vocabulary failed inside torch ("index out of range in self"; on a GPU a device-side
assert that ends the process), and a row longer than GPT-2's learned positions the same way.
"""

import pytest
import torch

from atorch.auto import auto_accelerate, train_step
from atorch.auto.token_limits import token_limits
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.parity import TokenDataset


def _result(model):
    status, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, dataset=TokenDataset(n=8, seq_len=16),
                                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    assert status
    return result


def test_an_id_outside_the_vocabulary_is_refused_before_the_forward():
    result = _result(tiny_llama(seed=0))
    vocab = result.model.config.vocab_size
    ids = torch.randint(4, vocab, (4, 16))
    ids[2, 5] = vocab
    with pytest.raises(ValueError, match=rf"train_step: batch\['input_ids'\] holds token id {vocab}, outside "
                                         rf"LlamaForCausalLM's vocabulary of {vocab} ids \(config.vocab_size\); a "
                                         r"tokenizer with more tokens than the model needs model.resize_token_"):
        train_step(result, {"input_ids": ids, "labels": ids})
    ids[2, 5] = -100
    with pytest.raises(ValueError, match=r"holds token id -100, outside .* padding or ignored positions belong in "
                                         r"labels \(-100\), not in input_ids"):
        train_step(result, {"input_ids": ids, "labels": ids})
    assert all(p.grad is None for p in result.model.parameters())
    ids[2, 5] = vocab - 1
    assert torch.isfinite(train_step(result, {"input_ids": ids, "labels": ids}))


def test_a_row_longer_than_learned_positions_is_refused():
    result = _result(tiny_gpt2(seed=0))
    vocab, (field, limit) = token_limits(result.model)
    assert field == "n_positions" and vocab == result.model.config.vocab_size
    ids = torch.randint(4, vocab, (2, limit + 1))
    with pytest.raises(ValueError, match=rf"train_step: batch\['input_ids'\] has {limit + 1} tokens per row, more "
                                         rf"than GPT2LMHeadModel's n_positions={limit}; cut the sequences"):
        train_step(result, {"input_ids": ids, "labels": ids})


def test_an_embedding_resized_beyond_the_config_embeds_its_ids():
    model = tiny_llama(seed=0)
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8)
    model.config.vocab_size = vocab      # as if resized without the config following
    assert token_limits(model)[0] == vocab + 8


def test_labels_neither_ignored_nor_in_the_vocabulary_are_refused_before_the_forward():
    """-1 as padding (or an id past the vocabulary) in labels: torch's cross entropy raised a bare IndexError here;
    tensor_parallel's vocabulary-parallel loss scored it silently wrong, and a pipeline hung (2-rank cases in
    tests/distributed/test_bad_inputs_distributed.py)."""
    result = _result(tiny_llama(seed=0))
    vocab = result.model.config.vocab_size
    ids = torch.randint(4, vocab, (4, 16))
    labels = ids.clone()
    for bad in (-1, vocab, 10 ** 6):
        labels[:, -2:] = bad
        with pytest.raises(ValueError, match=rf"train_step: batch\['labels'\] holds {bad}, outside the vocabulary "
                                             rf"of {vocab} \(ignored positions must be -100\)"):
            train_step(result, {"input_ids": ids, "labels": labels})
    assert all(p.grad is None for p in result.model.parameters())
    labels[:, -2:] = -100
    assert torch.isfinite(train_step(result, {"input_ids": ids, "labels": labels}))
    # A loss_func of the user's does not change it: a causal LM's forward computes its own loss from labels anyway.
    status, own, _ = auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW,
                                     dataset=TokenDataset(n=8, seq_len=16), dataloader_args={"batch_size": 4},
                                     loss_func=lambda batch, output: output.logits.float().pow(2).mean(),
                                     load_strategy=["parallel_mode"])
    labels[:, -2:] = -1
    with pytest.raises(ValueError, match=r"train_step: batch\['labels'\] holds -1"):
        train_step(own, {"input_ids": ids, "labels": labels})


class _PaddedWithMinusOne(TokenDataset):
    def __getitem__(self, i):
        sample = dict(super().__getitem__(i))
        sample["labels"] = sample["labels"].clone()
        sample["labels"][-2:] = -1
        return sample


def test_dataset_labels_outside_the_vocabulary_are_refused_before_anything_is_applied():
    vocab = tiny_llama(seed=0).config.vocab_size
    with pytest.raises(ValueError, match=rf"dataset\[0\]\['labels'\] holds -1, outside the vocabulary of {vocab} "
                                         r"\(ignored positions must be -100\)"):
        auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=_PaddedWithMinusOne(n=8),
                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    # ids beyond the vocabulary in dataset[0] too (before: at the first train_step)
    dataset = TokenDataset(n=8)
    dataset.tokens[0, 3] = vocab
    with pytest.raises(ValueError, match=rf"dataset\[0\]\['input_ids'\] holds token id {vocab}, outside"):
        auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=dataset,
                        dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
