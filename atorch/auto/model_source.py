"""The user's model as the source of every dry-run candidate, without a second copy of its weights.

Each candidate of a search mutates its model (shards, wraps, replaces modules), so each needs its
own; a deep copy per candidate holds the user's weights twice while a candidate runs, and a user
whose model fills half the device cannot search at all (issue 19, section 3).

`ModelSource` takes the user's weights out of memory for the duration of the search instead:
1. `offload()`: every parameter and buffer is written once to a scratch file (raw bytes, one
   file per rank, no pickle), its storage is released, and the user's modules hold meta-device
   stand-ins of the same shapes (enough for the cost model and validation).
2. `build()`: a candidate is a structural copy of the modules whose tensors are read back from
   the file, on the device each tensor came from (created under the dry run's memory tracker,
   so they are counted like the deep copy's were).
3. `restore()`: the weights are read back into the user's own Parameter and buffer objects,
   which return to their modules (identity, ties, `requires_grad` unchanged).

Peak while a candidate runs: the candidate's own tensors only (the user's model holds nothing);
plus, on a GPU, one tensor's host buffer while reading. Disk: the model's bytes per rank, in
`scratch_dir` (default: the system temp directory). Not offloaded (and reported by
`resident_bytes`): tensors already on the meta device (nothing to hold), tensor subclasses
such as DTensor, and plain tensor attributes that are neither parameters nor buffers.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class _Saved:
    """One offloaded tensor: where its bytes are in the scratch file and what it looked like."""

    original: torch.Tensor            # the user's object (its storage released while offloaded)
    stand_in: torch.Tensor            # meta tensor (a Parameter for parameters) in the modules meanwhile
    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.dtype)


class ModelSource:
    """Builds fresh candidates of `model` while the user's weights live in a scratch file.

    Use as a context manager (offload on entry, restore on exit), or call `offload()` /
    `restore()`. Collective-free: every rank manages its own model and file.
    """

    def __init__(self, model: nn.Module, scratch_dir: Optional[str] = None) -> None:
        self.model = model
        self.scratch_dir = scratch_dir
        self.path: Optional[str] = None
        self._saved: List[_Saved] = []
        self._slots: List[Tuple[nn.Module, str, bool, torch.Tensor]] = []   # (module, name, is_param, original)

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "ModelSource":
        self.offload()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    @property
    def offloaded(self) -> bool:
        return self.path is not None

    def offload(self) -> None:
        """Write the weights to the scratch file, release them, leave meta stand-ins in the modules."""
        if self.offloaded:
            raise RuntimeError("ModelSource.offload() called twice without restore()")
        if self.scratch_dir is not None:
            os.makedirs(self.scratch_dir, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"atorch-dryrun-weights-{os.getpid()}-", suffix=".bin",
                                    dir=self.scratch_dir)
        by_id: Dict[int, _Saved] = {}
        slots: List[Tuple[nn.Module, str, bool, torch.Tensor]] = []
        try:
            with os.fdopen(fd, "wb") as f:
                for module in self.model.modules():
                    for is_param, table in ((True, module._parameters), (False, module._buffers)):
                        for name, tensor in table.items():
                            if tensor is None or not _offloadable(tensor):
                                continue
                            slots.append((module, name, is_param, tensor))
                            if id(tensor) not in by_id:
                                by_id[id(tensor)] = _write(f, tensor, is_param)
        except BaseException:
            os.unlink(path)
            raise
        # Only once every byte is on disk: swap in the stand-ins and release the storages.
        for module, name, is_param, tensor in slots:
            slot_table: Dict[str, Any] = module._parameters if is_param else module._buffers
            slot_table[name] = by_id[id(tensor)].stand_in
        for saved in by_id.values():
            saved.original.data = torch.empty(0, dtype=saved.dtype, device=saved.device)
        self.path, self._saved, self._slots = path, list(by_id.values()), slots
        logger.debug("model weights (%d bytes) offloaded to %s for the dry runs", self.offloaded_bytes, path)

    def restore(self) -> None:
        """Read the weights back into the user's own tensors and put those back in the modules."""
        if not self.offloaded:
            return
        path = cast(str, self.path)  # offloaded
        try:
            with open(path, "rb") as f:
                for saved in self._saved:
                    saved.original.data = _read(f, saved)
        except OSError as e:
            raise RuntimeError(f"could not restore the model's weights from the dry-run scratch file {path}: {e}; "
                               "the model's parameters are still meta-device stand-ins") from e
        for module, name, is_param, tensor in self._slots:
            slot_table: Dict[str, Any] = module._parameters if is_param else module._buffers
            slot_table[name] = tensor
        self.path, self._saved, self._slots = None, [], []
        os.unlink(path)

    # -- candidates --------------------------------------------------------------------------------
    def build(self) -> nn.Module:
        """A fresh copy of the model with the user's weights (new tensors, on their original devices)."""
        if not self.offloaded:
            raise RuntimeError("ModelSource.build() needs offload() first")
        memo: Dict[int, Any] = {}
        with open(cast(str, self.path), "rb") as f:  # offloaded
            for saved in self._saved:
                data = _read(f, saved)
                if isinstance(saved.stand_in, nn.Parameter):
                    memo[id(saved.stand_in)] = nn.Parameter(data, requires_grad=saved.stand_in.requires_grad)
                else:
                    memo[id(saved.stand_in)] = data
        return copy.deepcopy(self.model, memo)

    @property
    def offloaded_bytes(self) -> int:
        return sum(s.nbytes for s in self._saved)

    def resident_bytes(self, device: torch.device) -> int:
        """Bytes of the user's parameters and buffers still held on `device`'s type (not offloaded)."""
        seen, total = set(), 0
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            if id(tensor) in seen or tensor.is_meta or tensor.device.type != torch.device(device).type:
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
        return total


def _offloadable(tensor: torch.Tensor) -> bool:
    return (type(tensor) in (torch.Tensor, nn.Parameter) and not tensor.is_meta
            and tensor.layout == torch.strided and tensor.numel() > 0)


def _write(f: Any, tensor: torch.Tensor, is_param: bool) -> _Saved:
    offset = f.tell()
    host = tensor.detach().to("cpu").contiguous()
    f.write(host.reshape(-1).view(torch.uint8).numpy())
    stand_in = torch.empty_like(tensor, device="meta")
    if is_param:
        stand_in = nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
    return _Saved(tensor, stand_in, offset, tuple(tensor.shape), tensor.dtype, tensor.device)


def _read(f: Any, saved: _Saved) -> torch.Tensor:
    """A new tensor with `saved`'s bytes, on its original device (read straight into it on CPU)."""
    host = torch.empty(saved.shape, dtype=saved.dtype)
    f.seek(saved.offset)
    # An ndarray exports the buffer protocol; numpy's stubs do not declare __buffer__.
    view = memoryview(host.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if f.readinto(view) != saved.nbytes:
        raise OSError(f"short read of {saved.nbytes} bytes at offset {saved.offset}")
    return host if saved.device.type == "cpu" else host.to(saved.device)


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
