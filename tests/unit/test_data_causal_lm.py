"""DatasetForCausalLM: sample boundaries, EOD placement, splits, shuffling, the index cache, bad input."""

import pickle

import numpy as np
import pytest
import torch

from atorch.data import DatasetForCausalLM, DatasetPreprocessor, IndexedDatasetWriter
from atorch.testing.assets import corpus_documents, load_tokenizer

EOD = 1


def write_docs(prefix, docs, impl="mmap"):
    with IndexedDatasetWriter(prefix, np.uint16, impl) as w:
        for d in docs:
            w.add_sequence(np.array(d))
    return str(prefix)


def numbered_docs(n_docs, seed=0):
    """Documents whose tokens say where they come from: doc i holds 100*i+2, 100*i+3, ..., then EOD."""
    rng = np.random.default_rng(seed)
    return [[100 * i + 2 + t for t in range(int(rng.integers(1, 40)))] + [EOD] for i in range(n_docs)]


def stream(dataset):
    return np.concatenate([dataset.sample_tokens(i) for i in range(len(dataset))]).tolist()


@pytest.fixture
def data(tmp_path):
    docs = numbered_docs(50)
    return write_docs(tmp_path / "d", docs), docs


def test_samples_cut_the_concatenated_stream(data):
    prefix, docs = data
    flat = sum(docs, [])
    for seq in (2, 7, 64, len(flat)):
        ds = DatasetForCausalLM(prefix, seq)
        assert len(ds) == len(flat) // seq
        assert stream(ds) == flat[: len(ds) * seq]  # the tail shorter than a sample is dropped
        item = ds[len(ds) - 1]
        assert set(item) == {"input_ids", "labels"}
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (seq,)
        assert torch.equal(item["labels"], item["input_ids"])  # HF convention: the model shifts
        assert item["labels"].data_ptr() != item["input_ids"].data_ptr()
    ds = DatasetForCausalLM(prefix, 7)
    assert ds[-1]["input_ids"].tolist() == flat[(len(ds) - 1) * 7: len(ds) * 7]
    with pytest.raises(IndexError, match=f"sample {len(ds)} out of range"):
        ds[len(ds)]


def test_eod_placement_on_preprocessed_corpus(tmp_path):
    tokenizer = load_tokenizer()
    docs = corpus_documents(30)
    DatasetPreprocessor(tokenizer).preprocess(docs, tmp_path / "c", progress_enabled=False)
    ds = DatasetForCausalLM(tmp_path / "c", 50)
    tokens = np.array(stream(ds))
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs]
    ends = np.cumsum(lengths) - 1
    ends = ends[ends < tokens.size]
    # EOD exactly at every document end, and nowhere else (the corpus text never encodes to it).
    assert np.flatnonzero(tokens == EOD).tolist() == ends.tolist()


def test_eod_inserted_for_files_without_it(tmp_path):
    docs = [[5, 6, 7], [8], [9, 10]]
    prefix = write_docs(tmp_path / "raw", docs)
    ds = DatasetForCausalLM(prefix, 3, eod_token_id=EOD)
    assert stream(ds) == [5, 6, 7, EOD, 8, EOD, 9, 10, EOD]
    assert [ds.sample_tokens(i).tolist() for i in range(3)] == [[5, 6, 7], [EOD, 8, EOD], [9, 10, EOD]]
    assert DatasetForCausalLM(prefix, 2, eod_token_id=EOD).sample_tokens(1).tolist() == [7, EOD]


def test_an_empty_document_gets_no_inserted_eod(tmp_path):
    """As Megatron's preprocessor (and ours with append_eod) writes none for it: no lone-EOD samples."""
    prefix = write_docs(tmp_path / "raw", [[], [1, 2], [], [], [3], [], [4]])
    ds = DatasetForCausalLM(prefix, 2, eod_token_id=9)
    assert stream(ds) == [1, 2, 9, 3, 9, 4]
    assert ds.index_files["samples"].name.endswith("_eod9-nonempty_samples.npy")   # not an older atorch's index
    # Without empty documents the index (and its name) is the one it always was.
    assert DatasetForCausalLM(write_docs(tmp_path / "full", [[1], [2]]), 2, eod_token_id=9).index_files[
        "samples"].name.endswith("_eod9_samples.npy")


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_token_ids_outside_the_vocabulary_are_refused_at_construction(tmp_path, impl):
    prefix = write_docs(tmp_path / "big", [[1, 2, 3], [5000, 4], [6]], impl)
    with pytest.raises(ValueError, match=r"'.*big\.bin' holds token id 5000, but the model's vocab_size is 1024"):
        DatasetForCausalLM(prefix, 2, binarization_impl=impl, vocab_size=1024)
    assert len(DatasetForCausalLM(prefix, 2, binarization_impl=impl, vocab_size=5001)) == 3
    with pytest.raises(ValueError, match="eod_token_id=5001 is outside the model's vocabulary: vocab_size=5001"):
        DatasetForCausalLM(prefix, 2, binarization_impl=impl, eod_token_id=5001, vocab_size=5001)
    with pytest.raises(ValueError, match="vocab_size must be None .* got 0"):
        DatasetForCausalLM(prefix, 2, binarization_impl=impl, vocab_size=0)


