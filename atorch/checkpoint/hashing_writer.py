"""A DCP storage writer that checksums each data file on the bytes as they are written.

The manifest needs a checksum of every file. Computing it by reading the written files back
costs a second pass over the whole state (as much as the write itself on a fast disk);
`HashingFileSystemWriter` feeds every buffer DCP writes into a data file (`*.distcp`) to the
checksum on its way to the file, so after the save each rank knows the size and checksum of
the files it wrote without reading them. DCP writes its data files strictly sequentially
(tensors appended, offsets taken with `tell()`), which the stream checks: a seek would make
the running checksum wrong, so it raises instead.

DCP's small `.metadata` index (written by the coordinator) and atorch's JSON files are not
data files; they are checksummed by reading them (a few KB).

No CRC32 inside the data files: DCP writes every tensor with `torch.save`, whose zip writer
computes a CRC32 of each record, a second pass over the bytes at ~0.75 GB/s on this project's
CPU machine (3-4x the cost of the write to the page cache, 10x that of xxh3_128). `torch.load`
never checks it; the manifest's checksum of the whole file, verified before every load, is
what detects corruption. So while a data file is written, the writing thread's `torch.save`
calls leave the CRC32 fields zero (`torch.serialization.get_crc32_options`, made thread-aware
once: every other thread, and this one outside a data file, gets torch's own setting).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any, Dict, Generator, Optional, Union

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from atorch.checkpoint import manifest as mf

DATA_SUFFIX = ".distcp"

_THIS_THREAD = threading.local()


def _crc32_hook_installed() -> bool:
    """Make `torch.serialization.get_crc32_options` answer False in a thread writing a data file.

    Installed once per process; returns False (CRC32 computed as before) on a torch without the
    option (< 2.6). The wrapper defers to torch's own setting everywhere else, so a user's
    `torch.save` in another thread (the training thread during an async save) is unchanged.
    """
    import torch.serialization as serialization

    original = getattr(serialization, "get_crc32_options", None)
    if original is None:
        return False
    if getattr(original, "_atorch_thread_aware", False):
        return True

    def get_crc32_options() -> bool:
        if getattr(_THIS_THREAD, "hashing_data_file", False):
            return False
        return bool(original())

    get_crc32_options._atorch_thread_aware = True  # type: ignore[attr-defined]
    get_crc32_options.__doc__ = original.__doc__
    serialization.get_crc32_options = get_crc32_options
    return True


@contextlib.contextmanager
def _no_crc32_in_this_thread() -> Generator[None, None, None]:
    if not _crc32_hook_installed():
        yield
        return
    before = getattr(_THIS_THREAD, "hashing_data_file", False)
    _THIS_THREAD.hashing_data_file = True
    try:
        yield
    finally:
        _THIS_THREAD.hashing_data_file = before


class _HashingStream(io.RawIOBase):
    """A write-only binary stream that checksums what it writes to `raw` and counts the bytes."""

    def __init__(self, raw: Any, algorithm: str) -> None:
        super().__init__()
        self._raw = raw
        self._hash = mf.new_hasher(algorithm)
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        self._hash.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.size

    def seek(self, offset: int, whence: int = 0) -> int:
        if (whence, offset) in ((0, self.size), (1, 0), (2, 0)):
            return self.size
        raise io.UnsupportedOperation("a checksummed checkpoint stream is written sequentially; seek is refused")

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, except that data files opened for writing are checksummed on the way."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.records: Dict[str, mf.FileRecord] = {}  # file path -> size and checksum
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: Union[str, os.PathLike], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode or not str(path).endswith(DATA_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as raw, _no_crc32_in_this_thread():
            stream = _HashingStream(raw, self.algorithm)
            yield stream
            raw.flush()
        with self._lock:
            self.records[str(path)] = mf.FileRecord(stream.size, stream.hexdigest(), self.algorithm)


class HashingFileSystemWriter(FileSystemWriter):
    """`FileSystemWriter` whose data files are checksummed while written; see `records`."""

    def __init__(self, path: str, algorithm: str, **kwargs: Any) -> None:
        mf.check_checksum(algorithm)
        super().__init__(path, **kwargs)
        self._hashing = _HashingFileSystem(algorithm)
        self.fs = self._hashing

    def records(self, root: Optional[str] = None) -> Dict[str, mf.FileRecord]:
        """{path relative to `root` ('/'-separated): record} of the data files this process wrote."""
        out = {}
        for path, record in self._hashing.records.items():
            name = os.path.relpath(path, root) if root is not None else path
            out[name.replace(os.sep, "/")] = record
        return out
