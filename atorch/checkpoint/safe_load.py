"""Loading that never runs code from a checkpoint file.

The trust boundary: tensors are read with `torch.load(weights_only=True)` (DCP's own data
files) or safetensors; small state is JSON. The one pickle in a DCP checkpoint is torch's
`.metadata` index, which `FileSystemReader` reads with a bare `pickle.load`; `SafeFileSystemReader`
reads it with an unpickler that can build only DCP's metadata classes, so a payload that would
import `os.system` (or anything else) is refused. It also refuses byte (non-tensor) entries,
which DCP would `torch.load(weights_only=False)`, and any data file the manifest does not list.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Collection, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from atorch.checkpoint.manifest import CheckpointError

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
        return super().read_data(plan, planner)


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
