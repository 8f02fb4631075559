"""`stable_text`: the same text in every process for the same optimizer settings, so ranks can compare them."""

import functools

import torch

from atorch.auto.accelerate import stable_text


def test_texts_name_functions_not_addresses_and_sort_mappings():
    assert stable_text(torch.optim.AdamW) == "torch.optim.adamw.AdamW"
    assert stable_text(lambda b, o: o.loss) == f"{__name__}.test_texts_name_functions_not_addresses_and_sort_mappings" \
                                               ".<locals>.<lambda>"
    assert stable_text({"lr": 1e-3, "betas": (0.9, 0.95)}) == "{'betas': (0.9, 0.95), 'lr': 0.001}"
    assert stable_text(functools.partial(torch.optim.SGD, momentum=0.9)) == \
        "partial(torch.optim.sgd.SGD, momentum=0.9)"
    assert stable_text({"lr_lambda": [1, 2]}) == "{'lr_lambda': [1, 2]}"
    assert stable_text(torch.ones(2)) == "<torch.Tensor>"
    assert stable_text(None) == "None"
