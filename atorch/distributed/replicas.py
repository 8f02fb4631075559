"""Is a model the same on every rank of a group? Its layout (names, shapes, dtypes) compared by one
digest per rank, then two float64 checksums per parameter, all-gathered.

Strategies that cut one model into pieces held by different ranks (tensor slices, pipeline
stages, FSDP shards) or keep replicas that are never broadcast (a pipeline stage's data replicas)
need every rank to have built the same model. Ranks that built it under the same seed agree bit for
bit; a model built without a common seed trained on silently with replicas that never converge (or,
sharded, stitched from different ranks' weights). Ranks that built models of different shapes would
meet in collectives of different sizes: a hang, or the backend aborting the process. Cheap: two small
all-gathers (one digest per rank, two floats per parameter) before anything is cut.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.distributed.process_group import collective_device
from atorch.utils.stable import stable_int63


RELATIVE_TOLERANCE = 1e-7
"""Checksums closer than this fraction of the parameter's magnitude sum count as equal."""


def _single_rank(group: Optional[dist.ProcessGroup]) -> bool:
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def model_layout(model: nn.Module) -> List[str]:
    """One line per parameter, then per buffer: its name, shape and dtype, and for a frozen parameter
    `requires_grad=False` (what collectives over it depend on: gradient buckets and shards hold only the
    parameters that train, so one rank freezing a parameter the others train reduces buffers of other sizes)."""
    lines = [f"{name} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
             f"{'' if p.requires_grad else ' requires_grad=False'}" for name, p in model.named_parameters()]
    lines += [f"buffer {name} {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
              for name, b in model.named_buffers()]
    return lines


def _digest(lines: List[str]) -> int:
    """A process-independent 63-bit digest of `lines` (Python's hash() is salted per process)."""
    return stable_int63("\n".join(lines))


def _global_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """The global ranks of `group`'s members, in the order of their ranks within it (None: the world).

    Messages name global ranks: the ones the launcher's logs, `failed on ranks [...]` and the user know.
    """
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _describe_layouts(layouts: List[List[str]], ranks: List[int]) -> str:
    """What differs between the layouts of `ranks` (global, one per layout): the parameter counts, and the
    first line that differs."""
    counts = [sum(not line.startswith("buffer ") for line in layout) for layout in layouts]
    parts = []
    if len(set(counts)) > 1:
        parts.append(f"parameter counts on ranks {ranks}: {', '.join(map(str, counts))}")
    longest = max(len(layout) for layout in layouts)
    i = next((i for i in range(longest) if len({tuple(layout[i:i + 1]) for layout in layouts}) > 1), 0)
    by_line: Dict[str, List[int]] = {}
    for rank, layout in zip(ranks, layouts):
        by_line.setdefault(layout[i] if i < len(layout) else "(none)", []).append(rank)
    parts.append(f"entry #{i} (name, shape, dtype): " + "; ".join(
        f"{line} on rank{'s' if len(ranks) > 1 else ''} {ranks}" for line, ranks in by_line.items()))
    return "; ".join(parts)


@torch.no_grad()
def layout_difference(model: nn.Module, group: Optional[dist.ProcessGroup],
                      device: Optional[torch.device] = None) -> Optional[str]:
    """None when every rank of `group` holds parameters and buffers of the same names, shapes and dtypes;
    else (the same text on every rank) the parameter counts and the first entry that differs, per rank.
    Collective over `group`: one fixed-size all-gather of a digest, and only when the digests differ an
    all-gather of the layouts. Run it before any collective whose size depends on the model."""
    if _single_rank(group):
        return None
    if device is None:
        device = collective_device(group)
    lines = model_layout(model)
    local = torch.tensor([_digest(lines)], dtype=torch.int64).to(device)
    gathered: List[torch.Tensor] = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    if len({int(g.item()) for g in gathered}) == 1:
        return None
    # Every rank saw the same digests, so every rank takes this branch: the variable-size gather is safe.
    layouts: List[Optional[List[str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, lines, group=group)
    return _describe_layouts([layout or [] for layout in layouts], _global_ranks(group))


def _has_values(model: nn.Module) -> bool:
    """Whether the parameters hold data to compare: not on the meta device, not fake tensors (a model
    built under FakeTensorMode, as the memory benchmarks do at scale: only its layout can be checked).
    Every rank of one job builds its model alike, so every rank takes the same branch."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(p.is_meta or is_fake(p) for p in model.parameters())


@torch.no_grad()
def _checksum_difference(model: nn.Module, group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    """`first_difference` for ranks known to hold the same layout (the gathered tables have one size); None
    without values to compare (`_has_values`: every rank then returns before the gather)."""
    if not _has_values(model):
        return None
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
    return f"{name}{more} (checksums on ranks {_global_ranks(group)}: {values})"


def first_difference(model: nn.Module, group: Optional[dist.ProcessGroup],
                     device: Optional[torch.device] = None) -> Optional[str]:
    """None when every rank of `group` holds the same parameters (layout and checksums equal); else what
    differs: the layout (`layout_difference`), or the first parameter whose checksums differ and its
    checksum on each rank of the group. Collective over `group`; `device`: where the checksums travel
    (None: the current CUDA device on nccl, else the CPU)."""
    if _single_rank(group):
        return None
    if device is None:
        device = collective_device(group)
    layout = layout_difference(model, group, device)
    if layout is not None:
        return f"layout: {layout}"
    return _checksum_difference(model, group, device)


SAME_MODEL_REMEDY = "build the same model (the same config and modifications) on every rank"


def check_layouts_agree(model: nn.Module, group: Optional[dist.ProcessGroup], device: Optional[torch.device],
                        who: str) -> None:
    """Raise the same ValueError on every rank of `group` when the model's parameter or buffer names,
    shapes or dtypes differ across it (before a broadcast of its states, whose sizes would not match).
    Collective."""
    where = layout_difference(model, group, device)
    if where is not None:
        raise ValueError(f"{who}: the model differs across ranks: {where}; {SAME_MODEL_REMEDY}")


def check_replicas_agree(model: nn.Module, group: Optional[dist.ProcessGroup], device: Optional[torch.device],
                         who: str, remedy: str) -> None:
    """Raise the same ValueError on every rank of `group` when the model differs across it: in its layout
    (names, shapes, dtypes), or in its parameters' values (then with `remedy`; not for parameters without
    data: meta or fake tensors). Collective."""
    if _single_rank(group):
        return
    if device is None:
        device = collective_device(group)
    check_layouts_agree(model, group, device, who)
    where = _checksum_difference(model, group, device)
    if where is not None:
        raise ValueError(f"{who}: the model's weights differ across ranks: {where}; {remedy}")
