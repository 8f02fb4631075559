"""Clipping on pipeline stages that share a tied weight (GPT-2's wte / lm_head), 2 gloo ranks.

The first stage holds the embedding, the last the LM head, one matrix in the model. The global
norm counts it once, and both copies must be scaled by the same factor: before, the last stage's
copy kept its unclipped gradient, the copies drifted apart and training diverged silently (GPT-2,
SGD lr 0.5, max_grad_norm 0.5: losses rel 0.33 off plain training after 4 steps). SGD, because
Adam's normalization hides a rescaled gradient. fp32, rel 1e-5 as the other pipeline tests.
"""

from typing import Any, Dict, List

import torch

from atorch.testing import run_distributed, tiny_gpt2
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches

STEPS, BATCH, LR, MAX_NORM, REL = 4, 4, 0.5, 0.5, 1e-5


def _reference() -> Dict[str, Any]:
    model = tiny_gpt2(seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for batch in global_batches(TokenDataset(n=STEPS * BATCH), BATCH, STEPS):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "tied": model.transformer.wte.weight.detach().clone()}


def _job() -> Dict[str, Any]:
    from atorch.auto import auto_accelerate
    from atorch.auto.train_step import train_step_stats

    _, result, _ = auto_accelerate(tiny_gpt2(seed=0), optim_func=torch.optim.SGD, optim_args={"lr": LR},
                                   dataset=TokenDataset(n=STEPS * BATCH), dataloader_args={"batch_size": BATCH},
                                   load_strategy=[("parallel_mode", ([("data", 1), ("pipeline", 2)], None)),
                                                  ("pipeline_parallel", {"chunks": 2})])
    losses: List[float] = []
    norms: List[float] = []
    for _, batch in zip(range(STEPS), result.dataloader):
        stats = train_step_stats(result, batch, max_grad_norm=MAX_NORM)
        losses.append(float(stats.loss))
        norms.append(float(stats.grad_norm))
    return {"losses": losses, "norms": norms, "tied": result.pipeline.tied_param.detach().clone()}


def test_both_copies_of_a_tied_weight_are_clipped_alike():
    expected = _reference()
    first, last = run_distributed(_job, 2, timeout=240)
    assert_close_losses(last["losses"], expected["losses"], REL, "last stage")    # the stage computing the loss
    for rank, out in enumerate((first, last)):
        assert_close_losses(out["norms"], expected["norms"], REL, f"rank {rank} norm")
        torch.testing.assert_close(out["tied"], expected["tied"], rtol=1e-4, atol=1e-5)
