"""The automatic search stops at an error in the user's own loss function or data instead of charging it to every
candidate: before, a loss returning a vector failed `patience` dry runs (8 model builds) and auto_accelerate
returned status=False with "no strategy runs", where the README promises the error at first use."""

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.auto.user_errors import UserCodeError
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def _per_token_loss(batch, output):
    logits = output.logits.flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(logits, batch["labels"].flatten(), reduction="none")   # not reduced


def test_a_loss_of_the_wrong_shape_is_raised_at_the_first_dry_run(monkeypatch):
    from atorch.auto import dry_runner

    runs = []
    real = dry_runner.dry_run
    monkeypatch.setattr(dry_runner, "dry_run", lambda *args, **kwargs: runs.append(1) or real(*args, **kwargs))
    with pytest.raises(ValueError, match=r"loss_func _per_token_loss returned a loss of shape \(64,\); it must "
                                         r"return a scalar .* \(the dry run of .* raised it on rank 0; the search "
                                         r"stopped there") as raised:
        auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(n=32),
                        loss_func=_per_token_loss, dataloader_args={"batch_size": 4})
    assert isinstance(raised.value, UserCodeError) and len(runs) == 1
