"""ATorch's disk-offloaded meta initialization: `init_empty_weights_with_disk_offload`, `reload_meta_module`,
`materialize_modules_to_device` (dlrover bfd04ef1, `atorch/utils/meta_model_utils.py`).

Documented behaviour checked: a model built in the block holds only meta tensors; reloading
gives back exactly the initial values the construction drew (bitwise), tied weights stay tied,
buffers come back too, and a sub-module can be reloaded alone.
"""

import pytest
import torch
from torch import nn

from atorch.utils.meta_model_utils import (
    init_empty_weights_with_disk_offload,
    materialize_modules_to_device,
    reload_meta_module,
)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _reference():
    torch.manual_seed(0)
    return Tied()


def test_offload_and_reload_restore_exact_initial_values(tmp_path):
    ref = _reference()
    torch.manual_seed(0)
    with init_empty_weights_with_disk_offload(offload_path=str(tmp_path)):
        model = Tied()
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.head.weight is model.emb.weight
    reload_meta_module(model.body)            # a sub-module alone
    assert not model.body[0].weight.is_meta and model.emb.weight.is_meta
    materialize_modules_to_device(model, "cpu")
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert model.head.weight is model.emb.weight   # still tied
    assert model.emb.weight.requires_grad


def test_unsupported_options_and_unsaved_meta_tensors_raise():
    with pytest.raises(ValueError, match="disk_offload=False"):
        with init_empty_weights_with_disk_offload(disk_offload=False):
            pass
    with torch.device("meta"):
        plain = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weight is on the meta device with no saved value"):
        reload_meta_module(plain)
