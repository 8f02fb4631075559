"""model_input_format=None on dict batches whose keys the forward does not take: a ValueError naming both,
rather than the dict passed whole as the forward's first argument (a torch TypeError deep in the model)."""

import pytest
import torch
from torch import nn

from atorch.auto.model_context import call_model, infer_input_format
from atorch.testing.models import tiny_llama


class OptionalBatch(nn.Module):
    """A forward whose only parameter is optional still takes the batch as one argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, batch=None):
        return self.fc(batch["x"]).sum()


def test_a_dict_of_other_keys_for_a_hugging_face_forward_is_a_value_error():
    llama = tiny_llama()
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch = {"tokens": ids, "targets": ids}
    message = (r"model_input_format=None: the batch is a dict with keys \['targets', 'tokens'\], which are not all "
               r"parameters of LlamaForCausalLM.forward \(\['input_ids', .*'labels'")
    with pytest.raises(ValueError, match=message):
        infer_input_format(llama, batch)
    with pytest.raises(ValueError, match=message):
        call_model(llama, batch, None)
    # What works today still does: HF keys as keywords, a forward with one (optional) parameter takes it whole.
    assert infer_input_format(llama, {"input_ids": ids, "labels": ids}) == "unpack_dict"
    assert infer_input_format(OptionalBatch(), {"x": torch.ones(2, 4), "y": 1}) == "whole"
    assert call_model(OptionalBatch(), {"x": torch.ones(2, 4), "y": 1}, None).shape == ()
