"""Token files on disk: writers and readers of Megatron-LM's `.bin` + `.idx` formats.

Three layouts, so corpora preprocessed here load in Megatron-LM and the reverse:
"mmap" (`MMIDIDX` header, memory-mapped) and the older "lazy"/"cached" (`TNTIDX` header;
lazy reads a sequence from disk when asked, cached holds the whole `.bin` in memory).
Our files hold one sequence per document, so `doc_idx` is `0..len`; readers accept any `doc_idx`.

mmap `.idx` (little endian): magic `MMIDIDX\\x00\\x00`, u64 version=1, u8 dtype code, u64 n_seq,
u64 n_doc_idx, i32 sizes[n_seq], i64 byte pointers[n_seq], i64 doc_idx[n_doc_idx].
lazy/cached `.idx`: magic `TNTIDX\\x00\\x00`, u64 version=1, u64 dtype code, u64 element size,
u64 n_seq, u64 n_sizes, u64 n_doc_idx, i64 dim_offsets[n_seq+1], i64 data_offsets[n_seq+1]
(in elements), i64 sizes[n_sizes], i64 doc_idx[n_doc_idx].
"""

from __future__ import annotations

import mmap
import os
import struct
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, NoReturn, Optional, Tuple, Union

import numpy as np

MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
FORMAT_VERSION = 1
BINARIZATION_IMPLS = ("mmap", "lazy", "cached")

DTYPE_CODES: Dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Sizes and offsets are streamed through in blocks of this many entries, so building the
# index of a billion documents needs a few MB, not GBs.
_BLOCK = 1 << 20

