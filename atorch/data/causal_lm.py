"""Fixed-length causal-LM samples cut from a tokenized corpus (`.bin` + `.idx`).

The documents of a split are concatenated (the EOD tokens written by the preprocessor keep
them apart) and cut into `max_seq_length` tokens per sample. A document is what the file's
document index (Megatron's `doc_idx`) says: one sequence in files written here, several in
Megatron files written with `--split-sentences`. The sample index is built once, cached next to
the data (or in `cache_dir`), and memory-mapped by every rank and DataLoader worker.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from atorch.data.indexed_dataset import (
    PathLike,
    check_token_id,
    data_path,
    is_int,
    open_indexed_dataset,
    strip_suffix,
    token_id_bounds,
)
from atorch.distributed import local_rank
from atorch.distributed.agreement import agree, agree_on_error, agree_on_values


def _save_atomically(path: Path, array: np.ndarray) -> None:
    # A unique temporary name per process: the local rank 0 of every node may build the same
    # file on a shared filesystem at once; each rename then installs a complete, identical file.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_once_per_node(is_built: Callable[[], bool], build: Callable[[], None], what: str) -> None:
    """Run `build` on the local rank 0 of each node (if `is_built()` is False); the others wait.

    Without a process group, just builds. A failure on a builder is raised on every rank (the same
    exception, naming the ranks that failed: `agreement.agree`), instead of leaving the others
    blocked at a barrier; the vote doubles as the barrier.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not is_built():
            build()
        return
    failure: Optional[BaseException] = None
    if local_rank() == 0 and not is_built():
        try:
            build()
        except Exception as e:  # noqa: BLE001 - voted on below, then raised on every rank
            failure = e
    agree(f"building {what} on the local rank 0 of each node", failure)


_PATH_SEPARATORS = tuple({"/", "\\", os.sep} | ({os.altsep} if os.altsep else set()))


def _document_index(tokens: Any, data_name: str) -> Optional[np.ndarray]:
    """The file's document index (Megatron's `doc_idx`: document d is sequences `[doc_idx[d], doc_idx[d+1])`),
    or None for a file that records no document boundaries (`doc_idx` of `[0]`: an older builder's items
    without `end_document`), read one sequence per document as before.

    The index must start at 0 and end at the number of sequences, or it describes other sequences than
    the file's (Megatron's reader asserts the same).
    """
    n = len(tokens)
    doc_idx = tokens.doc_idx
    if doc_idx.size <= 1:
        return None
    if int(doc_idx[0]) != 0 or int(doc_idx[-1]) != n:
        raise ValueError(f"the document index of {data_name!r} runs from sequence {int(doc_idx[0])} to "
                         f"{int(doc_idx[-1])} but the file holds sequences 0 to {n}: the .idx file is damaged or "
                         "was not written with this .bin; write the corpus again")
    return doc_idx


def _weight_name(weight: float) -> str:
    """A split boundary in a cache file name: `%g` as before for round values (0, 0.5, 0.99, 1: the names
    already on disk stay valid), else the shortest exact repr, so 0.5000001 and 0.5000002 get distinct
    names instead of sharing "0.5" (and one split reading the other's index)."""
    short = f"{weight:g}"
    return short if float(short) == weight else repr(float(weight))


