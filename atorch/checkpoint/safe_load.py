"""Loading that never runs code from a checkpoint file.

The trust boundary: tensors are read with `torch.load(weights_only=True)` (DCP's own data
files) or safetensors; small state is JSON. The one pickle in a DCP checkpoint is torch's
`.metadata` index, which `FileSystemReader` reads with a bare `pickle.load`; `SafeFileSystemReader`
reads it with an unpickler that can build only DCP's metadata classes, so a payload that would
import `os.system` (or anything else) is refused. It also refuses byte (non-tensor) entries,
which DCP would `torch.load(weights_only=False)`, and any data file the manifest does not list.

It also reads faster than `FileSystemReader`: each data file is memory-mapped and every tensor
is copied once, from the page cache into its target (see `_read_mapped`).
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import pickle
import warnings
from typing import IO, Any, Collection, Dict, List, Optional, Tuple, cast

import torch
from torch import _weights_only_unpickler
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from atorch.checkpoint.manifest import CheckpointError, release_pages

logger = logging.getLogger(__name__)

# The mapped read uses torch.load's own loader with an `overall_storage` (its mmap=True path, torch >= 2.1).
def _mapped_load_supported() -> bool:
    import inspect

    try:
        loader = torch.serialization._load  # type: ignore[attr-defined]
        return "overall_storage" in inspect.signature(loader).parameters
    except (AttributeError, TypeError, ValueError):
        return False


_MAPPED_LOAD_OK = _mapped_load_supported()

# (module, name) pairs DCP's metadata pickle legitimately refers to (torch 2.4 .. 2.13).
_DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})


def _is_torch_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self._path}: refused to load: the pickled metadata refers to {module}.{name}, which is not part "
            "of torch.distributed.checkpoint's metadata format and could execute code. The file was not "
            "written by torch.distributed.checkpoint (or was tampered with).")


def load_dcp_metadata(path: str) -> Metadata:
    """Read a DCP `.metadata` file, allowing only DCP's own classes to be built."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoding failure means a corrupted file
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, expected DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that reads metadata without arbitrary unpickling and only manifest-listed files.

    `allowed_files`: relative paths (to `path`) the data may come from; None allows any.
    """

    def __init__(self, path: str, allowed_files: Optional[Collection[str]] = None) -> None:
        super().__init__(path)
        self._allowed = None if allowed_files is None else frozenset(allowed_files)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = str(self._get_metadata_path(rank))
        metadata = load_dcp_metadata(path)
        self._check_storage_files(metadata)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata

    def _check_storage_files(self, metadata: Metadata) -> None:
        if self._allowed is None:
            return
        for info in (metadata.storage_data or {}).values():
            rel = str(info.relative_path)
            if rel not in self._allowed:
                raise CheckpointError(f"{os.path.join(str(self.path), rel)}: referenced by the DCP metadata but "
                                      "not listed in manifest.json, so it is not trusted")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):  # type: ignore[override]
        # DCP turns byte entries into torch.load(weights_only=False); atorch writes tensors only.
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{self.path}: entry {item.dest_index.fqn!r} is a pickled object, not a "
                                      "tensor; refused (atorch checkpoints store only tensors in DCP)")
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(str(self.storage_data[item.storage_index].relative_path), []).append(item)
        for relative_path, items in per_file.items():
            if not self._read_mapped(os.path.join(str(self.path), relative_path), items, planner):
                super().read_data(LoadPlan(items), planner)  # DCP's own reader: a buffer and a copy per item
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_mapped(self, path: str, items: List[ReadItem], planner: LoadPlanner) -> bool:
        """Copy `items` from the memory-mapped file straight into their targets; False: use DCP's reader.

        DCP's reader reads each item into a fresh buffer, deserializes it into a fresh tensor and
        copies that into the target: two copies and an allocation per tensor. Here the file is mapped
        (the page cache's pages, no copy) and each tensor is deserialized with its storage pointing
        into the mapping, so the only copy is into the target. Each item's pages are unmapped once
        copied (they stay in the page cache), so the process's RSS grows by one tensor, not the
        file. The deserialization is torch.load's own, with its weights-only unpickler. Items with
        DCP storage transforms, or a torch whose private loader differs, go through DCP's reader.
        """
        infos = [self.storage_data[item.storage_index] for item in items]
        if any(getattr(info, "transform_descriptors", None) for info in infos) or not _MAPPED_LOAD_OK:
            return False
        with open(path, "rb") as f:
            try:
                # Not closed explicitly: the tensors over it must be gone first; dropping it unmaps.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # e.g. an empty file
                return False
            with warnings.catch_warnings():
                # Read-only on purpose: the mapping is only ever copied from.
                warnings.filterwarnings("ignore", message=".*not writable.*")
                whole = torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()
            for item, info in sorted(zip(items, infos), key=lambda pair: pair[1].offset):
                try:
                    item_file = cast(IO[bytes], _create_file_view(f, info.offset, info.length))
                    archive = torch._C.PyTorchFileReader(item_file)
                    tensor = torch.serialization._load(  # type: ignore[attr-defined]
                        archive, "cpu", _weights_only_unpickler,
                        overall_storage=whole[info.offset:info.offset + info.length])
                except Exception as e:  # noqa: BLE001 - the checksums passed: DCP's reader says what is wrong
                    logger.debug("mapped read of %s failed (%s); using DCP's reader", path, e)
                    return False
                if not isinstance(tensor, torch.Tensor):
                    raise CheckpointError(f"{path}: entry {item.dest_index.fqn!r} is not a tensor")
                tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(f"{path}: entry {item.dest_index.fqn!r} has shape {tuple(tensor.size())}, "
                                          f"the model's is {tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)
                del tensor
                release_pages(mapped, info.offset, info.length)
        return True


def safe_torch_load(path: str, map_location: Any = "cpu") -> Any:
    """`torch.load` with `weights_only=True`; a payload that needs arbitrary code is refused by name."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused to load: it contains pickled objects beyond tensors and plain "
                              f"containers, which could execute code ({e})") from e


def tensor_entries(metadata: Metadata) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor in a DCP checkpoint; byte entries are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = (tuple(md.size), md.properties.dtype)
    return out
