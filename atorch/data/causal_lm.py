"""Fixed-length causal-LM samples cut from a tokenized corpus (`.bin` + `.idx`).

The documents of a split are concatenated (the EOD tokens written by the preprocessor keep
them apart) and cut into `max_seq_length` tokens per sample. The sample index is built once,
cached next to the data, and memory-mapped by every rank and DataLoader worker.
"""

from __future__ import annotations

import numbers
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from atorch.data.indexed_dataset import PathLike, check_token_id, is_int, open_indexed_dataset, strip_suffix
from atorch.distributed import collective_device, local_rank


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

    Without a process group, just builds. A failure on the builder is raised on every rank,
    instead of leaving the others blocked at a barrier.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not is_built():
            build()
        return
    failure: Optional[BaseException] = None
    if local_rank() == 0 and not is_built():
        try:
            build()
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
            failure = e
    failed = torch.tensor([1 if failure is not None else 0], device=collective_device())
    # An all_reduce doubles as the barrier and tells everyone whether a builder failed.
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(failed.item()):
        raise RuntimeError(f"building {what} failed on the local rank 0 of some node; see its error")


_PATH_SEPARATORS = tuple({"/", "\\", os.sep} | ({os.altsep} if os.altsep else set()))


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
        start_weight, end_weight: the split as fractions of the N documents (sequences) in the
            file. Splits with touching weights (0-0.9, 0.9-1) are disjoint and together complete.
        binarization_impl: "mmap", "lazy" or "cached", as the files were written.
        seed: None keeps the file order. An int shuffles the document order before concatenation
            and the sample order, deterministically.
        eod_token_id: insert this token after every document. Only for files written with
            `append_eod=False`; files from `DatasetPreprocessor` already end documents with EOD.

    Each item is `{"input_ids": LongTensor[max_seq_length], "labels": LongTensor[max_seq_length]}`
    with `labels` a copy of `input_ids`: the Hugging Face convention, where the causal LM shifts
    labels by one inside `forward` (token t is trained to predict token t+1; the last position of
    a sample has no target). Samples do not overlap, so one next-token pair per sample boundary is
    not trained on.

    The index (document order, document offsets, sample order) is written once, atomically, as
    `<data_name>_<split>_<seq>sl_<start>_<end>_<seed>s_{doc_order,doc_offsets,samples}.npy` (the weights
    as `%g` when that is exact, else as their repr);
    under torch.distributed the local rank 0 of each node builds it and the other ranks wait, so
    every rank must construct the dataset (the constructor holds a collective).
    """

    def __init__(self, data_name: PathLike, max_seq_length: int, split_type: str = "train",
                 start_weight: float = 0.0, end_weight: float = 1.0, binarization_impl: str = "mmap",
                 seed: Optional[int] = None, eod_token_id: Optional[int] = None) -> None:
        for name, weight in (("start_weight", start_weight), ("end_weight", end_weight)):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ValueError(f"{name} must be a number in [0, 1], got {type(weight).__name__} {weight!r}")
        if not isinstance(split_type, str) or any(sep in split_type for sep in _PATH_SEPARATORS):
            raise ValueError(f"split_type={split_type!r} must be a str without path separators: it is part of the "
                             "cache file names next to the data")
        if not 0.0 <= start_weight < end_weight <= 1.0:
            raise ValueError(f"need 0 <= start_weight < end_weight <= 1, got start_weight={start_weight}, "
                             f"end_weight={end_weight}")
        if not is_int(max_seq_length) or max_seq_length < 1:
            raise ValueError(f"max_seq_length must be an int >= 1, got {max_seq_length!r}")
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ValueError(f"seed must be None (file order) or an int >= 0, got {seed!r}")
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
        n = len(self.tokens)
        # The same rounding for both ends, so touching splits share their boundary exactly.
        self.document_range: Tuple[int, int] = (int(round(start_weight * n)), int(round(end_weight * n)))
        lo, hi = self.document_range
        if hi <= lo:
            raise ValueError(f"split {split_type!r} (start_weight={start_weight}, end_weight={end_weight}) of the "
                             f"{n} documents in {self.data_name!r} is empty")
        self._lengths = self.tokens.sizes[lo:hi].astype(np.int64) + (0 if eod_token_id is None else 1)
        self.num_tokens = int(self._lengths.sum())
        if self.max_seq_length > self.num_tokens:
            raise ValueError(f"max_seq_length={self.max_seq_length} is larger than split {split_type!r} of "
                             f"{self.data_name!r}, which holds {self.num_tokens} tokens (documents [{lo}, {hi}))")
        eod = "" if eod_token_id is None else f"_eod{eod_token_id}"
        stem = (f"{self.data_name}_{split_type}_{self.max_seq_length}sl_{_weight_name(start_weight)}_"
                f"{_weight_name(end_weight)}_{seed}s{eod}")
        self.index_files: Dict[str, Path] = {k: Path(f"{stem}_{k}.npy") for k in ("doc_order", "doc_offsets",
                                                                                  "samples")}
        build_once_per_node(lambda: all(p.is_file() for p in self.index_files.values()), self._build_index,
                            f"the sample index {stem}_*.npy")
        self._load_index()
        self._check_index_lengths()

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
        # Plain ndarray views of the maps: np.memmap's Python-level indexing costs per sample read.
        arrays = {k: np.load(p, mmap_mode="r").view(np.ndarray) for k, p in self.index_files.items()}
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

    def _document_tokens(self, sequence: int, offset: int, length: int) -> np.ndarray:
        if self.eod_token_id is None:
            return self.tokens.get(sequence, offset, length)
        size = int(self.tokens.sizes[sequence])
        stored = max(0, min(length, size - offset))
        out = self.tokens.get(sequence, offset, stored) if stored else np.zeros(0, dtype=np.int64)
        return np.append(out, self.eod_token_id) if offset + length > size else out

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(self.sample_tokens(index))
        return {"input_ids": input_ids, "labels": input_ids.clone()}