PathLike = Union[str, os.PathLike]


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool and not a float that happens to be whole."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_token_id(name: str, value: Any) -> int:
    """`value` as a token id (an int >= 0, not a bool or float); else ValueError naming `name` and the value.

    Callers check the upper bound they know (the vocabulary, the token dtype)."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be None or a token id >= 0, got {value!r}")
    return int(value)


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (vocab < 65500, as in Megatron-LM), else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        raise ValueError(f"dtype {dtype} has no Megatron code; use one of {sorted(map(str, _CODE_OF_DTYPE))}")
    return _CODE_OF_DTYPE[dtype]


def data_path(prefix: PathLike) -> Path:
    return Path(f"{strip_suffix(prefix)}.bin")


def index_path(prefix: PathLike) -> Path:
    return Path(f"{strip_suffix(prefix)}.idx")


def strip_suffix(prefix: PathLike) -> str:
    """`corpus`, `corpus.bin` and `corpus.idx` all name the pair `corpus.bin` + `corpus.idx`."""
    text = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def _check_impl(impl: str) -> None:
    if impl not in BINARIZATION_IMPLS:
        raise ValueError(f"binarization_impl={impl!r} is not supported; choose one of {list(BINARIZATION_IMPLS)}")


# --------------------------------------------------------------------------------------------
# Writing


class IndexedDatasetWriter:
    """Streams sequences into `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`.

    Tokens go straight to disk; the per-sequence sizes go to a temporary file, so memory stays
    flat however large the corpus. Both files appear under their final names only when
    `finalize()` succeeds (written to temporary names, then renamed); `abort()` removes them.
    """

    def __init__(self, prefix: PathLike, dtype: np.dtype, impl: str = "mmap") -> None:
        _check_impl(impl)
        self.prefix = strip_suffix(prefix)
        if os.path.basename(self.prefix) in ("", ".", ".."):
            # `out/` would write the hidden files `out/.bin` and `out/.idx`.
            raise ValueError(f"output prefix {os.fspath(prefix)!r} has no file name part; give a directory and a "
                             "name, e.g. 'out/corpus' (writes out/corpus.bin and out/corpus.idx)")
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype)
        self.impl = impl
        self.num_sequences = 0
        self.num_tokens = 0
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = Path(f"{self.prefix}.bin{tag}")
        self._idx_tmp = Path(f"{self.prefix}.idx{tag}")
        self._sizes_tmp = Path(f"{self.prefix}.sizes{tag}")
        self._bin: Optional[BinaryIO] = open(self._bin_tmp, "wb")
        self._sizes: Optional[BinaryIO] = open(self._sizes_tmp, "wb")

    def add_sequences(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append `len(sizes)` sequences stored back to back in the flat array `tokens`."""
        if self._bin is None or self._sizes is None:
            raise ValueError(f"writer for {self.prefix!r} is already finalized or aborted")
        tokens = self._checked_tokens(tokens)
        sizes = np.ascontiguousarray(sizes, dtype=np.int32)
        if int(sizes.sum(dtype=np.int64)) != tokens.size:
            raise ValueError(f"sizes sum to {int(sizes.sum())} tokens but {tokens.size} tokens were given")
        self._bin.write(tokens.tobytes())
        self._sizes.write(sizes.tobytes())
        self.num_sequences += int(sizes.size)
        self.num_tokens += int(tokens.size)

    def _checked_tokens(self, tokens: Any) -> np.ndarray:
        """`tokens` as a flat array of the file's dtype; ValueError naming the first id that is not an integer, is
        negative or does not fit the dtype (a cast would store another id: 70000 as 4464 in uint16, -1 as 65535,
        1.7 as 1). One min/max pass over the chunk: small next to tokenizing and writing it."""
        array = np.asarray(tokens)
        if array.size == 0:
            return np.zeros(0, dtype=self.dtype)   # `[]` is a float64 array: no id to check
        flat = array.reshape(-1)
        if array.dtype.kind in "iu":
            low, high = int(flat.min()), int(flat.max())
        else:   # floats, bools, objects (Python ints too large for int64 among them)
            values = flat.tolist()
            bad = next((v for v in values if not is_int(v)), None)
            if bad is not None:
                raise ValueError(f"token ids must be integers, got {bad!r} (in a {array.dtype} array) for the "
                                 f"{self.dtype} tokens of {self.prefix!r}")
            low, high = min(values), max(values)
        if low < 0:
            raise ValueError(f"token id {low} is negative; token ids are >= 0 ({self.prefix!r})")
        if self.dtype.kind in "iu" and high > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {high} does not fit the {self.dtype} tokens of {self.prefix!r} (at most "
                             f"{np.iinfo(self.dtype).max}); write with a wider dtype (best_fitting_dtype(vocab_size))")
        return np.ascontiguousarray(flat, dtype=self.dtype)

    def add_sequence(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        self.add_sequences(tokens, np.array([tokens.size], dtype=np.int32))

    def finalize(self) -> None:
        """Write the index and move both files to their final names (index last)."""
        if self._bin is None or self._sizes is None:
            raise ValueError(f"writer for {self.prefix!r} is already finalized or aborted")
        self._bin.close()
        self._sizes.close()
        self._bin = self._sizes = None
        try:
            with open(self._idx_tmp, "wb") as index, open(self._sizes_tmp, "rb") as sizes:
                if self.impl == "mmap":
                    self._write_mmap_index(index, sizes)
                else:
                    self._write_legacy_index(index, sizes)
            os.replace(self._bin_tmp, data_path(self.prefix))
            os.replace(self._idx_tmp, index_path(self.prefix))
        finally:
            self._remove_temporaries()

    def abort(self) -> None:
        """Close and delete everything written so far; the final names are never touched."""
        for handle in (self._bin, self._sizes):
            if handle is not None:
                handle.close()
        self._bin = self._sizes = None
        self._remove_temporaries()

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._bin is not None:
            self.finalize()

    def _remove_temporaries(self) -> None:
        for path in (self._bin_tmp, self._idx_tmp, self._sizes_tmp):
            path.unlink(missing_ok=True)

    def _size_blocks(self, sizes: BinaryIO) -> Iterator[np.ndarray]:
        sizes.seek(0)
        while True:
            block = np.frombuffer(sizes.read(_BLOCK * 4), dtype=np.int32)
            if block.size == 0:
                return
            yield block

    def _write_mmap_index(self, index: BinaryIO, sizes: BinaryIO) -> None:
        n = self.num_sequences
        index.write(MMAP_MAGIC)
        index.write(struct.pack("<Q", FORMAT_VERSION))
        index.write(struct.pack("<B", self.code))
        index.write(struct.pack("<Q", n))
        index.write(struct.pack("<Q", n + 1))
        for block in self._size_blocks(sizes):
            index.write(block.tobytes())
        # Byte pointers: exclusive prefix sum of sizes * itemsize, carried across blocks.
        start = 0
        for block in self._size_blocks(sizes):
            ends = np.cumsum(block, dtype=np.int64) * self.dtype.itemsize + start
            index.write((ends - block.astype(np.int64) * self.dtype.itemsize).tobytes())
            start = int(ends[-1])
        _write_range(index, 0, n + 1)

    def _write_legacy_index(self, index: BinaryIO, sizes: BinaryIO) -> None:
        n = self.num_sequences
        index.write(LEGACY_MAGIC)
        index.write(struct.pack("<Q", FORMAT_VERSION))
        index.write(struct.pack("<QQ", self.code, self.dtype.itemsize))
        index.write(struct.pack("<QQ", n, n))
        index.write(struct.pack("<Q", n + 1))
        _write_range(index, 0, n + 1)  # dim_offsets: every sequence is 1-D
        index.write(struct.pack("<q", 0))  # data_offsets, in elements
        start = 0
        for block in self._size_blocks(sizes):
            ends = np.cumsum(block, dtype=np.int64) + start
            index.write(ends.tobytes())
            start = int(ends[-1])
        for block in self._size_blocks(sizes):
            index.write(block.astype(np.int64).tobytes())
        _write_range(index, 0, n + 1)  # doc_idx


def _write_range(f: BinaryIO, start: int, stop: int) -> None:
    for lo in range(start, stop, _BLOCK):
        f.write(np.arange(lo, min(lo + _BLOCK, stop), dtype=np.int64).tobytes())


# --------------------------------------------------------------------------------------------
# Reading


class _IndexedTokens:
    """What every reader offers: `len`, `[i]`, `get(i, offset, length)`, `sizes`, `doc_idx`, `dtype`."""

    prefix: str
    dtype: np.dtype
    sizes: np.ndarray
    doc_idx: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        raise NotImplementedError

    def _window(self, i: int, offset: int, length: Optional[int]) -> tuple:
        # On every sample read: scalar `.item` and plain int arithmetic, no numpy scalars.
        n = self.sizes.shape[0]
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix!r} with {n} sequences")
        if i < 0:
            i += n
        size = self.sizes.item(i)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of "
                             f"{self.prefix!r} with {size} tokens")
        return i, offset, length


