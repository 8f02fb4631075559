"""`clip_grad_norm_` in a hand-written loop under fp16 `amp_native`: the norm of the unscaled gradients.

The gradients carry the loss scale (65536 at the start) until the optimizer's step; the helper measured
them as they were, so it returned the norm x 65536 and clipped 65536-fold too hard.
"""

import torch

from atorch.auto import auto_accelerate
from atorch.auto.train_step import clip_grad_norm_, train_step_stats
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def _result():
    status, result, _ = auto_accelerate(tiny_llama(seed=0), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.5}, dataloader_args={"batch_size": 4},
                                        model_input_format="unpack_dict",
                                        load_strategy=[("amp_native", {"dtype": torch.float16})])
    assert status
    return result


def test_a_hand_written_loop_clips_as_train_step_does():
    batch = next(iter(_result().dataloader))
    manual = _result()
    loss = manual.loss_func(batch, manual.model(**batch))
    manual.optim.zero_grad()
    loss.backward()
    norm = clip_grad_norm_(manual, 0.3)
    manual.optim.step()      # does not unscale a second time

    reference = _result()
    stats = train_step_stats(reference, batch, max_grad_norm=0.3)
    assert float(stats.grad_norm) < 100     # an unscaled norm (the scaled one was ~6e4)
    torch.testing.assert_close(norm, stats.grad_norm)
    for (name, p), q in zip(manual.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)
