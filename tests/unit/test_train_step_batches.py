"""train_step refuses a batch the model cannot train on before its forward, naming the key, what it holds and
what is expected (these failed deep inside torch or transformers), and keeps every batch that trains today."""

import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate, train_step
from atorch.auto.train_step import check_batch, is_causal_lm, takes_token_ids
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset


@pytest.fixture(scope="module")
def llama_result():
    torch.manual_seed(0)
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.0}, dataloader_args={"batch_size": 4},
                                        model_input_format="unpack_dict", load_strategy=[])
    assert status
    return result


def _ids():
    return torch.randint(0, 100, (4, 8))


BAD = [
    ("float input_ids", lambda ids: {"input_ids": ids.float(), "labels": ids},
     r"batch\['input_ids'\] is a float32 tensor of shape \(4, 8\); input_ids must be an integer tensor"),
    ("float labels", lambda ids: {"input_ids": ids, "labels": ids.float()},
     r"batch\['labels'\] is a float32 tensor of shape \(4, 8\); labels must be an integer tensor"),
    ("0 rows", lambda ids: {"input_ids": ids[:0], "labels": ids[:0]}, r"the batch has 0 rows"),
    ("1-D", lambda ids: {"input_ids": ids[0], "labels": ids[0]},
     r"batch\['input_ids'\] is a int64 tensor of shape \(8,\); .* of shape \[rows, tokens\]"),
    ("labels shorter", lambda ids: {"input_ids": ids, "labels": ids[:, :4]},
     r"batch\['labels'\] has shape \(4, 4\) but batch\['input_ids'\] has shape \(4, 8\)"),
    ("uint8 input_ids", lambda ids: {"input_ids": ids.to(torch.uint8), "labels": ids},
     r"batch\['input_ids'\] is a uint8 tensor of shape \(4, 8\); input_ids must be int64 or int32 \(an embedding "
     r"takes int64 or int32 ids\): convert it with .long\(\)"),
    ("int32 labels", lambda ids: {"input_ids": ids, "labels": ids.int()},
     r"batch\['labels'\] is a int32 tensor of shape \(4, 8\); labels must be int64 \(the loss takes int64 targets\)"),
    ("python lists", lambda ids: {"input_ids": ids.tolist(), "labels": ids.tolist()},
     r"batch\['input_ids'\] is a list \(a Hugging Face datasets.Dataset yields lists: use "
     r"dataset.with_format\('torch'\), or a collate_fn that builds tensors\); input_ids must be an integer tensor"),
]


@pytest.mark.parametrize("name,make,message", BAD, ids=[b[0] for b in BAD])
def test_a_batch_the_model_cannot_take_is_named_before_the_forward(llama_result, name, make, message):
    with pytest.raises(ValueError, match="train_step: " + message):
        train_step(llama_result, make(_ids()))


def test_every_batch_that_trains_today_still_does(llama_result):
    ids = _ids()
    mask = torch.ones_like(ids)
    positions = torch.arange(8).expand(4, 8)
    labels = ids.clone()
    labels[:, :2] = -100
    for batch in ({"input_ids": ids, "labels": labels},
                  {"input_ids": ids.int(), "labels": ids, "attention_mask": mask, "position_ids": positions},
                  {"inputs_embeds": torch.randn(4, 8, 64), "labels": ids}):
        assert torch.isfinite(train_step(llama_result, batch))
    assert torch.isfinite(train_step(llama_result, {"input_ids": ids, "labels": ids}, gradient_accumulation_steps=2))


def test_other_models_labels_and_batch_forms_are_theirs():
    # Sequence classification (a class or a float target per row) and seq2seq labels are not a causal LM's.
    ids = _ids()
    check_batch({"input_ids": ids, "labels": torch.randn(4)}, causal_lm=False)
    check_batch({"input_ids": ids, "labels": ids[:, :3]}, causal_lm=False)
    check_batch({"x": torch.ones(2, 4), "target": [1.0, 2.0]}, causal_lm=True)   # a custom loss's keys
    check_batch((torch.ones(2, 4), torch.ones(2)), causal_lm=True)                 # unpack_sequence / whole
    check_batch(torch.ones(2, 4), causal_lm=True)
    with pytest.raises(ValueError, match="the batch has 0 rows"):
        check_batch((torch.ones(0, 4),), causal_lm=False)
    assert is_causal_lm(tiny_llama()) and is_causal_lm(nn.parallel.DataParallel(tiny_llama()))
    assert not is_causal_lm(nn.Linear(2, 2))


def _named(name: str, module: str) -> nn.Module:
    """An instance of a module class called `name`, defined in `module` (a stand-in for a library's model)."""
    return type(name, (nn.Linear,), {"__module__": module})(2, 2)


def test_only_hugging_face_models_token_ids_and_causal_lms_labels_are_checked():
    # A model of the user's own may mean anything by `input_ids` (flat ids with offsets for an EmbeddingBag).
    bag = nn.EmbeddingBag(10, 4)
    assert not takes_token_ids(bag) and not is_causal_lm(bag)
    check_batch({"input_ids": torch.arange(10), "offsets": torch.tensor([0, 4])}, causal_lm=False,
                token_ids=takes_token_ids(bag))
    check_batch({"input_ids": torch.randn(2, 3)}, causal_lm=False, token_ids=False)
    assert takes_token_ids(tiny_llama()) and takes_token_ids(nn.parallel.DataParallel(tiny_llama()))
    # XLNet's LM head predicts the target_mapping positions: labels [batch, num_predict] are its own.
    xlnet = _named("XLNetLMHeadModel", "transformers.models.xlnet.modeling_xlnet")
    assert takes_token_ids(xlnet) and not is_causal_lm(xlnet)
    ids = _ids()
    check_batch({"input_ids": ids, "labels": ids[:, :1]}, causal_lm=is_causal_lm(xlnet), token_ids=True)
    assert is_causal_lm(_named("GPT2LMHeadModel", "transformers.models.gpt2.modeling_gpt2"))
    # A causal LM with codebooks (MusicGen): labels [batch, sequence, codebooks] against 2-D input_ids.
    check_batch({"input_ids": ids, "labels": torch.randint(0, 9, (4, 8, 4))}, causal_lm=True)


def test_the_batch_digest_tells_batches_apart_by_contents_shape_and_place():
    from atorch.auto.train_step import batch_digest

    ids = torch.arange(12).reshape(3, 4)
    batch = {"input_ids": ids, "labels": ids.clone(), "n": 3}
    assert batch_digest(batch) == batch_digest({"labels": ids.clone(), "n": 3, "input_ids": ids.clone()})
    assert batch_digest(batch) != batch_digest({**batch, "labels": ids.roll(1, dims=0)})       # other rows
    assert batch_digest(batch) != batch_digest({**batch, "labels": ids.reshape(4, 3)})         # same bytes
    assert batch_digest(batch) != batch_digest({**batch, "labels": ids.to(torch.int32)})
    assert batch_digest(batch) != batch_digest({"input_ids": ids.clone(), "targets": ids.clone(), "n": 3})
    assert batch_digest(batch) != batch_digest({**batch, "n": 4})
    assert batch_digest([ids, ids]) != batch_digest([ids, ids + 1])
    meta = torch.empty(3, 4, device="meta")
    assert batch_digest({"x": meta}) == batch_digest({"x": torch.empty(3, 4, device="meta")})
    assert batch_digest(torch.zeros(2, 2, dtype=torch.bfloat16)) != batch_digest(torch.ones(2, 2, dtype=torch.bfloat16))