class DatasetForCausalLM(Dataset):
    """Samples of `max_seq_length` tokens from documents `[start_weight * N, end_weight * N)`.

    Args:
        data_name: path prefix of `<data_name>.bin` and `<data_name>.idx`.
        max_seq_length: tokens per sample. The last `total % max_seq_length` tokens of the split
            are dropped.
        split_type: a name for the split ("train", "valid", ...); part of the cache file names, so
            without path separators.
        start_weight, end_weight: the split as fractions of the N documents in the file. A document
            is the sequences between two consecutive entries of the file's document index (Megatron's
            `doc_idx`), kept together and in order, as Megatron's GPTDataset does: one sequence in files
            from `DatasetPreprocessor`, several in Megatron files written with `--split-sentences`.
            Splits with touching weights (0-0.9, 0.9-1) are disjoint and together complete.
        binarization_impl: "mmap", "lazy" or "cached", as the files were written.
        seed: None keeps the file order. An int shuffles the document order before concatenation
            and the sample order, deterministically.
        eod_token_id: insert this token after every non-empty document (none after an empty one, as
            Megatron's and atorch's preprocessors append EOD). Only for files written with
            `append_eod=False`; files from `DatasetPreprocessor` already end documents with EOD.
        cache_dir: the directory of the sample index files; None (the default) puts them next to the
            data, which must then be writable. Give one for data on read-only storage. Every rank of a
            node must give the same one (its local rank 0 builds the index there); the file names then
            carry a hash of the data's absolute path, so corpora of the same name do not collide.
        vocab_size: the model's vocabulary size, to refuse a corpus (or `eod_token_id`) with a token id
            >= it at construction (ValueError naming the file, its largest id and `vocab_size`) instead
            of an index error inside the embedding (a device-side assert on GPUs) at the first step.
            Costs one read of the whole `.bin` (the local rank 0 of each node; `token_id_bounds`), skipped
            when the file's dtype cannot hold an id >= vocab_size (uint16 and a vocabulary of 65536+).
            None (the default): not checked.

    Each item is `{"input_ids": LongTensor[max_seq_length], "labels": LongTensor[max_seq_length]}`
    with `labels` a copy of `input_ids`: the Hugging Face convention, where the causal LM shifts
    labels by one inside `forward` (token t is trained to predict token t+1; the last position of
    a sample has no target). Samples do not overlap, so one next-token pair per sample boundary is
    not trained on.

    The index (document order, document offsets, sample order) is written once, atomically, as
    `<data_name>_<split>_<seq>sl_<start>_<end>_<seed>s_{doc_order,doc_offsets,samples}.npy` (the weights
    as `%g` when that is exact, else as their repr; `_docs` before the kind when a document of the
    split holds other than one sequence);
    under torch.distributed the local rank 0 of each node builds it and the other ranks wait, so
    every rank must construct the dataset (the constructor holds collectives), with the same
    arguments: they are compared first, and a difference, or an error on any rank, raises the same
    exception on every rank.
    """

    def __init__(self, data_name: PathLike, max_seq_length: int, split_type: str = "train",
                 start_weight: float = 0.0, end_weight: float = 1.0, binarization_impl: str = "mmap",
                 seed: Optional[int] = None, eod_token_id: Optional[int] = None, *,
                 cache_dir: Optional[PathLike] = None, vocab_size: Optional[int] = None) -> None:
        what = "DatasetForCausalLM"     # the same on every rank: the agreed messages must be too
        with agree_on_error(what):
            self._check_arguments(max_seq_length, split_type, start_weight, end_weight, seed, cache_dir, vocab_size)
            self._open(data_name, max_seq_length, split_type, start_weight, end_weight, binarization_impl, seed,
                       eod_token_id, cache_dir)
            self.vocab_size = vocab_size
            if vocab_size is not None:
                self._check_vocabulary(vocab_size)
        # Ranks building or reading different index files would wait for each other or read files never built.
        agree_on_values(what, self._agreed_values(cache_dir))
        stem = str(self.index_files["samples"])[:-len("_samples.npy")]
        build_once_per_node(lambda: all(p.is_file() for p in self.index_files.values()), self._build_index,
                            f"the sample index {stem}_*.npy")
        with agree_on_error(f"{what}: reading the sample index {stem}_*.npy"):
            self._load_index()
            self._check_index_lengths()

    @staticmethod
    def _check_arguments(max_seq_length: Any, split_type: Any, start_weight: Any, end_weight: Any, seed: Any,
                         cache_dir: Any, vocab_size: Any = None) -> None:
        """ValueError naming the first argument out of its range (local: the caller agrees on the outcome)."""
        for name, weight in (("start_weight", start_weight), ("end_weight", end_weight)):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ValueError(f"{name} must be a number in [0, 1], got {type(weight).__name__} {weight!r}")
        if not isinstance(split_type, str) or any(sep in split_type for sep in _PATH_SEPARATORS):
            raise ValueError(f"split_type={split_type!r} must be a str without path separators: it is part of the "
                             "cache file names next to the data")
        if not 0.0 <= start_weight < end_weight <= 1.0:
            raise ValueError(f"need 0 <= start_weight < end_weight <= 1, got start_weight={start_weight}, "
                             f"end_weight={end_weight}")
        if not is_int(max_seq_length) or max_seq_length < 2:
            # A causal LM predicts each token from those before it: a sample of one token has nothing to predict
            # (its loss is nan and trains nothing).
            raise ValueError(f"max_seq_length must be an int >= 2 (a sample of one token has no next token to "
                             f"predict), got {max_seq_length!r}")
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ValueError(f"seed must be None (file order) or an int >= 0, got {seed!r}")
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
            raise ValueError(f"vocab_size must be None (not checked) or an int >= 1, got {vocab_size!r}")
        if cache_dir is not None and not (isinstance(cache_dir, (str, os.PathLike)) and os.path.isdir(cache_dir)):
            raise ValueError(f"cache_dir={cache_dir!r} must be None (the index next to the data) or an existing "
                             "directory; create it first")

    def _open(self, data_name: PathLike, max_seq_length: int, split_type: str, start_weight: float,
              end_weight: float, binarization_impl: str, seed: Optional[int], eod_token_id: Optional[int],
              cache_dir: Optional[PathLike]) -> None:
        """Open the files, find the split's documents and their lengths, and name the index files."""
        if eod_token_id is not None:
            eod_token_id = check_token_id("eod_token_id", eod_token_id)
        self.data_name = strip_suffix(data_name)
        self.max_seq_length = int(max_seq_length)
        self.split_type = split_type
        self.binarization_impl = binarization_impl
        self.seed = seed
        self.eod_token_id = eod_token_id
        self.tokens = open_indexed_dataset(self.data_name, binarization_impl)
        if eod_token_id is not None and eod_token_id > np.iinfo(self.tokens.dtype).max:
            raise ValueError(f"eod_token_id={eod_token_id} does not fit the {self.tokens.dtype} tokens of "
                             f"{self.data_name!r} (at most {np.iinfo(self.tokens.dtype).max})")
        # Whether the file has a document index (else every sequence is a document); read through
        # `self.tokens`, so that DataLoader workers reopen it instead of receiving a copy.
        self._has_documents = _document_index(self.tokens, self.data_name) is not None
        n = self._file_documents()
        # The same rounding for both ends, so touching splits share their boundary exactly.
        self.document_range: Tuple[int, int] = (int(round(start_weight * n)), int(round(end_weight * n)))
        lo, hi = self.document_range
        if hi <= lo:
            raise ValueError(f"split {split_type!r} (start_weight={start_weight}, end_weight={end_weight}) of the "
                             f"{n} documents in {self.data_name!r} is empty")
        tokens, single = self._document_lengths()
        # An inserted EOD ends every non-empty document; an empty one gets none (Megatron's preprocessor writes
        # none for it either), so it adds no lone-EOD sample.
        self._lengths = tokens if eod_token_id is None else tokens + (tokens > 0)
        self._eod_skips_empty = eod_token_id is not None and bool(np.any(tokens == 0))
        self.num_tokens = int(self._lengths.sum())
        if self.max_seq_length > self.num_tokens:
            raise ValueError(f"max_seq_length={self.max_seq_length} is larger than split {split_type!r} of "
                             f"{self.data_name!r}, which holds {self.num_tokens} tokens (documents [{lo}, {hi}))")
        self.index_files: Dict[str, Path] = {k: Path(f"{self._index_stem(start_weight, end_weight, single, cache_dir)}"
                                                     f"_{k}.npy") for k in ("doc_order", "doc_offsets", "samples")}

    def _check_vocabulary(self, vocab_size: int) -> None:
        """ValueError when `eod_token_id` or a token id of the file is outside [0, vocab_size)."""
        where = f"{str(data_path(self.data_name))!r}"
        if self.eod_token_id is not None and self.eod_token_id >= vocab_size:
            raise ValueError(f"eod_token_id={self.eod_token_id} is outside the model's vocabulary: vocab_size="
                             f"{vocab_size}")
        dtype = self.tokens.dtype
        if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
            return   # every id the file can hold is in the vocabulary: nothing to read
        if dist.is_available() and dist.is_initialized() and local_rank() != 0:
            return   # one read per node: local rank 0's failure is raised on every rank (agree_on_error)
        bounds = token_id_bounds(self.tokens)
        if bounds is None:
            return
        low, high = bounds
        if high >= vocab_size:
            raise ValueError(f"{where} holds token id {high}, but the model's vocab_size is {vocab_size} (ids must be "
                             f"below it): the corpus was tokenized with another tokenizer; tokenize it again with the "
                             "model's own")
        if low < 0:
            raise ValueError(f"{where} holds the negative token id {low}: the file is damaged or not token ids")

    def _document_lengths(self) -> Tuple[np.ndarray, bool]:
        """Tokens of each document of the split (its sequences together), and whether each is one sequence."""
        lo, hi = self.document_range
        if not self._has_documents:
            return self.tokens.sizes[lo:hi].astype(np.int64), True
        bounds = self.tokens.doc_idx[lo:hi + 1].astype(np.int64)
        counts = np.diff(bounds)
        if counts.size and int(counts.min()) < 0:
            d = lo + int(np.argmax(counts < 0))
            raise ValueError(f"the document index of {self.data_name!r} goes back from sequence {int(bounds[d - lo])} "
                             f"to {int(bounds[d - lo + 1])} at document {d}: the .idx file is damaged; write the "
                             "corpus again")
        first = int(bounds[0])
        ends = np.zeros(int(bounds[-1]) - first + 1, dtype=np.int64)
        np.cumsum(self.tokens.sizes[first:int(bounds[-1])], out=ends[1:])
        return ends[bounds[1:] - first] - ends[bounds[:-1] - first], bool(np.all(counts == 1))

    def _index_stem(self, start_weight: float, end_weight: float, single: bool, cache_dir: Optional[PathLike]) -> str:
        """The index files' path without `_<kind>.npy`. Files whose documents are one sequence each keep the
        names of before documents were read from the document index (their index is the same); others get
        `_docs`, so an index an older atorch built over their sequences is never read as theirs."""
        # `-nonempty` where the split has empty documents: an older atorch gave each an EOD, and its index
        # (other lengths) must not be read as this one.
        eod = "" if self.eod_token_id is None else f"_eod{self.eod_token_id}"
        eod += "-nonempty" if self._eod_skips_empty else ""
        docs = "" if single else "_docs"
        prefix = self.data_name
        if cache_dir is not None:
            where = hashlib.sha1(os.path.abspath(self.data_name).encode("utf-8")).hexdigest()[:10]
            prefix = os.path.join(os.fspath(cache_dir), f"{os.path.basename(self.data_name)}-{where}")
        return (f"{prefix}_{self.split_type}_{self.max_seq_length}sl_{_weight_name(start_weight)}_"
                f"{_weight_name(end_weight)}_{self.seed}s{eod}{docs}")

    def _agreed_values(self, cache_dir: Optional[PathLike]) -> Dict[str, str]:
        """What decides the index files, which every rank must share (the data's directory may differ
        between nodes, e.g. local copies; its name and contents may not)."""
        lo, hi = self.document_range
        return {"data file name": os.path.basename(self.data_name), "max_seq_length": repr(self.max_seq_length),
                "split_type": repr(self.split_type), "binarization_impl": repr(self.binarization_impl),
                "split": f"documents [{lo}, {hi}) of {self._file_documents()}, {self.num_tokens} tokens",
                "seed": repr(self.seed), "eod_token_id": repr(self.eod_token_id), "vocab_size": repr(self.vocab_size),
                "cache_dir": "next to the data" if cache_dir is None else repr(os.fspath(cache_dir))}

    def _file_documents(self) -> int:
        """Documents in the whole file."""
        return self.tokens.doc_idx.size - 1 if self._has_documents else len(self.tokens)

    @property
    def num_documents(self) -> int:
        return self.document_range[1] - self.document_range[0]

    def _build_index(self) -> None:
        lo, hi = self.document_range
        rng = np.random.default_rng(self.seed)
        order = np.arange(lo, hi, dtype=np.int64)
        if self.seed is not None:
            order = rng.permutation(order)
        offsets = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(self._lengths[order - lo], out=offsets[1:])
        n_samples = self.num_tokens // self.max_seq_length
        samples = rng.permutation(n_samples).astype(np.int64) if self.seed is not None else np.arange(n_samples)
        _save_atomically(self.index_files["doc_order"], order)
        _save_atomically(self.index_files["doc_offsets"], offsets)
        _save_atomically(self.index_files["samples"], samples)  # last: its presence marks a finished build

    def _load_index(self) -> None:
        try:
            arrays = {k: self._load_index_file(k) for k in self.index_files}
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}: the local rank 0 of this node did not build this index; every rank of a "
                                    "node must construct the dataset with the same data_name and cache_dir") from e
        expected = {"doc_order": self.num_documents, "doc_offsets": self.num_documents + 1,
                    "samples": self.num_tokens // self.max_seq_length}
        for key, size in expected.items():
            if arrays[key].shape != (size,):
                raise ValueError(f"cached index {str(self.index_files[key])!r} has shape {arrays[key].shape}, expected "
                                 f"({size},): it was built for other data; delete the *_{key}.npy files and retry")
        if int(arrays["doc_offsets"][-1]) != self.num_tokens:
            raise ValueError(f"cached index {str(self.index_files['doc_offsets'])!r} counts "
                             f"{int(arrays['doc_offsets'][-1])} tokens but the split holds {self.num_tokens}: it was "
                             "built for other data; delete its *.npy files and retry")
        self._doc_order, self._doc_offsets, self._samples = (arrays["doc_order"], arrays["doc_offsets"],
                                                             arrays["samples"])

    def _load_index_file(self, key: str) -> np.ndarray:
        """The cached `key` array, memory-mapped, as a plain ndarray view (np.memmap's Python-level indexing
        costs per sample read).

        A truncated or damaged file (a copy or a build that was cut short, a full disk) made np.load fail
        with numpy's own words ("EOF: reading array header", "mmap length is greater than file size"),
        which name neither the file nor the remedy: ValueError naming both instead. The index is rebuilt
        only when a file is missing, so the remedy is to delete the set."""
        path = self.index_files[key]
        stem = str(path)[:-len(f"_{key}.npy")]
        delete = (f"delete the cached index files {stem}_{{doc_order,doc_offsets,samples}}.npy and construct the "
                  "dataset again, which rebuilds them")
        try:
            array = np.load(path, mmap_mode="r").view(np.ndarray)
        except FileNotFoundError:
            raise
        except (ValueError, OSError, EOFError) as e:    # np.load's errors for a bad header, short data, a non-.npy
            raise ValueError(f"cached index {str(path)!r} cannot be read, it is truncated or damaged ({e}); "
                             f"{delete}") from e
        if array.dtype.kind not in "iu":
            raise ValueError(f"cached index {str(path)!r} holds {array.dtype} values, not the integers this dataset "
                             f"writes: it is damaged or not this dataset's; {delete}")
        return array

    def _check_index_lengths(self) -> None:
        """The cached index fits these documents' lengths, not only their count and total (a corpus written
        again under the same name); once, here, not in every DataLoader worker."""
        lo, hi = self.document_range
        order = self._doc_order
        if order.size and (int(order.min()) < lo or int(order.max()) >= hi
                           or not np.array_equal(np.diff(self._doc_offsets), self._lengths[order - lo])):
            raise ValueError(f"cached index {str(self.index_files['doc_offsets'])!r} does not match the document "
                             f"lengths of {self.data_name!r}: it was built for other data (the corpus was written "
                             "again under this name?); delete its *.npy files and retry")

    def __getstate__(self) -> dict:
        # DataLoader workers reopen the memory maps instead of receiving copies of them.
        state = dict(self.__dict__)
        for key in ("_doc_order", "_doc_offsets", "_samples"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load_index()

    def __len__(self) -> int:
        return int(self._samples.shape[0])

    def sample_tokens(self, index: int) -> np.ndarray:
        """The `max_seq_length` token ids of sample `index`, as int64."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        start = self._samples.item(index % n) * self.max_seq_length
        end = start + self.max_seq_length
        offsets, order = self._doc_offsets, self._doc_order
        d = int(np.searchsorted(offsets, start, side="right")) - 1
        pieces = []
        position = start
        while position < end:
            doc_end = offsets.item(d + 1)
            take = min(end, doc_end) - position
            if take > 0:
                pieces.append(self._document_tokens(order.item(d), position - offsets.item(d), take))
            position += take
            d += 1
        return np.concatenate(pieces).astype(np.int64)

    def _document_tokens(self, document: int, offset: int, length: int) -> np.ndarray:
        """`length` tokens of `document` from `offset` (its sequences back to back, then the inserted EOD)."""
        first, stop = ((int(self.tokens.doc_idx[document]), int(self.tokens.doc_idx[document + 1]))
                       if self._has_documents else (document, document + 1))
        if stop - first == 1 and self.eod_token_id is None:
            return self.tokens.get(first, offset, length)
        end = offset + length
        ends = np.cumsum(self.tokens.sizes[first:stop], dtype=np.int64)
        pieces = []
        # The sequences overlapping [offset, end): from the one holding `offset` on.
        for seq in range(first + int(np.searchsorted(ends, offset, side="right")), stop):
            seq_start = int(ends[seq - first]) - int(self.tokens.sizes[seq])
            if seq_start >= end:
                break
            lo, hi = max(offset, seq_start), min(end, int(ends[seq - first]))
            if hi > lo:
                pieces.append(self.tokens.get(seq, lo - seq_start, hi - lo).astype(np.int64))
        size = int(ends[-1]) if ends.size else 0
        if self.eod_token_id is not None and end > size > 0:
            pieces.append(np.array([self.eod_token_id], dtype=np.int64))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(self.sample_tokens(index))
        return {"input_ids": input_ids, "labels": input_ids.clone()}
