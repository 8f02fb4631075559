"""Is a model the same on every rank of a group? Two float64 checksums per parameter, all-gathered.

Strategies that cut one model into pieces held by different ranks (tensor slices, pipeline
stages) or keep replicas that are never broadcast (a pipeline stage's data replicas) need every
rank to have built the same model. Ranks that built it under the same seed agree bit for bit; a
model built without a common seed trained on silently with replicas that never converge. Cheap:
one small all-gather (two floats per parameter) before anything is cut.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.distributed.process_group import collective_device


RELATIVE_TOLERANCE = 1e-7
"""Checksums closer than this fraction of the parameter's magnitude sum count as equal."""


@torch.no_grad()
def first_difference(model: nn.Module, group: Optional[dist.ProcessGroup],
                     device: Optional[torch.device] = None) -> Optional[str]:
    """None when every rank of `group` holds the same parameters (checksums equal); else which parameter
    differs first and its checksum on each rank of the group. Collective over `group`; `device`: where the
    checksums travel (None: the current CUDA device on nccl, else the CPU)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    if device is None:
        device = collective_device(group)
    names: List[str] = []
    stats = []
    for name, p in model.named_parameters():
        # Its sum and the sum of its magnitudes, accumulated in float64 without a float64 copy of the weights.
        names.append(name)
        stats.append((float(p.detach().sum(dtype=torch.float64)), float(p.detach().abs().sum(dtype=torch.float64))))
    local = torch.tensor(stats or [(0.0, 0.0)], dtype=torch.float64).to(device)
    gathered: List[torch.Tensor] = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack([g.cpu() for g in gathered])          # [ranks, parameters, (sum, magnitude)]
    # Equal up to the summation order (threads, vector widths differ between machines): far below
    # what different initial weights give (of the order of the magnitude itself).
    tolerance = RELATIVE_TOLERANCE * table[0, :, 1].clamp_min(1e-30)
    differs = ((table - table[0]).abs() > tolerance[None, :, None]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    if not differs:
        return None
    i = differs[0]
    name = names[i] if i < len(names) else "(parameters)"
    values = ", ".join(f"{v:.6g}" for v in table[:, i, 0].tolist())
    more = f" and {len(differs) - 1} more" if len(differs) > 1 else ""
    return f"{name}{more} (checksums by rank of the group: {values})"


def check_replicas_agree(model: nn.Module, group: Optional[dist.ProcessGroup], device: Optional[torch.device],
                         who: str, remedy: str) -> None:
    """Raise ValueError on every rank of `group` when the model's parameters differ across it. Collective."""
    where = first_difference(model, group, device)
    if where is not None:
        raise ValueError(f"{who}: the model's weights differ across ranks: {where}; {remedy}")
