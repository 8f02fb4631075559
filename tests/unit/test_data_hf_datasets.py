"""A real Hugging Face `datasets` object (map-style and iterable) feeds the preprocessor."""

import datasets
import pytest

from atorch.data import DatasetPreprocessor
from atorch.data.indexed_dataset import open_indexed_dataset
from atorch.testing.assets import load_tokenizer


def test_real_datasets_objects_are_preprocessed(tmp_path):
    tok = load_tokenizer()
    texts = ["the river at dawn.", "a quiet library.", "seven lanterns."]
    expected = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    p = DatasetPreprocessor(tok)
    ds = datasets.Dataset.from_dict({"content": texts + [None], "id": [0, 1, 2, 3]})
    stats = p.preprocess(p.open_hf_dataset(ds, text_key="content"), tmp_path / "map", progress_enabled=False)
    out = open_indexed_dataset(tmp_path / "map", "mmap")
    assert [out[i].tolist() for i in range(len(out))] == expected
    assert stats.skipped_lines == 1  # the None row is counted, not silently dropped
    streamed = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in texts))
    p.preprocess(p.open_hf_dataset(streamed), tmp_path / "iter", progress_enabled=False)
    out = open_indexed_dataset(tmp_path / "iter", "mmap")
    assert [out[i].tolist() for i in range(len(out))] == expected


def test_a_dataset_dict_is_refused_and_a_dataset_is_read_by_its_text_column(tmp_path):
    tok = load_tokenizer()
    p = DatasetPreprocessor(tok)
    ds = datasets.Dataset.from_dict({"text": ["real document one", "real document two"]})
    dd = datasets.DatasetDict({"train": ds})
    # The split names were written as the corpus ('train</s>'), and open() reported "a JSON str".
    for call, argument in ((lambda: p.preprocess(dd, tmp_path / "dd", progress_enabled=False), "documents"),
                           (lambda: p.open(dd), "source"), (lambda: p.open_hf_dataset(dd), "dataset")):
        with pytest.raises(TypeError, match=rf"{argument} is a DatasetDict of splits \['train'\]; .* pass one split, "
                                            rf"e.g. {argument}\['train'\]"):
            call()
    assert list(tmp_path.iterdir()) == []
    # A Dataset itself failed with "document 0 is dict, expected str".
    stats = p.preprocess(ds, tmp_path / "ds", progress_enabled=False)
    out = open_indexed_dataset(tmp_path / "ds", "mmap")
    assert stats.documents == 2 and [tok.decode(out[i]) for i in range(2)] == [
        "real document one</s>", "real document two</s>"]
    with pytest.raises(ValueError, match=r"has no column 'text'; its columns are \['body'\]: name the text column, "
                                         r"e.g. preprocess\(open_hf_dataset\(dataset, text_key=\.\.\.\), \.\.\.\)"):
        p.preprocess(datasets.Dataset.from_dict({"body": ["x"]}), tmp_path / "body", progress_enabled=False)
