"""Byte-level compatibility of the .bin/.idx files with Megatron-LM's formats, both directions.

The reader and writer in this file are written from the format description only
(see atorch/data/indexed_dataset.py docstring), never with atorch's reader or writer.
"""

import struct

import numpy as np
import pytest

from atorch.data import (
    DatasetPreprocessor,
    IndexedCachedDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    MMapIndexedDataset,
    best_fitting_dtype,
    open_indexed_dataset,
)
from atorch.data import indexed_dataset
from atorch.testing.assets import corpus_documents, load_tokenizer

CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# ---- independent reader/writer, from the format description --------------------------------

def spec_read_mmap(prefix):
    idx = open(f"{prefix}.idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", idx, 9)
    (code,) = struct.unpack_from("<B", idx, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", idx, 18)
    pos = 34
    sizes = struct.unpack_from(f"<{n_seq}i", idx, pos)
    pos += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", idx, pos)
    pos += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", idx, pos)
    assert pos + 8 * n_doc == len(idx)
    data = open(f"{prefix}.bin", "rb").read()
    dtype = np.dtype(CODES[code])
    seqs = [np.frombuffer(data, dtype=dtype, count=s, offset=p).tolist() for s, p in zip(sizes, pointers)]
    return version, code, seqs, list(doc_idx)


def spec_read_legacy(prefix):
    idx = open(f"{prefix}.idx", "rb").read()
    assert idx[:8] == b"TNTIDX\x00\x00"
    version, code, element_size, n, s, doc_count = struct.unpack_from("<6Q", idx, 8)
    pos = 56
    dim_offsets = struct.unpack_from(f"<{n + 1}q", idx, pos)
    data_offsets = struct.unpack_from(f"<{n + 1}q", idx, pos + 8 * (n + 1))
    sizes = struct.unpack_from(f"<{s}q", idx, pos + 16 * (n + 1))
    doc_idx = struct.unpack_from(f"<{doc_count}q", idx, pos + 16 * (n + 1) + 8 * s)
    assert pos + 16 * (n + 1) + 8 * s + 8 * doc_count == len(idx)
    assert list(dim_offsets) == list(range(n + 1))
    data = open(f"{prefix}.bin", "rb").read()
    dtype = np.dtype(CODES[code])
    assert element_size == dtype.itemsize
    seqs = [np.frombuffer(data, dtype=dtype, count=data_offsets[i + 1] - data_offsets[i],
                          offset=data_offsets[i] * element_size).tolist() for i in range(n)]
    assert [len(q) for q in seqs] == list(sizes)
    return version, code, seqs, list(doc_idx)


def spec_write_mmap(prefix, seqs, code, doc_idx=None):
    dtype = np.dtype(CODES[code])
    doc_idx = list(range(len(seqs) + 1)) if doc_idx is None else doc_idx
    pointers, p = [], 0
    for q in seqs:
        pointers.append(p)
        p += len(q) * dtype.itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<QQ", len(seqs), len(doc_idx))
    idx += struct.pack(f"<{len(seqs)}i", *map(len, seqs)) + struct.pack(f"<{len(seqs)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    open(f"{prefix}.idx", "wb").write(idx)
    open(f"{prefix}.bin", "wb").write(b"".join(np.array(q, dtype=dtype).tobytes() for q in seqs))
    return idx


def spec_write_legacy(prefix, seqs, code, doc_idx=None):
    dtype = np.dtype(CODES[code])
    n = len(seqs)
    doc_idx = list(range(n + 1)) if doc_idx is None else doc_idx
    offsets = [0]
    for q in seqs:
        offsets.append(offsets[-1] + len(q))
    idx = b"TNTIDX\x00\x00" + struct.pack("<6Q", 1, code, dtype.itemsize, n, n, len(doc_idx))
    idx += struct.pack(f"<{n + 1}q", *range(n + 1)) + struct.pack(f"<{n + 1}q", *offsets)
    idx += struct.pack(f"<{n}q", *map(len, seqs)) + struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    open(f"{prefix}.idx", "wb").write(idx)
    open(f"{prefix}.bin", "wb").write(b"".join(np.array(q, dtype=dtype).tobytes() for q in seqs))
    return idx


# ---- our preprocessor -> independent reader ---------------------------------------------------

@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_preprocessor_output_reads_back_with_spec_reader(tmp_path, tokenizer, impl):
    docs = corpus_documents(40)
    DatasetPreprocessor(tokenizer, chunk_size=7, binarization_impl=impl).preprocess(
        docs, tmp_path / "ours", progress_enabled=False)
    reader = spec_read_mmap if impl == "mmap" else spec_read_legacy
    version, code, seqs, doc_idx = reader(tmp_path / "ours")
    expected = [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    assert (version, code) == (1, 8)  # vocab 845 -> uint16
    assert seqs == expected
    assert doc_idx == list(range(len(docs) + 1))
    # Byte for byte: the hand-written encoding of the same tokens is the same two files.
    ours = {s: (tmp_path / f"ours.{s}").read_bytes() for s in ("bin", "idx")}
    (spec_write_mmap if impl == "mmap" else spec_write_legacy)(tmp_path / "spec", expected, 8)
    assert ours == {s: (tmp_path / f"spec.{s}").read_bytes() for s in ("bin", "idx")}


# ---- hand-written files -> our readers and writer --------------------------------------------

@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
@pytest.mark.parametrize("code", [8, 4, 5, 1])
def test_spec_written_files_read_with_our_readers(tmp_path, impl, code):
    rng = np.random.default_rng(code)
    high = 255 if code == 1 else 60000
    seqs = [rng.integers(0, high, size=int(n)).tolist() for n in rng.integers(0, 30, size=25)]
    writer = spec_write_mmap if impl == "mmap" else spec_write_legacy
    # Several sequences per document, as Megatron writes sentence-split corpora.
    doc_idx = [0, 3, 10, 25]
    writer(tmp_path / "spec", seqs, code, doc_idx)
    ds = open_indexed_dataset(tmp_path / "spec", impl)
    assert type(ds) is {"mmap": MMapIndexedDataset, "lazy": IndexedDataset, "cached": IndexedCachedDataset}[impl]
    assert ds.dtype == np.dtype(CODES[code])
    assert len(ds) == 25 and ds.sizes.tolist() == [len(q) for q in seqs]
    assert ds.doc_idx.tolist() == doc_idx
    assert [ds[i].tolist() for i in range(25)] == seqs
    assert ds[-1].tolist() == seqs[-1]
    longest = int(np.argmax(ds.sizes))
    assert ds.get(longest, 2, 5).tolist() == seqs[longest][2:7]
    # Our writer, given the same sequences, produces the same bytes (one document per sequence).
    writer(tmp_path / "flat", seqs, code)
    with IndexedDatasetWriter(tmp_path / "ours", np.dtype(CODES[code]), impl) as w:
        for q in seqs:
            w.add_sequence(np.array(q))
    for suffix in ("bin", "idx"):
        assert (tmp_path / f"ours.{suffix}").read_bytes() == (tmp_path / f"flat.{suffix}").read_bytes()


def test_writer_streams_index_in_blocks(tmp_path, monkeypatch):
    seqs = [list(range(i % 7)) for i in range(50)]
    spec_write_mmap(tmp_path / "spec", seqs, 8)
    spec_write_legacy(tmp_path / "legacy", seqs, 8)
    # Blocks of 3 entries: the prefix sums must carry across block boundaries.
    monkeypatch.setattr(indexed_dataset, "_BLOCK", 3)
    for impl, ref in (("mmap", "spec"), ("lazy", "legacy")):
        with IndexedDatasetWriter(tmp_path / impl, np.uint16, impl) as w:
            for start in range(0, 50, 8):
                chunk = seqs[start:start + 8]
                w.add_sequences(np.array(sum(chunk, []), dtype=np.int64), np.array([len(q) for q in chunk]))
        assert (tmp_path / f"{impl}.idx").read_bytes() == (tmp_path / f"{ref}.idx").read_bytes()
        assert (tmp_path / f"{impl}.bin").read_bytes() == (tmp_path / f"{ref}.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["spec.bin", "spec.idx", "legacy.bin", "legacy.idx", "mmap.bin", "mmap.idx", "lazy.bin", "lazy.idx"])


def test_best_fitting_dtype():
    assert best_fitting_dtype(845) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(152064) == np.int32
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        best_fitting_dtype(0)


def test_large_vocab_is_written_as_int32(tmp_path):
    class BigVocab:
        eos_token_id = 99_999

        def __len__(self):
            return 100_000

        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [[70_000 + len(t), 5] for t in texts]}

    DatasetPreprocessor(BigVocab()).preprocess(["a", "bcd"], tmp_path / "big", progress_enabled=False)
    version, code, seqs, _ = spec_read_mmap(tmp_path / "big")
    assert code == 4 and seqs == [[70_001, 5, 99_999], [70_003, 5, 99_999]]


# ---- damaged or mismatched files --------------------------------------------------------------

@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_damaged_files_raise_naming_the_file(tmp_path, impl):
    writer = spec_write_mmap if impl == "mmap" else spec_write_legacy
    writer(tmp_path / "d", [[1, 2, 3], [4, 5]], 8)
    # .bin without .idx, and the reverse.
    (tmp_path / "d.idx").rename(tmp_path / "keep.idx")
    with pytest.raises(FileNotFoundError, match=r"index file '.*d\.idx' not found"):
        open_indexed_dataset(tmp_path / "d", impl)
    (tmp_path / "keep.idx").rename(tmp_path / "d.idx")
    (tmp_path / "d.bin").rename(tmp_path / "keep.bin")
    with pytest.raises(FileNotFoundError, match=r"data file '.*d\.bin' not found"):
        open_indexed_dataset(tmp_path / "d.bin", impl)
    # A .bin whose size does not match the index.
    (tmp_path / "d.bin").write_bytes((tmp_path / "keep.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"d\.bin' has 8 bytes but its index .* describes 10 bytes"):
        open_indexed_dataset(tmp_path / "d", impl)
    (tmp_path / "d.bin").write_bytes((tmp_path / "keep.bin").read_bytes())
    assert open_indexed_dataset(tmp_path / "d", impl)[1].tolist() == [4, 5]
    # A truncated index.
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(idx[:-8])
    with pytest.raises(ValueError, match=rf"d\.idx' has {len(idx) - 8} bytes but its header"):
        open_indexed_dataset(tmp_path / "d", impl)
    # The other format's header.
    other = "lazy" if impl == "mmap" else "mmap"
    (tmp_path / "d.idx").write_bytes(idx)
    with pytest.raises(ValueError, match="does not start with"):
        open_indexed_dataset(tmp_path / "d", other)


def test_bad_header_fields(tmp_path):
    idx = bytearray(spec_write_mmap(tmp_path / "d", [[1, 2]], 8))
    idx[9] = 2  # version
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(ValueError, match="has version 2; expected 1"):
        MMapIndexedDataset(tmp_path / "d")
    idx[9], idx[17] = 1, 9  # dtype code
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(ValueError, match="has dtype code 9"):
        MMapIndexedDataset(tmp_path / "d")
    with pytest.raises(ValueError, match="binarization_impl='npy' is not supported"):
        open_indexed_dataset(tmp_path / "d", "npy")


def test_out_of_range_reads(tmp_path):
    spec_write_mmap(tmp_path / "d", [[1, 2, 3]], 8)
    ds = MMapIndexedDataset(tmp_path / "d")
    with pytest.raises(IndexError, match="sequence 1 out of range"):
        ds[1]
    with pytest.raises(IndexError, match=r"tokens \[2, 5\) out of range for sequence 0"):
        ds.get(0, 2, 3)


def test_writer_refuses_ids_it_would_store_as_other_ids(tmp_path):
    """A cast would write 70000 as 4464 and -1 as 65535 in uint16, 1.7 as 1: ValueError naming the value."""
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    for tokens, message in (([70000, 5], r"token id 70000 does not fit the uint16 tokens of .* \(at most 65535\)"),
                            ([5, -1], "token id -1 is negative"),
                            (np.array([1.7, 2.2]), r"token ids must be integers, got 1.7 \(in a float64 array\)"),
                            (np.array([1.0]), r"token ids must be integers, got 1.0"),
                            (np.array([True]), "token ids must be integers, got True"),
                            ([2 ** 70], f"token id {2 ** 70} does not fit")):
        with pytest.raises(ValueError, match=message):
            w.add_sequence(tokens)
    w.add_sequence([])            # an empty sequence (a float64 array) is no bad id
    w.add_sequence(np.array([65535, 0], dtype=np.int64))
    w.finalize()
    assert [s.tolist() for s in open_indexed_dataset(tmp_path / "x")] == [[], [65535, 0]]


@pytest.mark.parametrize("prefix", ["out/", "out/.bin", "out/."])
def test_writer_refuses_a_prefix_without_a_file_name(tmp_path, prefix):
    with pytest.raises(ValueError, match="has no file name part; give a directory and a name"):
        IndexedDatasetWriter(f"{tmp_path}/{prefix}", np.uint16)
    assert not (tmp_path / "out").exists()