def _check_files(prefix: str) -> None:
    idx, bin_ = index_path(prefix), data_path(prefix)
    if not idx.is_file():
        raise FileNotFoundError(f"index file {str(idx)!r} not found (data file {str(bin_)!r} "
                                f"{'exists' if bin_.is_file() else 'is missing too'}); preprocess the corpus "
                                "with DatasetPreprocessor to create both")
    if not bin_.is_file():
        raise FileNotFoundError(f"data file {str(bin_)!r} not found next to its index {str(idx)!r}")


def _check_data_size(prefix: str, expected_bytes: int) -> None:
    actual = data_path(prefix).stat().st_size
    if actual != expected_bytes:
        raise ValueError(f"data file {str(data_path(prefix))!r} has {actual} bytes but its index "
                         f"{str(index_path(prefix))!r} describes {expected_bytes} bytes; the pair does not match "
                         "(truncated copy, files from different runs, or a damaged index): copy both files again "
                         "or rebuild them (atorch preprocess)")


def _check_sequence_layout(prefix: str, sizes: np.ndarray, starts: np.ndarray, start_unit: int,
                           itemsize: int) -> None:
    """ValueError naming the `.idx` and the first sequence where `sizes` and `starts` disagree.

    Every writer of these formats (ours, Megatron-LM's, megatron-core's) stores the sequences back to back
    from byte 0 of the `.bin` and derives each start from the sizes before it: `starts[0] == 0`,
    `starts[i + 1] == starts[i] + sizes[i] * itemsize`, and no size is negative. A size or start changed in
    place keeps the file length, so the header checks passed, and was read silently (samples mixed in other
    sequences' tokens) or failed at a read with numpy's "offset must be non-negative and no greater than
    buffer length". `starts` holds one entry per sequence (mmap: byte pointers) or one more (lazy/cached:
    the end of the last sequence too), in units of `start_unit` bytes. Vectorized, in blocks of `_BLOCK`
    entries: memory stays flat and the cost is one pass over the index (measured here: 0.06 s for 20 million
    sequences from the page cache, about what opening the index took before).
    """
    n, count = int(sizes.shape[0]), int(starts.shape[0])
    expected_start = 0    # of the block's first entry: the first sequence starts at byte 0
    for lo in range(0, count, _BLOCK):
        hi = min(lo + _BLOCK, count)
        block_starts = np.asarray(starts[lo:hi], dtype=np.int64)   # a view of the mapped index when it is int64
        if start_unit != 1:
            block_starts = block_starts * start_unit
        block_sizes = sizes[lo:min(hi, n)].astype(np.int64)
        expected = np.empty(hi - lo, dtype=np.int64)
        expected[0] = expected_start
        expected[1:] = block_starts[:-1] + block_sizes[:hi - lo - 1] * itemsize
        bad = block_starts != expected
        bad[:block_sizes.size] |= block_sizes < 0
        if bad.any():
            _raise_bad_sequence(prefix, sizes, starts, start_unit, itemsize, lo + int(np.argmax(bad)))
        if hi < count:
            expected_start = int(block_starts[-1]) + int(block_sizes[-1]) * itemsize


