"""Mistakes in what a user hands auto_accelerate that it used to accept silently or refuse misleadingly: a model
left in eval mode, a dataset that cannot be read by index, batch keys the model's forward drops, an optimizer
factory that takes no parameters."""

from __future__ import annotations

import logging
from typing import Any, Dict

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.auto.arguments import validate_arguments
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def _accelerate(model: Any = None, **overrides: Any) -> Any:
    kwargs: Dict[str, Any] = dict(optim_func=torch.optim.AdamW, dataset=TokenDataset(n=8),
                                  dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"])
    kwargs.update(overrides)
    return auto_accelerate(model if model is not None else tiny_llama(seed=0), **kwargs)


def test_a_model_in_eval_mode_is_trained_in_train_mode_and_told_once(caplog):
    """from_pretrained returns eval mode: trained so, dropout stayed off (only lora switched it on, via peft)."""
    model = tiny_llama(seed=0, attention_dropout=0.5).eval()
    with caplog.at_level(logging.INFO, logger="atorch.auto.accelerate"):
        status, result, _ = _accelerate(model)
    assert status and result.model.training and all(m.training for m in result.model.modules())
    said = [r for r in caplog.records if "was in eval mode" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "LlamaForCausalLM" in said[0].getMessage() and "dropout is on" in said[0].getMessage()
    # Already in train mode: nothing said, and a submodule the user put in eval mode stays so.
    caplog.clear()
    model = tiny_llama(seed=0)
    model.model.norm.eval()
    with caplog.at_level(logging.INFO, logger="atorch.auto.accelerate"):
        status, result, _ = _accelerate(model)
    assert status and not result.model.model.norm.training
    assert not [r for r in caplog.records if "was in eval mode" in r.getMessage()]


class _Columns(dict):
    """A tokenizer's output or a dict of columns: keys are column names, dataset[0] raises KeyError."""


@pytest.mark.parametrize("dataset,message", [
    ({"train": TokenDataset(n=8)}, r"dataset is a dict \(a mapping with keys \['train'\]\), not a dataset of samples "
                                   r"\(dataset\[0\] raised KeyError: 0\); pass one of its datasets, e.g. "
                                   r"dataset\['train'\]"),
    ({"validation": TokenDataset(n=8)}, r"e.g. dataset\['validation'\]"),
    ({"input_ids": torch.zeros(8, 16, dtype=torch.long), "labels": torch.zeros(8, 16, dtype=torch.long)},
     r"dataset is a dict of columns \['input_ids', 'labels'\], not a dataset of samples \(dataset\[0\] raised "
     r"KeyError: 0\); .* datasets.Dataset.from_dict\(columns\).with_format\('torch'\)"),
])
def test_a_dataset_that_cannot_be_indexed_by_0_is_refused_naming_its_type_and_the_error(dataset, message):
    """Accepted before (then KeyError at the first batch), or refused as "dataset has 1 samples" (a mapping's
    length is its number of keys, below the batch of 4)."""
    with pytest.raises(TypeError, match=message):
        _accelerate(dataset=dataset)
    with pytest.raises(TypeError, match=message):
        _accelerate(dataset=dataset, dataloader_args={"batch_size": 1})


def test_a_dataset_whose_first_sample_fails_is_refused_naming_the_exception():
    class Broken(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> Any:
            raise FileNotFoundError("shard-0001.bin")

    with pytest.raises(TypeError, match=r"dataset \(.*Broken\) cannot be read by index: dataset\[0\] raised "
                                        r"FileNotFoundError: shard-0001.bin"):
        _accelerate(dataset=Broken())


def test_hugging_face_datasets_are_named_where_a_split_or_the_torch_format_is_missing():
    datasets = pytest.importorskip("datasets")
    tokens = TokenDataset(n=8).tokens.tolist()
    plain = datasets.Dataset.from_dict({"input_ids": tokens, "labels": tokens})
    with pytest.raises(TypeError, match=r"dataset is a datasets.dataset_dict.DatasetDict \(a mapping with keys "
                                        r"\['train'\]\), .* e.g. dataset\['train'\]"):
        _accelerate(dataset=datasets.DatasetDict({"train": plain}))
    # lists, which torch's default collate turns into one tensor per position: refused before anything runs
    with pytest.raises(TypeError, match=r"dataset\[0\]\['input_ids'\] is a list, not a tensor: .*"
                                        r"dataset.with_format\('torch'\)"):
        _accelerate(dataset=plain)
    status, _, _ = _accelerate(dataset=plain.with_format("torch"))
    assert status


def test_batch_keys_the_forward_does_not_name_are_warned_about_with_close_matches(caplog):
    """LlamaForCausalLM.forward takes **kwargs: an `attention_masks` typo or GPT's `token_type_ids` were
    dropped silently."""
    extra = {"attention_masks": lambda ids: torch.ones_like(ids), "token_type_ids": lambda ids: torch.zeros_like(ids)}

    class WithExtra(TokenDataset):
        def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
            sample = super().__getitem__(i)
            return {**sample, **{k: f(sample["input_ids"]) for k, f in extra.items()}}

    with caplog.at_level(logging.WARNING, logger="atorch.auto.arguments"):
        status, _, _ = _accelerate(dataset=WithExtra(n=8))
    assert status
    said = [r.getMessage() for r in caplog.records if "does not name" in r.getMessage()]
    assert len(said) == 1, said
    assert "'attention_masks' (did you mean 'attention_mask'?), 'token_type_ids'" in said[0]
    assert "LlamaForCausalLM.forward" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atorch.auto.arguments"):
        _accelerate()
    assert not [r for r in caplog.records if "does not name" in r.getMessage()]


def test_an_optim_func_that_takes_no_parameters_is_refused_up_front():
    """auto_accelerate calls optim_func(parameters, **optim_args): a factory of no arguments failed while applying
    with a raw TypeError."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"optim_func=.*<lambda>\(\) cannot be called as optim_func\(parameters, "
                                        r"\*\*optim_args\), which is how atorch calls it"):
        validate_arguments(model=model, optim_func=lambda: torch.optim.SGD(model.parameters(), lr=0.1))
    validate_arguments(model=model, optim_func=lambda params, lr=0.1: torch.optim.SGD(params, lr=lr))
    validate_arguments(model=model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3})
