"""atorch.deploy.protocol: what crosses between the proxy and its workers; a model output's KV cache never does."""

from multiprocessing import Pipe

import pytest
import torch

from atorch.deploy import protocol
from atorch.testing import tiny_llama


def _round_trip(payload):
    ours, theirs = Pipe()
    try:
        protocol.send(ours, {"ok": True}, payload)
        return protocol.recv(theirs)[1]
    finally:
        ours.close()
        theirs.close()


def test_tensors_and_containers_round_trip():
    payload = {"ids": torch.arange(6).reshape(2, 3), "half": torch.ones(2, dtype=torch.bfloat16),
               "pair": (1, "a", None), "rows": [[1.5, True]], "empty": torch.empty(0, 4)}
    got = _round_trip(payload)
    assert torch.equal(got["ids"], payload["ids"]) and got["half"].dtype == torch.bfloat16
    assert got["pair"] == (1, "a", None) and got["rows"] == [[1.5, True]] and got["empty"].shape == (0, 4)


def test_the_kv_cache_of_generate_and_forward_stays_behind_under_either_field_name():
    """transformers 5 names the cache field `cache` (4.x: `past_key_values`); it was sent by name and raised
    "the payload['cache'] is of type DynamicCache" for return_dict_in_generate and use_cache=True."""
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = tiny_llama(seed=0).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True, output_scores=True,
                                   pad_token_id=3)
        forward = model(input_ids=ids, use_cache=True)
    assert any(isinstance(v, DynamicCache) for v in generated.values())     # what the workers return
    got = _round_trip(generated)
    assert type(got) is type(generated) and torch.equal(got.sequences, generated.sequences)
    assert len(got.scores) == 3 and all(torch.equal(a, b) for a, b in zip(got.scores, generated.scores))
    assert not any(isinstance(v, DynamicCache) for v in got.values())
    got = _round_trip(forward)
    assert type(got) is CausalLMOutputWithPast and torch.equal(got.logits, forward.logits)
    assert not any(isinstance(v, DynamicCache) for v in got.values())


@pytest.mark.parametrize("field", protocol.CACHE_FIELDS)
def test_a_legacy_tuple_cache_is_left_out_under_any_cache_field_name(field):
    kv = tuple((torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)) for _ in range(2))
    assert protocol.is_cache(field, kv)
    assert not protocol.is_cache("hidden_states", kv) and not protocol.is_cache(field, None)
    assert not protocol.is_cache("attentions", (torch.ones(2),))      # a tuple of tensors is not a cache
    encoded = protocol._encode(_output(logits=torch.ones(1, 2), **{field: kv}), [], "the payload")
    assert list(encoded["fields"]) == ["logits"]


def _output(**fields):
    from transformers.utils import ModelOutput

    out = ModelOutput()
    for k, v in fields.items():
        out[k] = v
    return out


def test_a_cache_sent_as_an_input_is_refused_with_its_place():
    from transformers.cache_utils import DynamicCache

    with pytest.raises(TypeError, match=r"payload\['kwargs'\]\['past_key_values'\] is of type DynamicCache"):
        protocol.encode({}, {"kwargs": {"past_key_values": DynamicCache()}})