def _raise_bad_sequence(prefix: str, sizes: np.ndarray, starts: np.ndarray, start_unit: int, itemsize: int,
                        i: int) -> NoReturn:
    """The error of `_check_sequence_layout` for entry `i` of `starts`, the first one that is wrong."""
    idx, bin_ = str(index_path(prefix)), str(data_path(prefix))
    n = int(sizes.shape[0])
    fix = (f"rebuild the pair: preprocess the corpus again (atorch preprocess --input <corpus> --output-prefix "
           f"{prefix}), or copy both files again if they are a copy")
    start = int(starts[i]) * start_unit
    if i == 0:
        expected_start, expected = 0, "the first sequence starts at byte 0"
    else:
        previous, size = int(starts[i - 1]) * start_unit, int(sizes[i - 1])
        expected_start = previous + size * itemsize
        expected = (f"sequence {i - 1} ({size} tokens of {itemsize} bytes from byte {previous}) ends at byte "
                    f"{expected_start}")
    if start == expected_start:    # the start is right, so the size is what is wrong
        raise ValueError(f"index file {idx!r} is damaged at sequence {i}: its size is {int(sizes[i])} tokens, a "
                         f"negative count; {fix}")
    data_bytes = data_path(prefix).stat().st_size
    outside = f", outside the data file {bin_!r} ({data_bytes} bytes)" if not 0 <= start <= data_bytes else ""
    what = f"at sequence {i}: it starts" if i < n else f"after its last sequence: its {n} sequences end"
    raise ValueError(f"index file {idx!r} is damaged {what} at byte {start}{outside}, but {expected}; {fix}")


def _check_index_start(idx: Path, magic: bytes, header: int, other_layout_hint: str) -> None:
    """The index starts with `magic` and holds a whole header: a wrong layout and a truncated file
    get different messages (a truncated index used to be reported as the wrong layout)."""
    with open(idx, "rb") as f:
        start = f.read(header)
    if not start:
        raise ValueError(f"index file {str(idx)!r} is empty (0 bytes); write it again with DatasetPreprocessor")
    if start[:len(magic)] != magic[:len(start)]:
        raise ValueError(f"index file {str(idx)!r} does not start with {magic!r} (found {start[:len(magic)]!r}); "
                         f"{other_layout_hint}")
    if len(start) < header:
        raise ValueError(f"index file {str(idx)!r} is truncated: {len(start)} bytes, shorter than its {header}-byte "
                         "header; copy it again or write it again with DatasetPreprocessor")


