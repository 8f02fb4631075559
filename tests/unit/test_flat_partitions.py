"""Which optimizers DeepSpeed's flat partitions leave unchanged (`opt_lib/_flat_partitions.py`)."""

import logging

import pytest
import torch

from atorch.auto.opt_lib import _flat_partitions
from atorch.auto.opt_lib._flat_partitions import check_flat_partition_optimizer, shape_dependence


def _params():
    return [torch.nn.Parameter(torch.zeros(4, 3))]


class ElementwiseByHand(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


class MyAdafactor(torch.optim.Adafactor):
    pass


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_flat_partitions, "_warned", set())


@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop])
def test_torch_elementwise_optimizers_pass_silently(make, caplog):
    with caplog.at_level(logging.WARNING):
        check_flat_partition_optimizer("zero2", make(_params(), lr=0.1))
    assert not caplog.records


@pytest.mark.parametrize("make,why", [
    (lambda p: torch.optim.Adafactor(p), "factors its second moment"),
    (lambda p: MyAdafactor(p), "factors its second moment"),
    (lambda p: torch.optim.Muon(p), "orthogonalizes"),
    (lambda p: torch.optim.LBFGS(p), "closure"),
])
def test_shape_dependent_optimizers_are_refused_with_what_to_do(make, why):
    with pytest.raises(ValueError, match=why) as info:
        check_flat_partition_optimizer("fsdp", make(_params()))
    assert "use_ds_zero=False" in str(info.value)
    assert str(info.value).startswith("fsdp with DeepSpeed")


def test_transformers_adafactor_is_refused():
    from transformers.optimization import Adafactor

    assert "factors its second moment" in shape_dependence(Adafactor(_params(), lr=1e-3, relative_step=False))


def test_an_unknown_optimizer_is_warned_about_once_per_class(caplog):
    with caplog.at_level(logging.WARNING):
        check_flat_partition_optimizer("zero1", ElementwiseByHand(_params()))
        check_flat_partition_optimizer("zero1", ElementwiseByHand(_params()))
    warnings = [r for r in caplog.records if "flat 1-D partitions" in r.getMessage()]
    assert len(warnings) == 1
    assert "ElementwiseByHand" in warnings[0].getMessage()


def test_a_subclass_of_adamw_is_not_assumed_elementwise(caplog):
    class Tweaked(torch.optim.AdamW):
        pass

    with caplog.at_level(logging.WARNING):
        check_flat_partition_optimizer("zero1", Tweaked(_params()))
    assert any("Tweaked" in r.getMessage() for r in caplog.records)
