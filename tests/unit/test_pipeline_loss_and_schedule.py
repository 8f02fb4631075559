"""The native pipeline's loss and schedule rules, without processes: each micro-batch contributes its summed
token losses over the whole batch's predicted tokens, so padded micro-batches add up to the unsplit loss and
gradient (fp32, same kernels: atol 1e-6); 1F1B's chunk rule is torch's, refused before any collective."""

import pytest
import torch

from atorch.modules.pipeline.batches import CausalLMLoss, causal_lm_loss
from atorch.modules.pipeline.native import NativePipeline, check_schedule_chunks, predicted_tokens, summed_token_loss


def test_micro_batch_shares_add_up_to_the_batch_token_mean_with_padded_labels():
    torch.manual_seed(0)
    logits = torch.randn(4, 8, 16, requires_grad=True)
    labels = torch.randint(0, 16, (4, 8))
    labels[2:, 3:] = -100                       # the second micro-batch is mostly padding
    whole = causal_lm_loss(logits, labels)
    (expected,) = torch.autograd.grad(whole, logits)
    tokens = predicted_tokens(labels)
    assert int(tokens) == 2 * 7 + 2 * 2
    shares = [summed_token_loss(logits[r:r + 2], labels[r:r + 2]) / tokens for r in (0, 2)]
    (got,) = torch.autograd.grad(sum(shares), logits)
    torch.testing.assert_close(sum(shares), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    means = torch.stack([causal_lm_loss(logits[r:r + 2], labels[r:r + 2]) for r in (0, 2)]).mean()
    assert abs(means.item() - whole.item()) > 0.1          # what averaging micro-batch means gives instead
    nothing = torch.full_like(labels, -100)
    assert summed_token_loss(logits, nothing).item() == 0.0  # no predicted token: 0, not 0 / 0


def test_1f1b_needs_a_micro_batch_per_stage():
    check_schedule_chunks("1f1b", 4, 4)
    check_schedule_chunks("gpipe", 1, 4)
    with pytest.raises(ValueError, match=r"schedule='1f1b' needs at least one micro-batch per stage, but chunks=3 is "
                                         r"fewer than the 4 pipeline stages; set chunks >= 4"):
        check_schedule_chunks("1f1b", 3, 4)


def test_labels_of_another_sequence_length_name_both_shapes():
    """Before: cross_entropy's "Expected input batch_size (30) to match target batch_size (62)" (token counts)."""
    logits, labels = torch.randn(2, 16, 32), torch.randint(0, 32, (2, 32))
    expected = r"the labels of shape \(2, 32\) do not fit the logits of shape \(2, 16, 32\): .* labels of shape \(2, 16\)"
    for loss in (causal_lm_loss, CausalLMLoss(), summed_token_loss):
        with pytest.raises(ValueError, match=expected):
            loss(logits, labels)
    # The native pipeline's last stage, where its logits (from the first stage's input_ids) meet this rank's labels.
    pipeline = object.__new__(NativePipeline)
    pipeline.loss_fn, pipeline.chunks, pipeline._batch_tokens = None, 2, torch.tensor(30)
    with pytest.raises(ValueError, match=expected + r".*were given batches of different shapes at this step"):
        pipeline._micro_batch_loss(logits, labels)
    assert pipeline._micro_batch_loss(logits, labels[:, :16]).shape == ()