def _dtype_of(code: int, idx: Path) -> np.dtype:
    if code not in DTYPE_CODES:
        raise ValueError(f"index file {str(idx)!r} has dtype code {code}; expected one of {sorted(DTYPE_CODES)}")
    return DTYPE_CODES[code]


def _map_readonly(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:  # the mapping outlives the file descriptor
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class MMapIndexedDataset(_IndexedTokens):
    """Reader of the "mmap" layout: both files memory-mapped, nothing loaded up front."""

    def __init__(self, prefix: PathLike) -> None:
        self.prefix = strip_suffix(prefix)
        _check_files(self.prefix)
        idx = index_path(self.prefix)
        header = 9 + 8 + 1 + 8 + 8
        _check_index_start(idx, MMAP_MAGIC, header, "is it a 'lazy'/'cached' index? pass binarization_impl "
                                                    "accordingly")
        buffer = np.memmap(idx, dtype=np.uint8, mode="r")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(buffer[9:header]))
        if version != FORMAT_VERSION:
            raise ValueError(f"index file {str(idx)!r} has version {version}; expected {FORMAT_VERSION}")
        self.dtype = _dtype_of(code, idx)
        expected = header + n_seq * (4 + 8) + n_doc * 8
        if buffer.size != expected:
            raise ValueError(f"index file {str(idx)!r} has {buffer.size} bytes but its header ({n_seq} sequences, "
                             f"{n_doc} document entries) needs {expected} bytes")
        self.sizes = np.frombuffer(buffer, dtype=np.int32, count=n_seq, offset=header)
        self.pointers = np.frombuffer(buffer, dtype=np.int64, count=n_seq, offset=header + 4 * n_seq)
        self.doc_idx = np.frombuffer(buffer, dtype=np.int64, count=n_doc, offset=header + 12 * n_seq)
        _check_sequence_layout(self.prefix, self.sizes, self.pointers, 1, self.dtype.itemsize)
        total = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        _check_data_size(self.prefix, total)
        self._index_buffer = buffer
        # The raw mmap, not an np.memmap: np.frombuffer over it is ~3x cheaper per read.
        self._data = _map_readonly(data_path(self.prefix)) if total else b""

    def __getstate__(self) -> dict:
        # Pickled into DataLoader workers: send the name, not the mapped bytes.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]  # unpickling rebuilds this very class

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        i, offset, length = self._window(i, offset, length)
        start = self.pointers.item(i) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, dtype=self.dtype, count=length, offset=start)


class _LegacyIndex(_IndexedTokens):
    """Shared index parsing of the "lazy" and "cached" (`TNTIDX`) layouts."""

    def __init__(self, prefix: PathLike) -> None:
        self.prefix = strip_suffix(prefix)
        _check_files(self.prefix)
        idx = index_path(self.prefix)
        header = 8 + 8 + 16 + 16 + 8
        _check_index_start(idx, LEGACY_MAGIC, header, "is it an 'mmap' index? pass binarization_impl='mmap'")
        raw = idx.read_bytes()
        version, code, element_size, n_seq, n_sizes, n_doc = struct.unpack("<QQQQQQ", raw[8:header])
        if version != FORMAT_VERSION:
            raise ValueError(f"index file {str(idx)!r} has version {version}; expected {FORMAT_VERSION}")
        self.dtype = _dtype_of(code, idx)
        if element_size != self.dtype.itemsize:
            raise ValueError(f"index file {str(idx)!r} has element size {element_size} for dtype {self.dtype}; "
                             f"expected {self.dtype.itemsize}")
        expected = header + 8 * (2 * (n_seq + 1) + n_sizes + n_doc)
        if len(raw) != expected:
            raise ValueError(f"index file {str(idx)!r} has {len(raw)} bytes but its header ({n_seq} sequences, "
                             f"{n_sizes} sizes, {n_doc} document entries) needs {expected} bytes")
        arrays = np.frombuffer(raw, dtype=np.int64, offset=header)
        dim_offsets = arrays[: n_seq + 1]
        self.data_offsets = arrays[n_seq + 1: 2 * n_seq + 2]
        all_sizes = arrays[2 * n_seq + 2: 2 * n_seq + 2 + n_sizes]
        self.doc_idx = arrays[2 * n_seq + 2 + n_sizes:]
        if n_sizes != n_seq or not np.array_equal(dim_offsets, np.arange(n_seq + 1)):
            raise ValueError(f"index file {str(idx)!r} holds multi-dimensional sequences; only 1-D token "
                             "sequences are supported")
        self.sizes = all_sizes
        _check_sequence_layout(self.prefix, self.sizes, self.data_offsets, element_size, element_size)
        _check_data_size(self.prefix, int(self.data_offsets[-1]) * element_size)


