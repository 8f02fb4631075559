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
