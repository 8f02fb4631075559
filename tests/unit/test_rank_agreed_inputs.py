"""Inputs that must be the same on every rank, as the one vote compares them (pure parts, one process),
and argument checks that need more than one line: a write probe for the strategy file, and parameters
`optim_param_func` picks from outside the model.

The 2-rank half (every rank raises the same ValueError) is in tests/distributed/test_bad_inputs_distributed.py.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

from atorch.auto import accelerate
from atorch.auto.arguments import check_optim_params_in_model, validate_arguments
from atorch.auto.model_context import ModelContext
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.train_step import train_step
from atorch.testing.parity import TokenDataset
from atorch.utils.stable import stable_repr

# the module (atorch.auto's `train_step` is the function)
train_step_module = importlib.import_module("atorch.auto.train_step")


class _OwnSampler(torch.utils.data.DistributedSampler):
    pass


def _sampler(**args) -> str:
    sampler_cls = args.pop("sampler_cls", None)
    ctx = ModelContext(model=nn.Linear(2, 2), dataset=TokenDataset(n=8), dataloader_args=dict(args),
                       distributed_sampler_cls=sampler_cls)
    return accelerate._sampler_text(ctx)


def test_the_sampler_settings_compared_across_ranks_write_out_the_defaults():
    assert _sampler(shuffle=True, seed=3) == "torch.utils.data.distributed.DistributedSampler(shuffle=True, seed=3, " \
                                            "drop_last=True)"
    # An absent key equals its default: a rank passing shuffle=False agrees with one passing nothing.
    assert _sampler() == _sampler(shuffle=False, drop_last=True, seed=0)
    assert _sampler(batch_size=4, num_workers=2, pin_memory=True) == _sampler(batch_size=4)   # how, not which
    assert _sampler(drop_last=False) != _sampler()
    assert _sampler(shuffle=True) != _sampler()
    # The seed counts where the sampler reads it: to shuffle, or in a sampler class of the user's.
    assert _sampler(shuffle=True, seed=1) != _sampler(shuffle=True, seed=0)
    assert _sampler(seed=1) == _sampler(seed=0)
    assert _sampler(seed=1, sampler_cls=_OwnSampler) != _sampler(seed=0, sampler_cls=_OwnSampler)
    assert _sampler(sampler_cls=_OwnSampler) == f"{__name__}._OwnSampler(shuffle=False, seed=0, drop_last=True)"


def test_stable_repr_is_the_same_for_the_same_thing_in_another_process():
    # Compared across processes: a memory address would make equal values differ.
    texts = [stable_repr(v) for v in (_OwnSampler, len, lambda: 0, object(), 3, "x")]
    assert texts[:3] == [f"{__name__}._OwnSampler", "builtins.len",
                         f"{__name__}.test_stable_repr_is_the_same_for_the_same_thing_in_another_process.<locals>."
                         "<lambda>"]
    assert texts[3] == "<object object>" and texts[4:] == ["3", "'x'"]
    assert all("0x" not in t for t in texts)


# -- optim_param_func: what it returns belongs to the model ------------------------------------------

def test_optim_param_func_must_return_the_models_own_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    decay, no_decay = [model[0].weight], [model[0].bias, *model[1].parameters()]
    # What torch optimizers take, all of the model: tensors, groups, (name, tensor) pairs.
    for func in (lambda m: m.parameters(), lambda m: [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                 lambda m: m.named_parameters(), lambda m: [{"params": model[0].weight}],
                 lambda m: [{"params": list(m.named_parameters())}],
                 lambda m: []):    # empty: left to the optimizer (lora may add what the function picks)
        check_optim_params_in_model(model, func)
    copy = nn.Linear(2, 2)
    for func in (lambda m: [*m.parameters(), copy.weight], lambda m: [{"params": decay}, {"params": [copy.bias]}],
                 lambda m: [("copy.weight", copy.weight)]):
        with pytest.raises(ValueError, match=r"returned 1 tensor\(s\) that are not parameters of the model .* the "
                                             r"model would not train"):
            check_optim_params_in_model(model, func)
    # Only checked when an optimizer will be built from it.
    validate_arguments(model=model, optim_param_func=lambda m: [copy.weight])


def test_optim_param_func_returning_a_parameter_twice_is_refused_naming_it():
    """torch steps a parameter once per occurrence: listed twice, its update doubled with only a warning."""
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    for func in (lambda m: [*m.parameters(), m[0].weight],
                 lambda m: [{"params": list(m.parameters())}, {"params": [m[0].weight], "lr": 0.1}],
                 lambda m: [*m.named_parameters(), ("again", m[0].weight)]):
        with pytest.raises(ValueError, match=r"optim_param_func=.* returned the parameter '0.weight' 2 times; the "
                                             r"optimizer would update it once per occurrence, 2x its step"):
            check_optim_params_in_model(model, func)
    with pytest.raises(ValueError, match=r"'0.weight' 3 times \(and 3 more\)"):
        check_optim_params_in_model(model, lambda m: [*m.parameters(), *m.parameters(), m[0].weight])


# -- save_strategy_to_file: a directory where no file can be created ---------------------------------

def test_save_strategy_to_file_is_probed_where_the_permission_bits_say_yes(monkeypatch, tmp_path: Path):
    # As root, os.access says yes in /proc (and on a read-only mount): the file then failed to be written
    # after the strategy had been applied. A file created and removed there tells the truth.
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    with pytest.raises(ValueError, match=r"save_strategy_to_file='/proc/strategy.json': cannot create a file in "
                                         r"the directory '/proc' .*give a path in a writable directory"):
        validate_arguments(model=nn.Linear(2, 2), save_strategy_to_file="/proc/strategy.json")
    validate_arguments(model=nn.Linear(2, 2), save_strategy_to_file=str(tmp_path / "strategy.json"))
    assert list(tmp_path.iterdir()) == []    # the probe is removed


# -- train_step: the options are compared across ranks at the first call on each result -------------

def _result() -> AutoAccelerateResult:
    model = nn.Linear(2, 1)
    return AutoAccelerateResult(model=model, optim=torch.optim.SGD(model.parameters(), lr=0.1), dataloader=None,
                                loss_func=lambda batch, out: out.float().pow(2).mean(),
                                prepare_input=lambda batch, device=None: batch)


def test_train_step_compares_its_options_across_ranks_at_the_first_call_only(monkeypatch):
    votes: List[Dict[str, str]] = []
    monkeypatch.setattr(train_step_module, "agree_on_values", lambda what, values: votes.append(dict(values)))
    first, second = _result(), _result()
    for _ in range(3):
        train_step(first, torch.ones(4, 2), gradient_accumulation_steps=2, max_grad_norm=1)
    assert votes == [{"gradient_accumulation_steps": "2", "max_grad_norm": "1.0"}]   # 1 and 1.0 clip alike
    train_step(second, torch.ones(4, 2))   # each result's first call: the strategy's accumulation steps
    assert votes[1:] == [{"gradient_accumulation_steps": "1", "max_grad_norm": "None"}]
    # A bad value is compared before it is checked: one rank's mistake is named on every rank.
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0 must be an integer >= 1"):
        train_step(_result(), torch.ones(4, 2), gradient_accumulation_steps=0)
    assert votes[2:] == [{"gradient_accumulation_steps": "0", "max_grad_norm": "None"}]