class IndexedDataset(_LegacyIndex):
    """Reader of the "lazy" layout: the index in memory, each sequence read from disk when asked."""

    def __init__(self, prefix: PathLike) -> None:
        super().__init__(prefix)
        self._file: Optional[BinaryIO] = None
        self._file_pid = -1

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        i, offset, length = self._window(i, offset, length)
        # One handle per process: DataLoader workers fork and must not share a file position.
        if self._file is None or self._file_pid != os.getpid():
            self._file = open(data_path(self.prefix), "rb", buffering=0)
            self._file_pid = os.getpid()
        out = np.empty(length, dtype=self.dtype)
        self._file.seek((int(self.data_offsets[i]) + offset) * self.dtype.itemsize)
        self._file.readinto(memoryview(out).cast("B"))  # type: ignore[attr-defined, arg-type]  # raw FileIO; ndarray is a buffer
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_file"], state["_file_pid"] = None, -1
        return state

    def __del__(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()


class IndexedCachedDataset(_LegacyIndex):
    """Reader of the "cached" layout: the whole `.bin` is read into memory once, at open."""

    def __init__(self, prefix: PathLike) -> None:
        super().__init__(prefix)
        self._data = np.fromfile(data_path(self.prefix), dtype=self.dtype)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        i, offset, length = self._window(i, offset, length)
        start = int(self.data_offsets[i]) + offset
        return self._data[start: start + length]


IndexedTokens = Union[MMapIndexedDataset, IndexedDataset, IndexedCachedDataset]

# Tokens per block of `token_id_bounds`' scan: 32 MB of uint16, so a scan never holds more than one block.
_SCAN_BLOCK = 1 << 24


def token_id_bounds(tokens: _IndexedTokens) -> Optional[Tuple[int, int]]:
    """(smallest, largest) token id in the `.bin` of `tokens` (any layout: the file is the tokens back to back),
    or None for a file without tokens.

    Cost: one sequential read of the whole `.bin` through a memory map, in blocks (no copy of the file in
    memory): measured 0.07 s per GB (uint16, min and max) from the page cache here; from disk, the disk's
    read speed.
    """
    path = data_path(tokens.prefix)
    if path.stat().st_size < tokens.dtype.itemsize:
        return None   # np.memmap refuses an empty file
    data = np.memmap(path, dtype=tokens.dtype, mode="r")
    low, high = data[:1].item(), data[:1].item()
    for start in range(0, data.size, _SCAN_BLOCK):
        block = data[start:start + _SCAN_BLOCK]
        low, high = min(low, block.min().item()), max(high, block.max().item())
    return low, high


def open_indexed_dataset(prefix: PathLike, binarization_impl: str = "mmap") -> IndexedTokens:
    """Open `<prefix>.bin` + `<prefix>.idx` with the reader of `binarization_impl`."""
    _check_impl(binarization_impl)
    if binarization_impl == "mmap":
        return MMapIndexedDataset(prefix)
    if binarization_impl == "lazy":
        return IndexedDataset(prefix)
    return IndexedCachedDataset(prefix)
