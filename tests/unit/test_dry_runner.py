"""The dry runner in one process: what makes a candidate a failed trial (a NaN or infinite loss)."""

import math

import pytest
import torch

import atorch
from atorch.auto.dry_runner import DryRunConfig, FiniteLossCheck, NonFiniteLoss, dry_run
from atorch.auto.model_context import ModelContext
from atorch.auto.strategy import Strategy

@pytest.fixture(autouse=True)
def _world_of_one():
    atorch.init_distributed("gloo")    # as auto_accelerate does in one process (the conftest tears it down)


QUICK = DryRunConfig(warmup_steps=1, profile_steps=1, max_profile_steps=3, target_relative_ci=0.0)


class PairData(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)), torch.tensor(i % 2)


class Classifier(torch.nn.Linear):
    def forward(self, x, y=None):    # called as model(*batch)
        return super().forward(x)


def _context(bad_from_step=None, bad=float("nan")):
    calls = []

    def loss_func(batch, output):
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(output, batch[1])
        return loss * bad if bad_from_step is not None and len(calls) >= bad_from_step else loss

    return ModelContext(model=Classifier(4, 2), optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                        dataset=PairData(), loss_func=loss_func, model_input_format="unpack_sequence",
                        dataloader_args={"batch_size": 4}, prepare_input=lambda batch, device: batch)


def test_finite_losses_are_a_measured_trial():
    result = dry_run(_context(), Strategy([]), QUICK)
    assert result.ok and result.throughput > 0, result


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_a_non_finite_loss_is_a_failed_trial_naming_the_loss_and_the_step(bad, shown):
    # Warm-up: 2 steps (MIN_MEMORY_STEPS), then timed steps; the loss turns bad at the 3rd (a timed one).
    result = dry_run(_context(bad_from_step=3, bad=bad), Strategy([]), QUICK)
    assert not result.ok and result.status == "exception" and result.throughput == 0, result
    assert f"non-finite loss ({shown}) at step 3 of " in result.error, result.error


def test_the_check_reads_the_device_once_and_keeps_the_first_bad_step():
    check = FiniteLossCheck()
    for loss in (torch.tensor(1.0), 2.0, None, torch.tensor([1.0, math.inf]), torch.tensor(math.nan)):
        assert check.record(loss) is loss
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(inf\) at step 4 of 5"):
        check.check()
    FiniteLossCheck().check()     # no step: nothing to say


def test_a_dry_run_still_running_after_a_while_says_so_and_what_bounds_its_wait(monkeypatch):
    # A rank waiting in a collective for a failed peer was silent for the whole 300 s timeout.
    import threading

    import atorch.auto.dry_runner as dry_runner

    fired, warnings = threading.Event(), []
    monkeypatch.setattr(dry_runner, "LONG_RUN_WARNING_S", 0.0)
    monkeypatch.setattr(dry_runner.logger, "info", lambda *args: (warnings.append(args[0] % args[1:]), fired.set()))
    with dry_runner._long_run_warning(Strategy(["amp_native"]), DryRunConfig(timeout_s=300), peer_wait_s=90):
        assert fired.wait(timeout=60)     # the timer thread fires while the block still runs
    assert "dry run of amp_native(bfloat16) still running after 0 s" in warnings[0], warnings
    assert "a collective gives up after 90 s, the dry run after 300 s (ATORCH_DRYRUN_TIMEOUT)" in warnings[0], warnings
