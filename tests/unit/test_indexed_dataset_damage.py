"""A damaged `.idx` or cached sample index is refused at open, naming the file and the remedy.

Damage that keeps a file's length (a size or pointer changed in place) passed the header checks and
was read silently (samples mixed in other sequences' tokens) or failed inside numpy ("offset must be
non-negative ..."); a truncated cached `.npy` failed with numpy's "EOF: reading array header".
"""

import os
import re
import struct

import numpy as np
import pytest
from test_data_causal_lm import numbered_docs, write_docs

from atorch.data import DatasetForCausalLM, indexed_dataset, open_indexed_dataset

MMAP_HEADER = 34     # magic, version, dtype code, n_seq, n_doc_idx
LEGACY_HEADER = 56   # magic, version, dtype code, element size, n_seq, n_sizes, n_doc_idx
ITEMSIZE = 2         # write_docs writes uint16 tokens


def sizes_of(docs):
    return [len(d) for d in docs]


def patch(path, offset, fmt, value):
    """Overwrite one field of `path` in place: the file keeps its length."""
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


@pytest.fixture
def docs():
    return numbered_docs(12)


def mmap_size_at(i):
    return MMAP_HEADER + 4 * i


def mmap_pointer_at(n, i):
    return MMAP_HEADER + 4 * n + 8 * i


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_a_healthy_dataset_still_loads(tmp_path, docs, impl):
    prefix = write_docs(tmp_path / "d", docs, impl)
    tokens = open_indexed_dataset(prefix, impl)
    assert [tokens[i].tolist() for i in range(len(docs))] == docs
    ds = DatasetForCausalLM(prefix, 8, binarization_impl=impl)
    assert len(ds) == sum(sizes_of(docs)) // 8
    assert DatasetForCausalLM(prefix, 8, binarization_impl=impl)[0]["input_ids"].tolist() == sum(docs, [])[:8]


def test_a_size_changed_in_place_is_found(tmp_path, docs):
    prefix = write_docs(tmp_path / "d", docs)
    idx = tmp_path / "d.idx"
    length = idx.stat().st_size
    patch(idx, mmap_size_at(2), "<i", len(docs[2]) + 40)   # sequence 2 claims 40 tokens of sequence 3
    assert idx.stat().st_size == length
    start = ITEMSIZE * sum(sizes_of(docs)[:2])
    end = start + ITEMSIZE * (len(docs[2]) + 40)
    expected = (rf"index file '.*d\.idx' is damaged at sequence 3: it starts at byte {start + ITEMSIZE * len(docs[2])}"
                rf", but sequence 2 \({len(docs[2]) + 40} tokens of 2 bytes from byte {start}\) ends at byte {end}; "
                r"rebuild the pair: preprocess the corpus again \(atorch preprocess --input <corpus> --output-prefix "
                r".*d\)")
    with pytest.raises(ValueError, match=expected):
        open_indexed_dataset(prefix)
    with pytest.raises(ValueError, match=expected):     # the user's entry point says the same
        DatasetForCausalLM(prefix, 8)


def test_a_negative_size_is_found(tmp_path, docs):
    prefix = write_docs(tmp_path / "d", docs)
    patch(tmp_path / "d.idx", mmap_size_at(0), "<i", -5)
    with pytest.raises(ValueError, match=r"'.*d\.idx' is damaged at sequence 0: its size is -5 tokens, a negative "
                                         r"count; rebuild the pair"):
        open_indexed_dataset(prefix)


@pytest.mark.parametrize("pointer", [10 ** 9, -100])
def test_a_pointer_outside_the_bin_names_both_files(tmp_path, docs, pointer):
    prefix = write_docs(tmp_path / "d", docs)
    patch(tmp_path / "d.idx", mmap_pointer_at(len(docs), 4), "<q", pointer)
    data_bytes = (tmp_path / "d.bin").stat().st_size
    with pytest.raises(ValueError, match=rf"'.*d\.idx' is damaged at sequence 4: it starts at byte {pointer}, "
                                         rf"outside the data file '.*d\.bin' \({data_bytes} bytes\), but sequence 3"):
        open_indexed_dataset(prefix)