def test_the_vocabulary_check_reads_nothing_when_the_dtype_cannot_exceed_it(tmp_path, monkeypatch):
    from atorch.data import causal_lm

    prefix = write_docs(tmp_path / "d", [[1, 2, 3]])
    monkeypatch.setattr(causal_lm, "token_id_bounds", lambda tokens: pytest.fail("read the .bin"))
    DatasetForCausalLM(prefix, 2, vocab_size=65536)


def test_splits_are_disjoint_and_complete(data):
    prefix, docs = data
    bounds = [0.0, 0.7, 0.9, 1.0]
    splits = [DatasetForCausalLM(prefix, 5, name, lo, hi) for name, lo, hi in
              zip(["train", "valid", "test"], bounds, bounds[1:])]
    assert [s.document_range for s in splits] == [(0, 35), (35, 45), (45, 50)]
    for split in splits:
        lo, hi = split.document_range
        split_flat = sum(docs[lo:hi], [])
        assert stream(split) == split_flat[: len(split) * 5]
        # Every token of a split's samples comes from the split's own documents.
        assert {t // 100 for t in stream(split) if t != EOD} <= set(range(lo, hi))
    # Rounding keeps odd fractions disjoint too.
    a = DatasetForCausalLM(prefix, 5, "a", 0.0, 1 / 3)
    b = DatasetForCausalLM(prefix, 5, "b", 1 / 3, 1.0)
    assert a.document_range[1] == b.document_range[0] == 17


def test_seed_shuffles_deterministically(data):
    prefix, docs = data
    plain = DatasetForCausalLM(prefix, 8)
    first = DatasetForCausalLM(prefix, 8, seed=3)
    again = DatasetForCausalLM(prefix, 8, seed=3)
    other = DatasetForCausalLM(prefix, 8, seed=4)
    assert stream(first) == stream(again) != stream(other)
    assert stream(first) != stream(plain)
    assert len(first) == len(plain)
    # The document order is a permutation; the samples cut that order's stream, in permuted order.
    order = np.load(first.index_files["doc_order"])
    assert sorted(order.tolist()) == list(range(50)) and order.tolist() != list(range(50))
    shuffled_flat = sum((docs[i] for i in order), [])
    samples = np.load(first.index_files["samples"])
    assert sorted(samples.tolist()) == list(range(len(first)))
    for i in range(len(first)):
        j = int(samples[i])
        assert first.sample_tokens(i).tolist() == shuffled_flat[j * 8: (j + 1) * 8]


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_files_give_the_same_samples(tmp_path, impl):
    docs = numbered_docs(20)
    mmap = DatasetForCausalLM(write_docs(tmp_path / "m", docs), 16, seed=1)
    legacy = DatasetForCausalLM(write_docs(tmp_path / "l", docs, impl), 16, binarization_impl=impl, seed=1)
    assert stream(mmap) == stream(legacy)


def test_index_is_built_once_and_cached(data, monkeypatch):
    prefix, _ = data
    ds = DatasetForCausalLM(prefix, 8, "train", 0.0, 0.5, seed=7)
    names = sorted(p.name for p in ds.index_files.values())
    assert names == [f"d_train_8sl_0_0.5_7s_{k}.npy" for k in ("doc_offsets", "doc_order", "samples")]

    def fail(self):
        raise AssertionError("rebuilt a cached index")

    monkeypatch.setattr(DatasetForCausalLM, "_build_index", fail)
    again = DatasetForCausalLM(prefix, 8, "train", 0.0, 0.5, seed=7)
    assert stream(again) == stream(ds)
    # A pickled copy (a DataLoader worker) reopens the memory maps and reads the same samples.
    clone = pickle.loads(pickle.dumps(ds))
    assert stream(clone) == stream(ds)
    assert len(pickle.dumps(ds)) < 2000


def test_stale_cache_raises(tmp_path):
    prefix = write_docs(tmp_path / "d", numbered_docs(20))
    DatasetForCausalLM(prefix, 4, seed=0)
    write_docs(tmp_path / "d", numbered_docs(20, seed=1))  # same name, other data
    with pytest.raises(ValueError, match="built for other data; delete"):
        DatasetForCausalLM(prefix, 4, seed=0)
    # As many documents and tokens as before, other lengths: the index used to load, then read past a
    # document's end (IndexError) or cut samples at the old boundaries.
    write_docs(tmp_path / "e", [list(range(1, 11)), list(range(11, 41))])
    DatasetForCausalLM(tmp_path / "e", 8)
    write_docs(tmp_path / "e", [list(range(1, 31)), list(range(31, 41))])
    with pytest.raises(ValueError, match="does not match the document lengths"):
        DatasetForCausalLM(tmp_path / "e", 8)


def test_bad_arguments(data, tmp_path):
    prefix, docs = data
    with pytest.raises(ValueError, match="start_weight=0.5, end_weight=0.5"):
        DatasetForCausalLM(prefix, 4, start_weight=0.5, end_weight=0.5)
    with pytest.raises(ValueError, match="start_weight=-0.1"):
        DatasetForCausalLM(prefix, 4, start_weight=-0.1)
    with pytest.raises(ValueError, match=r"end_weight=1.5"):
        DatasetForCausalLM(prefix, 4, end_weight=1.5)
    with pytest.raises(ValueError, match=r"split 'valid' .* of the 50 documents in .* is empty"):
        DatasetForCausalLM(prefix, 4, "valid", 0.99, 1.0)
    tokens = sum(map(len, docs[45:]))
    with pytest.raises(ValueError, match=rf"max_seq_length=100000 is larger than split 'test' of .*d', which holds "
                                         rf"{tokens} tokens \(documents \[45, 50\)\)"):
        DatasetForCausalLM(prefix, 100000, "test", 0.9, 1.0)
    with pytest.raises(ValueError, match=r"max_seq_length must be an int >= 2 \(a sample of one token has no next "
                                         r"token to predict\), got 0"):
        DatasetForCausalLM(prefix, 0)
    with pytest.raises(FileNotFoundError, match=r"index file '.*nothing\.idx' not found"):
        DatasetForCausalLM(tmp_path / "nothing", 4)


def test_split_type_and_weight_types_are_checked(data, tmp_path):
    prefix, _ = data
    # A path separator in the split name made the cache path point into a missing directory.
    for split in ("tr/ain", "../train", "a\\b"):
        with pytest.raises(ValueError, match=r"split_type=.* must be a str without path separators"):
            DatasetForCausalLM(prefix, 4, split)
    with pytest.raises(ValueError, match="split_type=3 must be a str"):
        DatasetForCausalLM(prefix, 4, 3)
    with pytest.raises(ValueError, match="start_weight must be a number in \\[0, 1\\], got str '0'"):
        DatasetForCausalLM(prefix, 4, start_weight="0")
    with pytest.raises(ValueError, match="end_weight must be a number in \\[0, 1\\], got bool True"):
        DatasetForCausalLM(prefix, 4, end_weight=True)
    assert not list(tmp_path.glob("*.npy"))
    assert len(DatasetForCausalLM(prefix, 4, "train", np.float32(0.0), np.float64(0.5))) > 0


def test_close_split_boundaries_get_distinct_cache_files(data):
    prefix, _ = data
    # %g printed both as 0.5, so the two splits shared one cache name.
    a = DatasetForCausalLM(prefix, 4, "s", 0.0, 0.5000001)
    b = DatasetForCausalLM(prefix, 4, "s", 0.0, 0.5000002)
    assert a.index_files["samples"].name == "d_s_4sl_0_0.5000001_Nones_samples.npy"
    assert b.index_files["samples"].name == "d_s_4sl_0_0.5000002_Nones_samples.npy"
    # Round values keep the names already on disk (%g).
    names = [DatasetForCausalLM(prefix, 4, "r", lo, hi).index_files["samples"].name
             for lo, hi in ((0, 0.9), (0.9, 1.0), (0.25, 0.75), (1 / 3, 1))]
    assert names == ["d_r_4sl_0_0.9_Nones_samples.npy", "d_r_4sl_0.9_1_Nones_samples.npy",
                     "d_r_4sl_0.25_0.75_Nones_samples.npy", "d_r_4sl_0.3333333333333333_1_Nones_samples.npy"]


# -- documents of several sequences (Megatron's --split-sentences) ---------------------------------------------

def write_documents(prefix, documents, impl="mmap", doc_idx=None):
    """A file whose documents hold several sequences (sentences): the sequences written one by one, then the
    index's doc_idx (the last entries of both layouts, counted in the header) replaced by the documents' (or
    by `doc_idx`)."""
    write_docs(prefix, [sentence for document in documents for sentence in document], impl)
    if doc_idx is None:
        doc_idx = np.cumsum([0] + [len(document) for document in documents])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    count_at = 26 if impl == "mmap" else 48   # after magic, version, dtype code (+ element size), sequence counts
    path = f"{prefix}.idx"
    with open(path, "rb") as f:
        raw = f.read()
    old = int(np.frombuffer(raw, dtype=np.uint64, count=1, offset=count_at)[0])
    raw = raw[:count_at] + np.uint64(doc_idx.size).tobytes() + raw[count_at + 8:len(raw) - 8 * old] + doc_idx.tobytes()
    with open(path, "wb") as f:
        f.write(raw)
    return str(prefix)


def sentence_documents():
    """4 documents of 3 sentences: document d, sentence s holds 100*d + 10*s + k; the last sentence ends with EOD."""
    return [[[100 * d + 10 * s + k for k in range(3)] + ([EOD] if s == 2 else []) for s in range(3)]
            for d in range(1, 5)]


@pytest.mark.parametrize("impl", ["mmap", "lazy"])
def test_documents_of_several_sequences_are_shuffled_and_split_whole(tmp_path, impl):
    """A document is the sequences between doc_idx entries, kept together and in order: the file holds 4 documents
    (not 12), a seed shuffles documents, not sentences, and a split ends at a document's end. Read as sequences,
    samples mixed sentences of different documents, and the valid split started inside a document."""
    documents = sentence_documents()
    flat = [[t for sentence in document for t in sentence] for document in documents]
    prefix = write_documents(tmp_path / "sent", documents, impl)
    plain = DatasetForCausalLM(prefix, 5, binarization_impl=impl)
    assert plain.num_documents == 4
    assert stream(plain) == sum(flat, [])[:len(plain) * 5]

    shuffled = DatasetForCausalLM(prefix, 5, binarization_impl=impl, seed=3)
    order = np.load(shuffled.index_files["doc_order"]).tolist()
    assert sorted(order) == [0, 1, 2, 3] and shuffled.index_files["samples"].name.endswith("_3s_docs_samples.npy")
    shuffled_flat = sum((flat[d] for d in order), [])
    samples = np.load(shuffled.index_files["samples"])
    assert [shuffled.sample_tokens(i).tolist() for i in range(len(shuffled))] == \
        [shuffled_flat[j * 5:(j + 1) * 5] for j in samples.tolist()]

    train = DatasetForCausalLM(prefix, 2, "train", 0.0, 0.5, binarization_impl=impl)
    valid = DatasetForCausalLM(prefix, 2, "valid", 0.5, 1.0, binarization_impl=impl)
    assert (train.document_range, valid.document_range) == ((0, 2), (2, 4))
    assert stream(train) == flat[0] + flat[1] and stream(valid) == flat[2] + flat[3]


def test_an_inserted_eod_follows_a_documents_last_sequence(tmp_path):
    prefix = write_documents(tmp_path / "raw", [[[5, 6], [7]], [[8], [9, 10, 11]]])
    ds = DatasetForCausalLM(prefix, 3, eod_token_id=EOD)
    assert stream(ds) == [5, 6, 7, EOD, 8, 9, 10, 11, EOD]
    assert [ds.sample_tokens(i).tolist() for i in range(3)] == [[5, 6, 7], [EOD, 8, 9], [10, 11, EOD]]
    assert pickle.loads(pickle.dumps(ds)).sample_tokens(2).tolist() == [10, 11, EOD]


def test_a_document_index_that_does_not_fit_the_sequences_raises(tmp_path):
    prefix = write_documents(tmp_path / "bad", [[[5, 6], [7]], [[8], [9, 10, 11]]])
    raw = bytearray(open(f"{prefix}.idx", "rb").read())
    raw[-8:] = np.int64(3).tobytes()             # the last document ends at sequence 3 of 4
    open(f"{prefix}.idx", "wb").write(bytes(raw))
    with pytest.raises(ValueError, match=r"document index of .*bad' runs from sequence 0 to 3 but the file holds "
                                         r"sequences 0 to 4"):
        DatasetForCausalLM(prefix, 2)
    # No document recorded (an older builder's items without end_document): one document per sequence, as before.
    prefix = write_documents(tmp_path / "none", [[[5, 6], [7]], [[8], [9, 10, 11]]], doc_idx=[0])
    assert DatasetForCausalLM(prefix, 2).num_documents == 4


def test_cache_dir_holds_the_index_of_read_only_data(tmp_path):
    prefix = write_docs(tmp_path / "d", numbered_docs(10))
    cache = tmp_path / "cache"
    cache.mkdir()
    ds = DatasetForCausalLM(prefix, 8, seed=1, cache_dir=cache)
    assert all(p.parent == cache and p.name.startswith("d-") for p in ds.index_files.values())
    assert not list(tmp_path.glob("*.npy"))
    assert stream(ds) == stream(DatasetForCausalLM(prefix, 8, seed=1))
    with pytest.raises(ValueError, match=r"cache_dir='.*missing' must be None .* or an existing directory"):
        DatasetForCausalLM(prefix, 8, cache_dir=str(tmp_path / "missing"))
