"""A real Hugging Face `datasets` object (map-style and iterable) feeds the preprocessor."""

import datasets

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