def test_the_last_pointer_past_the_bin_and_a_first_pointer_other_than_zero(tmp_path, docs):
    prefix = write_docs(tmp_path / "d", docs)
    raw = (tmp_path / "d.idx").read_bytes()
    patch(tmp_path / "d.idx", mmap_pointer_at(len(docs), len(docs) - 1), "<q", 10 ** 6)
    with pytest.raises(ValueError, match=rf"damaged at sequence {len(docs) - 1}: it starts at byte 1000000, outside"):
        open_indexed_dataset(prefix)
    (tmp_path / "d.idx").write_bytes(raw)
    patch(tmp_path / "d.idx", mmap_pointer_at(len(docs), 0), "<q", 2)
    with pytest.raises(ValueError, match=r"damaged at sequence 0: it starts at byte 2, but the first sequence starts "
                                         r"at byte 0"):
        open_indexed_dataset(prefix)


def test_damage_is_found_across_blocks(tmp_path, docs, monkeypatch):
    """The check runs in blocks of `_BLOCK` entries; the expected start carries across them."""
    monkeypatch.setattr(indexed_dataset, "_BLOCK", 3)
    prefix = write_docs(tmp_path / "d", docs)
    assert len(open_indexed_dataset(prefix)) == len(docs)
    patch(tmp_path / "d.idx", mmap_size_at(5), "<i", len(docs[5]) - 1)   # the last of the second block
    with pytest.raises(ValueError, match="damaged at sequence 6: it starts at byte"):
        open_indexed_dataset(prefix)


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_layouts_are_checked_too(tmp_path, docs, impl):
    prefix = write_docs(tmp_path / "d", docs, impl)
    n = len(docs)
    raw = (tmp_path / "d.idx").read_bytes()
    patch(tmp_path / "d.idx", LEGACY_HEADER + 8 * (n + 1) + 8 * 3, "<q", 10 ** 7)   # data_offsets[3], in tokens
    with pytest.raises(ValueError, match=r"damaged at sequence 3: it starts at byte 20000000, outside the data file"):
        open_indexed_dataset(prefix, impl)
    (tmp_path / "d.idx").write_bytes(raw)
    patch(tmp_path / "d.idx", LEGACY_HEADER + 16 * (n + 1) + 8 * 1, "<q", len(docs[1]) + 1)   # sizes[1]
    with pytest.raises(ValueError, match=r"damaged at sequence 2: it starts at byte \d+, but sequence 1 "):
        open_indexed_dataset(prefix, impl)
    (tmp_path / "d.idx").write_bytes(raw)
    patch(tmp_path / "d.idx", LEGACY_HEADER + 16 * (n + 1) + 8 * (n - 1), "<q", len(docs[-1]) + 1)   # the last
    with pytest.raises(ValueError, match=rf"damaged after its last sequence: its {n} sequences end at byte \d+, but "
                                         rf"sequence {n - 1} "):
        open_indexed_dataset(prefix, impl)


@pytest.mark.parametrize("damage", ["header", "data", "not npy"])
def test_a_damaged_cached_index_names_the_file_and_says_to_delete_it(tmp_path, docs, damage):
    prefix = write_docs(tmp_path / "d", docs)
    ds = DatasetForCausalLM(prefix, 4)
    samples = ds.index_files["samples"]
    if damage == "header":
        os.truncate(samples, 10)
    elif damage == "data":
        os.truncate(samples, samples.stat().st_size - 8)
    else:
        samples.write_bytes(b"not an array")
    stem = re.escape(str(samples)[:-len("_samples.npy")])
    with pytest.raises(ValueError, match=rf"cached index '{stem}_samples\.npy' cannot be read, it is truncated or "
                                         rf"damaged \(.*\); delete the cached index files "
                                         rf"{stem}_\{{doc_order,doc_offsets,samples\}}\.npy"):
        DatasetForCausalLM(prefix, 4)
    for path in ds.index_files.values():     # the remedy the message gives works
        path.unlink()
    assert len(DatasetForCausalLM(prefix, 4)) == len(ds)


def test_a_cached_index_of_floats_is_refused(tmp_path, docs):
    prefix = write_docs(tmp_path / "d", docs)
    ds = DatasetForCausalLM(prefix, 4)
    np.save(ds.index_files["samples"], np.arange(len(ds), dtype=np.float64))
    with pytest.raises(ValueError, match=r"_samples\.npy' holds float64 values, not the integers"):
        DatasetForCausalLM(prefix, 4)
