"""train_step(loss_weighting="tokens") in one process: gradient accumulation over padded micro-batches of very
unequal lengths trains exactly as one step on the whole batch's token mean (and "rows", the default, does not),
the label tokens are counted as the installed transformers' causal-LM loss counts them, and every case it cannot
weight is a ValueError naming the option. The data-parallel cases are in tests/distributed/test_train_step.py."""

import importlib
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.train_step import label_tokens, train_step, train_step_stats, uses_the_models_loss
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset

LR, STEPS, ROWS, SEQ = 0.5, 2, 4, 16
# fp32: the accumulated gradient is the whole batch's up to the summation order (observed: losses equal, the
# trained weights' update off by 1.6e-7 of its size; "rows" is off by 1.29 of it).
REL = 1e-6


def padded_batch(lengths: List[int], seed: int) -> Dict[str, torch.Tensor]:
    """Rows of `lengths` real tokens, right-padded to SEQ: pad id 3, labels -100 and attention 0 on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 20, (len(lengths), SEQ), generator=g)
    real = torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": ids.masked_fill(~real, 3), "attention_mask": real.long(),
            "labels": ids.masked_fill(~real, -100)}


# The first micro-batch (2 rows) is long, the second short: 30 and 4 predicted tokens.
BATCHES = [padded_batch([16, 16, 3, 3], seed=s) for s in range(STEPS)]


def _update_error(model: nn.Module, reference: nn.Module, start: nn.Module) -> float:
    """|trained - reference| / |reference - start| over all weights: the error relative to the update."""
    mine, ref, first = (dict(m.named_parameters()) for m in (model, reference, start))
    diff = sum(float((mine[n].detach() - ref[n].detach()).pow(2).sum()) for n in ref)
    update = sum(float((ref[n].detach() - first[n].detach()).pow(2).sum()) for n in ref)
    return (diff / update) ** 0.5


def _reference() -> Tuple[List[float], nn.Module]:
    model = tiny_llama(seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in BATCHES:
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def _accumulated(loss_weighting: str) -> Tuple[List[float], nn.Module]:
    status, result, _ = auto_accelerate(tiny_llama(seed=0), torch.optim.SGD, TokenDataset(n=8, seq_len=SEQ),
                                        optim_args={"lr": LR}, dataloader_args={"batch_size": ROWS},
                                        model_input_format="unpack_dict", load_strategy=[])
    assert status
    losses = [train_step(result, batch, gradient_accumulation_steps=2, loss_weighting=loss_weighting).item()
              for batch in BATCHES]
    return losses, result.model


def test_accumulating_by_tokens_trains_as_one_step_on_the_batch_token_mean():
    ref_losses, ref_model = _reference()
    start = tiny_llama(seed=0)
    losses, model = _accumulated("tokens")
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert _update_error(model, ref_model, start) < REL
    # The default weighs the two micro-batches alike: the short one's 4 tokens count as much as the long one's 30.
    row_losses, row_model = _accumulated("rows")
    assert _update_error(row_model, ref_model, start) > 0.5
    assert abs(row_losses[0] - ref_losses[0]) > 1e-4 * ref_losses[0]


def test_label_tokens_are_counted_as_the_models_loss_counts_them():
    model = tiny_llama(seed=0)
    batch = BATCHES[0]
    assert int(label_tokens(batch)) == 15 + 15 + 2 + 2      # labels[..., 1:] != -100
    out = model(**batch)
    summed = nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                         batch["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    assert float(out.loss.detach()) * int(label_tokens(batch)) == pytest.approx(float(summed), rel=1e-6)
    # transformers' ForCausalLMLoss takes a batch's shift_labels as they are, unshifted.
    shift = batch["labels"].clone()
    shift[:, -4:] = -100
    assert int(label_tokens({**batch, "shift_labels": shift})) == int((shift != -100).sum())
    assert label_tokens({"input_ids": batch["input_ids"]}) is None


@pytest.fixture(scope="module")
def llama_result():
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.0}, dataloader_args={"batch_size": 4},
                                        model_input_format="unpack_dict", load_strategy=[])
    assert status
    return result


def test_the_options_mistakes_are_named(llama_result):
    batch = BATCHES[0]
    with pytest.raises(ValueError, match=r"loss_weighting='token' must be one of \['rows', 'tokens'\]"):
        train_step(llama_result, batch, loss_weighting="token")
    with pytest.raises(ValueError, match=r"loss_weighting='tokens' counts the label tokens .* has no 'labels'"):
        train_step(llama_result, {"input_ids": batch["input_ids"]}, loss_weighting="tokens")
    assert uses_the_models_loss(llama_result)


def test_a_loss_of_the_users_or_a_model_that_is_no_causal_lm_is_refused():
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        loss_func=lambda batch, out: out.loss, optim_args={"lr": 0.0},
                                        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict",
                                        load_strategy=[])
    assert status and not uses_the_models_loss(result)
    with pytest.raises(ValueError, match=r"loss_weighting='tokens' .* auto_accelerate was given a loss_func"):
        train_step(result, BATCHES[0], loss_weighting="tokens")
    plain = AutoAccelerateResult(model=nn.Linear(2, 2), optim=None, dataloader=None, loss_func=lambda b, o: o.sum(),
                                 prepare_input=lambda b, d=None: b)
    with pytest.raises(ValueError, match=r"loss_weighting='tokens' .* the model is a Linear, not a Hugging Face "
                                         r"causal LM"):
        train_step(plain, torch.zeros(2, 2), loss_weighting="tokens")


def test_deepspeed_3d_is_refused_before_its_step():
    def step(result, batch):
        raise AssertionError("the engine's step ran")

    result = AutoAccelerateResult(model=tiny_llama(), optim=None, dataloader=None, loss_func=lambda b, o: o.loss,
                                  prepare_input=lambda b, d=None: b, custom_train_step=step)
    with pytest.raises(ValueError, match=r"loss_weighting='tokens' is not available under deepspeed_3d_parallel"):
        train_step_stats(result, BATCHES[0], loss_weighting="tokens")


def test_ranks_compare_the_weighting_at_the_first_call(monkeypatch):
    """A rank weighting by tokens runs an all-reduce of the counts that a rank weighting by rows never joins: the
    first call's vote names the difference on every rank (the default stays out of the vote, as before)."""
    train_step_module = importlib.import_module("atorch.auto.train_step")

    votes: List[Dict[str, str]] = []
    monkeypatch.setattr(train_step_module, "agree_on_values", lambda what, values: votes.append(dict(values)))
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.0}, dataloader_args={"batch_size": 4},
                                        model_input_format="unpack_dict", load_strategy=[])
    assert status
    train_step(result, BATCHES[0], loss_weighting="tokens")
    assert votes == [{"gradient_accumulation_steps": "1", "max_grad_norm": "None", "loss_weighting": "'tokens'"}]
