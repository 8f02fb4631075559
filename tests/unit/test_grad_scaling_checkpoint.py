"""fp16 `GradScalingOptimizer` across `load_checkpoint`: the LR scheduler keeps driving the optimizer that steps.

`Optimizer.load_state_dict` replaces `param_groups` and `state` with new objects; the wrapper
must follow them, or the scheduler would change an lr that no step reads after a resume.
"""

from typing import List, Tuple

import torch

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import load_checkpoint, save_checkpoint
from atorch.modules.grad_scaling import GradScalingOptimizer
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset, global_batches

FP16 = [("amp_native", {"dtype": torch.float16})]
GAMMA = 0.5
LR = 1e-3


def test_wrapper_follows_the_inner_optimizer_after_its_load_state_dict():
    w = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([w], lr=0.1)
    optim = GradScalingOptimizer(inner, torch.amp.GradScaler("cpu"))
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=GAMMA)
    inner.load_state_dict(inner.state_dict())  # new param_groups / state objects
    assert optim.param_groups is inner.param_groups and optim.state is inner.state
    assert optim.defaults is inner.defaults
    optim.scale_loss((w * w).sum()).backward()
    optim.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == 0.1 * GAMMA
    # Building the wrapper left the inner optimizer's groups as they were.
    assert len(inner.param_groups) == 1 and inner.param_groups[0]["params"][0] is w


def _build(seed: int):
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), torch.optim.AdamW, TokenDataset(n=16, seq_len=8), optim_args={"lr": LR},
        dataloader_args={"batch_size": 4}, load_strategy=FP16,
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": GAMMA})
    assert status
    assert isinstance(result.optim, GradScalingOptimizer)
    return result


def _train(result, batches) -> Tuple[List[float], List[float]]:
    """Losses, and the lr the inner optimizer used at each step (train_step steps the scheduler)."""
    losses, lrs = [], []
    for batch in batches:
        lrs.append(result.optim.optimizer.param_groups[0]["lr"])
        losses.append(float(train_step(result, batch)))
    return losses, lrs


def test_fp16_resume_follows_the_lr_schedule_and_matches_an_uninterrupted_run(tmp_path):
    batches = global_batches(TokenDataset(n=16, seq_len=8), 4, 4)
    straight, straight_lrs = _train(_build(0), batches)

    first_run = _build(0)
    first, first_lrs = _train(first_run, batches[:2])
    save_checkpoint(first_run, str(tmp_path / "step_2"), step=2)
    resumed_run = _build(1)
    state = load_checkpoint(resumed_run, str(tmp_path / "step_2"))
    assert state.optimizer_restored
    rest, rest_lrs = _train(resumed_run, batches[2:])

    expected_lrs = [LR * GAMMA ** k for k in range(4)]
    assert straight_lrs == expected_lrs
    assert first_lrs + rest_lrs == expected_lrs  # the resumed inner optimizer steps with the scheduled lr
    assert first + rest == straight  # exact: same fp16 arithmetic on the same state
