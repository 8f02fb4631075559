"""atorch.deploy's proxy without workers: what `DeployedModel.generate` refuses before sending anything."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from atorch.deploy import DeployedModel


def _proxy(sent):
    workers = SimpleNamespace(request=lambda op, payload, seed, device: sent.append((op, payload)) or "done")
    return DeployedModel(workers, config=SimpleNamespace(), tensor_parallel_size=2,
                         generation_config=GenerationConfig())


@pytest.mark.parametrize("kwargs, name", [
    ({"stop_strings": ["the"]}, "stop_strings"),
    ({"stop_strings": "the", "tokenizer": object()}, "stop_strings"),
    ({"tokenizer": object()}, "tokenizer"),
    ({"generation_config": GenerationConfig(stop_strings=["the"])}, "generation_config.stop_strings"),
    ({"generation_config": {"stop_strings": ["the"]}}, "generation_config.stop_strings"),
])
def test_stop_strings_are_refused_naming_eos_token_id_before_anything_is_sent(kwargs, name):
    """They could not work: the tokenizer was a TypeError of the protocol, stop_strings alone transformers'
    ValueError from inside the workers."""
    sent = []
    with pytest.raises(ValueError, match=rf"^deployed model: generate\({name}=\.\.\.\) is not supported: .*"
                                         r"instead with eos_token_id="):
        _proxy(sent).generate(torch.tensor([[5, 6]]), max_new_tokens=2, **kwargs)
    assert sent == []


def test_eos_token_id_is_sent():
    sent = []
    assert _proxy(sent).generate(torch.tensor([[5, 6]]), eos_token_id=[7, 9], stop_strings=None) == "done"
    assert sent[0][0] == "generate" and sent[0][1]["kwargs"]["eos_token_id"] == [7, 9]
