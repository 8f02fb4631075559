"""The replica checks name global ranks, also for a group that is not the world (a data group [1, 3])."""

from typing import List

import pytest
import torch
from torch import nn

from atorch.distributed import replicas

GROUP_RANKS = [1, 3]


class _FakeDist:
    """The calls of replicas.py on a 4-rank world, seen from global rank 1 of a data group [1, 3] whose other
    member (global rank 3) holds `other`."""

    group = type("group", (), {"WORLD": object()})

    def __init__(self, mine: nn.Module, other: nn.Module):
        self.models = [mine, other]

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return 4 if group is None else len(GROUP_RANKS)

    def get_process_group_ranks(self, group) -> List[int]:
        return list(GROUP_RANKS)

    def all_gather(self, out: List[torch.Tensor], local: torch.Tensor, group=None) -> None:
        # What each member would contribute: the same computation on its own model.
        if local.dtype == torch.int64:
            values = [torch.tensor([replicas._digest(replicas.model_layout(m))]) for m in self.models]
        else:
            values = [torch.tensor([(float(p.sum(dtype=torch.float64)), float(p.abs().sum(dtype=torch.float64)))
                                    for p in m.parameters()], dtype=torch.float64) for m in self.models]
        for slot, value in zip(out, values):
            slot.copy_(value)

    def all_gather_object(self, out: list, obj, group=None) -> None:
        out[:] = [replicas.model_layout(m) for m in self.models]


@pytest.fixture
def data_group(monkeypatch):
    def install(mine: nn.Module, other: nn.Module) -> object:
        monkeypatch.setattr(replicas, "dist", _FakeDist(mine, other))
        return object()        # the group handle (only passed through)
    return install


def test_layout_difference_names_the_global_ranks_of_the_group(data_group):
    torch.manual_seed(0)
    group = data_group(nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    text = replicas.layout_difference(nn.Sequential(nn.Linear(4, 4)), group, torch.device("cpu"))
    assert text is not None
    assert "parameter counts on ranks [1, 3]: 2, 4" in text, text
    assert "(none) on rank [1]; 1.weight (4, 4) float32 on rank [3]" in text, text


def test_checksum_difference_names_the_global_ranks_of_the_group(data_group):
    torch.manual_seed(0)
    mine, other = nn.Linear(4, 4), nn.Linear(4, 4)
    group = data_group(mine, other)
    with pytest.raises(ValueError, match=r"weight and 1 more \(checksums on ranks \[1, 3\]: "):
        replicas.check_replicas_agree(mine, group, torch.device("cpu"), "fsdp", "seed every rank alike")


def test_a_parameter_frozen_on_one_rank_only_is_a_layout_difference(data_group):
    """Gradient buckets and shards hold only the parameters that train: one rank freezing a parameter the others
    train made FSDP's reduce-scatter sizes differ, and gloo aborted the process (SIGABRT)."""
    mine, other = nn.Linear(4, 4), nn.Linear(4, 4)
    other.load_state_dict(mine.state_dict())
    other.weight.requires_grad_(False)
    group = data_group(mine, other)
    with pytest.raises(ValueError, match=r"fsdp: the model differs across ranks: entry #0 \(name, shape, dtype\): "
                                         r"weight \(4, 4\) float32 on rank \[1\]; weight \(4, 4\) float32 "
                                         r"requires_grad=False on rank \[3\]; build the same model"):
        replicas.check_layouts_agree(mine, group, torch.device("cpu"), "fsdp")
    other.weight.requires_grad_(True)
    assert replicas.layout_difference(mine, group, torch.device("cpu")) is None
