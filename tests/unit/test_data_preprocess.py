"""DatasetPreprocessor: tokens, EOD, inputs (txt, jsonl, directory, dataset), bad lines, bounded reading."""

import json
import logging
import os
import re
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest

from atorch.data import DatasetPreprocessor, MMapIndexedDataset, open_indexed_dataset
from atorch.data import preprocess as preprocess_module
from atorch.testing.assets import corpus_documents, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_all(prefix):
    ds = MMapIndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_parallel_output_equals_in_process_output(tmp_path, tokenizer):
    docs = corpus_documents(200)
    one = DatasetPreprocessor(tokenizer, chunk_size=16, workers=1).preprocess(docs, tmp_path / "one",
                                                                              progress_enabled=False)
    two = DatasetPreprocessor(tokenizer, chunk_size=16, workers=2).preprocess(iter(docs), tmp_path / "two",
                                                                              progress_enabled=False)
    for suffix in ("bin", "idx"):
        assert (tmp_path / f"one.{suffix}").read_bytes() == (tmp_path / f"two.{suffix}").read_bytes()
    expected = [encode(tokenizer, d) + [1] for d in docs]
    assert read_all(tmp_path / "two") == expected
    assert (one.documents, one.tokens, two.tokens) == (200, sum(map(len, expected)), one.tokens)
    assert one.data_file.endswith("one.bin") and one.index_file.endswith("one.idx")
    assert one.tokens_per_second > 0 and one.documents_per_second > 0
    # Only the two pairs of final files: no temporaries left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.bin", "one.idx", "two.bin", "two.idx"]


def test_eod_options(tmp_path, tokenizer):
    docs = ["alpha beta", "gamma"]
    p = DatasetPreprocessor(tokenizer, append_eod=False)
    p.preprocess(docs, tmp_path / "no_eod", progress_enabled=False)
    assert read_all(tmp_path / "no_eod") == [encode(tokenizer, d) for d in docs]
    DatasetPreprocessor(tokenizer, eod_token_id=2).preprocess(docs, tmp_path / "eod2", progress_enabled=False)
    assert read_all(tmp_path / "eod2") == [encode(tokenizer, d) + [2] for d in docs]
    with pytest.raises(ValueError, match=r"eod_token_id=845 is outside the vocabulary \[0, 845\)"):
        DatasetPreprocessor(tokenizer, eod_token_id=845)


def test_empty_documents_are_counted_not_written(tmp_path, tokenizer):
    stats = DatasetPreprocessor(tokenizer).preprocess(["", "one", "", "two"], tmp_path / "e", progress_enabled=False)
    assert (stats.documents, stats.empty_documents) == (2, 2)
    assert read_all(tmp_path / "e") == [encode(tokenizer, "one") + [1], encode(tokenizer, "two") + [1]]


@pytest.mark.parametrize("documents", [[], ["", ""]])
def test_empty_corpus_raises_and_writes_nothing(tmp_path, tokenizer, documents):
    with pytest.raises(ValueError, match=r"has no non-empty document .*nothing written to .*empty\.bin/\.idx"):
        DatasetPreprocessor(tokenizer).preprocess(documents, tmp_path / "empty", progress_enabled=False)
    assert list(tmp_path.iterdir()) == []


def test_empty_files_raise(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"corpus '.*empty\.jsonl' has no non-empty document"):
        DatasetPreprocessor(tokenizer).preprocess(tmp_path / "empty.jsonl", tmp_path / "out", progress_enabled=False)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"0 empty documents, 1 unusable lines, first: .*bad\.jsonl:1: missing key "
                                         r"'text' \(keys: \['body'\]\)\); nothing written"):
        DatasetPreprocessor(tokenizer).preprocess(tmp_path / "bad.jsonl", tmp_path / "out", progress_enabled=False)
    with pytest.raises(FileNotFoundError, match=r"corpus file '.*missing\.jsonl' not found"):
        DatasetPreprocessor(tokenizer).open_jsonl(tmp_path / "missing.jsonl")


def test_non_string_documents_raise_type_error(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="document 1 is int, expected str"):
        DatasetPreprocessor(tokenizer).preprocess(["a", 3], tmp_path / "t", progress_enabled=False)
    assert list(tmp_path.iterdir()) == []


BAD_JSONL = [
    json.dumps({"text": "first good"}),
    "{not json",
    json.dumps({"body": "wrong key"}),
    json.dumps({"text": 7}),
    "",
    json.dumps(["a", "list"]),
    json.dumps({"text": "second good", "meta": 1}),
]


def test_bad_jsonl_lines_are_counted_with_line_numbers(tmp_path, tokenizer, caplog):
    path = tmp_path / "c.jsonl"
    path.write_bytes(("\n".join(BAD_JSONL) + "\n").encode() + b'{"text": "\xff bad utf8"}\n')
    p = DatasetPreprocessor(tokenizer)
    with caplog.at_level(logging.WARNING, logger="atorch.data.preprocess"):
        stats = p.preprocess(p.open_jsonl(path), tmp_path / "out", progress_enabled=False)
    assert stats.documents == 2 and stats.skipped_lines == 6
    assert [(pr.line, pr.reason.split(" (")[0]) for pr in stats.problems] == [
        (2, "not JSON"), (3, "missing key 'text'"), (4, "value of 'text' is int, expected str"),
        (5, "empty line, expected a JSON object"), (6, "a JSON list, expected an object with key 'text'"),
        (8, "not valid UTF-8")]
    assert all(pr.source == str(path) for pr in stats.problems)
    assert "skipped 6 unusable lines" in caplog.text and f"{path}:2: not JSON" in caplog.text
    assert read_all(tmp_path / "out") == [encode(tokenizer, "first good") + [1], encode(tokenizer, "second good") + [1]]
    # strict=True: the first bad line is fatal, names file and line, and nothing is written.
    with pytest.raises(ValueError, match=rf"{path}:2: not JSON .*strict=True"):
        p.preprocess(p.open_jsonl(path, strict=True), tmp_path / "strict", progress_enabled=False)
    with pytest.raises(ValueError, match=rf"{path}:2: not JSON"):  # also with a worker pool
        DatasetPreprocessor(tokenizer, strict=True, workers=2).preprocess(
            p.open(path, strict=True), tmp_path / "strict", progress_enabled=False)
    assert not list(tmp_path.glob("strict*"))
    # Another key.
    stats = p.preprocess(p.open_jsonl(path, json_key="body"), tmp_path / "body", progress_enabled=False)
    assert stats.documents == 1 and read_all(tmp_path / "body") == [encode(tokenizer, "wrong key") + [1]]


def test_text_directory_and_dataset_inputs(tmp_path, tokenizer):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("line one\r\nline two\n")
    (tmp_path / "in" / "sub").mkdir()
    (tmp_path / "in" / "sub" / "b.jsonl").write_text(json.dumps({"text": "json doc"}) + "\n")
    (tmp_path / "in" / "notes.md").write_text("ignored")
    p = DatasetPreprocessor(tokenizer)
    expected = [encode(tokenizer, t) + [1] for t in ("line one", "line two", "json doc")]
    p.preprocess(tmp_path / "in", tmp_path / "dir", progress_enabled=False)
    assert read_all(tmp_path / "dir") == expected
    p.preprocess(p.open_text(tmp_path / "in" / "a.txt"), tmp_path / "txt", progress_enabled=False)
    assert read_all(tmp_path / "txt") == expected[:2]
    # An iterable of rows, as a datasets.IterableDataset yields them.
    rows = [{"text": "line one"}, {"text": None}, {"text": "json doc"}]
    stats = p.preprocess(p.open_hf_dataset(rows), tmp_path / "rows", progress_enabled=False)
    assert read_all(tmp_path / "rows") == [expected[0], expected[2]]
    assert [(pr.line, pr.reason) for pr in stats.problems] == [(2, "value of 'text' is NoneType, expected str")]

    class ColumnarDataset:
        """The part of datasets.Dataset that open_hf_dataset uses (a real one is in test_data_hf_datasets.py)."""

        column_names = ["content", "id"]

        def iter(self, batch_size):
            docs = ["line one", "line two", 5, "json doc"]
            for i in range(0, len(docs), batch_size):
                yield {"content": docs[i:i + batch_size]}

    stats = p.preprocess(p.open(ColumnarDataset(), json_key="content"), tmp_path / "cols", progress_enabled=False)
    assert read_all(tmp_path / "cols") == expected and stats.skipped_lines == 1
    with pytest.raises(ValueError, match=r"has no column 'text'; its columns are \['content', 'id'\]"):
        p.open_hf_dataset(ColumnarDataset())
    with pytest.raises(ValueError, match=r"has no .txt/.jsonl/.json files \(found 1 other files\)"):
        (tmp_path / "only_md").mkdir()
        (tmp_path / "only_md" / "x.md").write_text("x")
        p.open(tmp_path / "only_md")
    with pytest.raises(ValueError, match=r"has suffix '\.md'"):
        p.open(tmp_path / "in" / "notes.md")


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_impls_hold_the_same_tokens(tmp_path, tokenizer, impl):
    docs = corpus_documents(30)
    DatasetPreprocessor(tokenizer, binarization_impl=impl, workers=2, chunk_size=4).preprocess(
        docs, tmp_path / "x", progress_enabled=False)
    ds = open_indexed_dataset(tmp_path / "x", impl)
    assert [ds[i].tolist() for i in range(len(ds))] == [encode(tokenizer, d) + [1] for d in docs]


@pytest.mark.parametrize("workers", [1, 2])
def test_reading_stays_bounded(tmp_path, tokenizer, monkeypatch, workers):
    # The input is pulled only a bounded window ahead of what is written: memory does not
    # grow with the corpus (Pool.imap would have read all 5000 documents up front).
    pulled = []

    def documents():
        for i in range(5000):
            pulled.append(i)
            yield f"document number {i}"

    ahead = []
    real_add = preprocess_module.IndexedDatasetWriter.add_sequences

    def add_sequences(self, tokens, sizes):
        ahead.append(len(pulled) - (self.num_sequences + sizes.size))
        real_add(self, tokens, sizes)

    monkeypatch.setattr(preprocess_module.IndexedDatasetWriter, "add_sequences", add_sequences)
    stats = DatasetPreprocessor(tokenizer, chunk_size=10, workers=workers).preprocess(
        documents(), tmp_path / "b", progress_enabled=False)
    assert stats.documents == 5000
    window = preprocess_module._INFLIGHT_PER_WORKER * workers * 10 if workers > 1 else 10
    assert max(ahead) <= window, (max(ahead), window)


def test_progress_shows_rates(tmp_path, tokenizer, capsys, caplog):
    p = DatasetPreprocessor(tokenizer, chunk_size=10)
    p.preprocess(corpus_documents(50), tmp_path / "bar", log_interval=20)
    err = capsys.readouterr().err
    assert "50 docs" in err and "tokens/s=" in err and "docs/s=" in err
    with caplog.at_level(logging.INFO, logger="atorch.data.preprocess"):
        p.preprocess(corpus_documents(50), tmp_path / "log", log_interval=20, progress_enabled=False)
    assert caplog.text.count("docs/s") >= 2 and "tokens/s" in caplog.text


def test_bad_arguments(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="binarization_impl='npy' is not supported"):
        DatasetPreprocessor(tokenizer, binarization_impl="npy")
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        DatasetPreprocessor(tokenizer, workers=0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
        DatasetPreprocessor(tokenizer, chunk_size=0)

    class NoEos:
        eos_token_id = None

        def __len__(self):
            return 10

    with pytest.raises(ValueError, match="append_eod=True but eod_token_id is None"):
        DatasetPreprocessor(NoEos())

    class OutOfVocab(NoEos):
        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [[3, 12] for _ in texts]}

    with pytest.raises(ValueError, match=r"token id 12, outside the vocabulary \[0, 10\)"):
        DatasetPreprocessor(OutOfVocab(), append_eod=False).preprocess(["x"], tmp_path / "v", progress_enabled=False)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_path_and_tokenizers_object(tmp_path, tokenizer):
    from atorch.testing.assets import TOKENIZER_DIR

    DatasetPreprocessor(str(TOKENIZER_DIR)).preprocess(["abc"], tmp_path / "a", progress_enabled=False)
    DatasetPreprocessor(tokenizer.backend_tokenizer, eod_token_id=1).preprocess(["abc"], tmp_path / "b",
                                                                                progress_enabled=False)
    assert read_all(tmp_path / "a") == read_all(tmp_path / "b") == [encode(tokenizer, "abc") + [1]]
    assert np.dtype(MMapIndexedDataset(tmp_path / "a").dtype) == np.uint16


def test_fast_batch_encoding_gives_the_same_ids(tokenizer):
    # Workers tokenize with the Rust backend's encode_batch_fast (no character offsets) when it has one;
    # the ids must be those of the offset-tracking encode_batch, and it must really be the call made.
    backend = tokenizer.backend_tokenizer
    docs = corpus_documents(40) + [""]
    expected = [e.ids for e in backend.encode_batch(docs, add_special_tokens=False)]
    encoder = preprocess_module._ChunkEncoder(tokenizer, np.dtype(np.uint16), 845, None)
    assert encoder._token_ids(docs) == expected
    calls = []

    class Spy:  # a tokenizers.Tokenizer lookalike whose offset-tracking call must not be used
        def encode_batch(self, texts, add_special_tokens):
            raise AssertionError("encode_batch used although encode_batch_fast exists")

        def encode_batch_fast(self, texts, add_special_tokens):
            calls.append(len(texts))
            return backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    spied = preprocess_module._ChunkEncoder(Spy(), np.dtype(np.uint16), 845, None)
    assert spied._token_ids(docs) == expected and calls == [len(docs)]


class _DiesInWorker:
    """A Python tokenizer whose worker process dies abruptly (as if killed) on its second chunk."""

    eos_token_id = 1

    def __init__(self, parent_pid):
        self.parent_pid = parent_pid
        self.calls = 0

    def __len__(self):
        return 845

    def __call__(self, texts, add_special_tokens):
        self.calls += 1
        if os.getpid() != self.parent_pid and self.calls == 2:
            os._exit(9)
        return {"input_ids": [[5, 6] for _ in texts]}


def test_dead_worker_raises_instead_of_hanging(tmp_path):
    # multiprocessing.Pool would wait forever for the lost chunk; the executor reports the dead worker.
    with pytest.raises(BrokenProcessPool):
        DatasetPreprocessor(_DiesInWorker(os.getpid()), chunk_size=2, workers=2).preprocess(
            [f"doc {i}" for i in range(40)], tmp_path / "dead", progress_enabled=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_text_not_encodable_as_utf8_is_a_counted_bad_line(tmp_path, tokenizer, workers):
    # A lone surrogate is valid JSON ("\ud800") but no UTF-8: the tokenizer refused the whole chunk with a bare
    # TypeError, naming neither file nor line, and nothing was written.
    path = tmp_path / "s.jsonl"
    # JSON's escaped surrogate pair (line 3) is one real character and fine.
    path.write_text('{"text": "good one"}\n{"text": "abc \\ud800 def"}\n{"text": "good \\ud83d\\ude00"}\n')
    p = DatasetPreprocessor(tokenizer, workers=workers, chunk_size=2)
    stats = p.preprocess(path, tmp_path / "out", progress_enabled=False)
    assert (stats.documents, stats.skipped_lines) == (2, 1)
    assert str(stats.problems[0]) == f"{path}:2: text not encodable as UTF-8 (surrogates not allowed '\\ud800' at " \
                                     "character 4)"
    assert read_all(tmp_path / "out") == [encode(tokenizer, d) + [1] for d in ("good one", "good \U0001F600")]
    with pytest.raises(ValueError, match=rf"{path}:2: text not encodable as UTF-8 .*strict=True"):
        DatasetPreprocessor(tokenizer, workers=workers, strict=True).preprocess(path, tmp_path / "strict",
                                                                               progress_enabled=False)
    assert not list(tmp_path.glob("strict*"))
    # A plain list of str: the position is the line.
    stats = p.preprocess(["ok", "x\ud800y", "\U0001F600"], tmp_path / "list", progress_enabled=False)
    assert (stats.documents, stats.skipped_lines) == (2, 1)
    assert str(stats.problems[0]).startswith("list:2: document 1: text not encodable as UTF-8")
    with pytest.raises(ValueError, match=r"list:2: document 1: text not encodable as UTF-8 .*strict=True"):
        DatasetPreprocessor(tokenizer, workers=workers, strict=True).preprocess(["ok", "x\udfffy"], tmp_path / "s2",
                                                                               progress_enabled=False)
    # Dataset rows (dicts) too.
    rows = [{"text": "fine"}, {"text": "bad \udc80"}]
    stats = p.preprocess(p.open_hf_dataset(rows), tmp_path / "rows", progress_enabled=False)
    assert (stats.documents, stats.skipped_lines, stats.problems[0].line) == (1, 1, 2)


@pytest.mark.parametrize("eod, kind", [(1.5, "1.5"), (844.9, "844.9"), (1.0, "1.0"), (True, "True"), ("1", "'1'"),
                                       (-1, "-1")])
def test_eod_token_id_must_be_an_int(tokenizer, eod, kind):
    # 1.5 was written as EOD 1, 844.9 as token 844 (a real token), True as 1; "1" gave a bare TypeError.
    with pytest.raises(ValueError, match=rf"eod_token_id must be None or a token id >= 0, got {re.escape(kind)}$"):
        DatasetPreprocessor(tokenizer, eod_token_id=eod)
    assert DatasetPreprocessor(tokenizer, eod_token_id=np.int64(2)).eod_token_id == 2


@pytest.mark.parametrize("content", ['[\n{"text": "a"},\n{"text": "b"}\n]\n', '[{"text": "a"}, {"text": "b"}]\n',
                                     '\n  [\n  {"text": "a"}\n]'])
def test_json_array_file_is_refused_naming_it(tmp_path, tokenizer, content):
    # It was read as JSON Lines: "a" lost, the other lines skipped as "not JSON", only a log warning.
    path = tmp_path / "arr.json"
    path.write_text(content)
    message = rf"corpus file '{re.escape(str(path))}' holds a JSON array .* reads JSON Lines, one object per line"
    with pytest.raises(ValueError, match=message):
        DatasetPreprocessor(tokenizer).preprocess(path, tmp_path / "out", progress_enabled=False)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "arr.json").write_text(content)
    with pytest.raises(ValueError, match="holds a JSON array"):
        DatasetPreprocessor(tokenizer, workers=2).preprocess(tmp_path / "dir", tmp_path / "out", progress_enabled=False)
    assert not list(tmp_path.glob("out*"))
    # A JSON Lines file whose first line is a list of strings is still a bad line, not an array file.
    path.write_text('["a", "list"]\n{"text": "doc"}\n')
    stats = DatasetPreprocessor(tokenizer).preprocess(path, tmp_path / "ok", progress_enabled=False)
    assert (stats.documents, stats.skipped_lines) == (1, 1)


def test_a_mapping_is_refused_naming_what_to_pass(tmp_path, tokenizer):
    p = DatasetPreprocessor(tokenizer)
    # Iterating a dict yields its keys: a dict of columns was written as the one document 'text</s>'.
    with pytest.raises(TypeError, match=r"documents is a dict with keys \['text'\]; a mapping's keys would be read "
                                        r"as the documents: pass an iterable of str, e.g. documents\['text'\]"):
        p.preprocess({"text": ["one", "two"]}, tmp_path / "d", progress_enabled=False)
    with pytest.raises(TypeError, match=r"source is a dict with keys \['text'\]"):
        p.open({"text": ["one"]})
    # Rows (dicts) in a plain iterable: say which reader takes them.
    with pytest.raises(TypeError, match=r"document 0 is dict, expected str: rows of a dataset\? read them with "
                                        r"open_hf_dataset\(rows, text_key=\.\.\.\)"):
        p.preprocess([{"text": "one"}], tmp_path / "r", progress_enabled=False)
    assert list(tmp_path.iterdir()) == []


def test_a_byte_order_mark_opening_a_file_is_dropped(tmp_path, tokenizer):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(bom + b"first line\r\nsecond\n")
    (tmp_path / "in" / "b.jsonl").write_bytes(bom + b'{"text": "json first"}\n{"text": "json second"}\n')
    p = DatasetPreprocessor(tokenizer)
    # The .txt kept the mark as the first token of its first document; the .jsonl skipped its whole first line.
    stats = p.preprocess(tmp_path / "in", tmp_path / "out", progress_enabled=False)
    assert stats.skipped_lines == 0
    assert read_all(tmp_path / "out") == [encode(tokenizer, t) + [1] for t in
                                          ("first line", "second", "json first", "json second")]
    # Only at the start of a file: elsewhere it is text (U+FEFF), as with the utf-8-sig codec.
    (tmp_path / "mid.txt").write_bytes(b"a\n" + bom + b"b\n")
    assert list(p.open(tmp_path / "mid.txt")) == ["a", "\ufeffb"]


def test_a_list_of_sentences_is_refused_saying_to_join_it(tmp_path, tokenizer):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"text": ["One sentence.", "Another."]}) + "\n" + json.dumps({"text": "whole"}) + "\n")
    p = DatasetPreprocessor(tokenizer)
    stats = p.preprocess(path, tmp_path / "out", progress_enabled=False)
    assert read_all(tmp_path / "out") == [encode(tokenizer, "whole") + [1]]
    assert [(pr.line, pr.reason) for pr in stats.problems] == [
        (1, "value of 'text' is a list of 2 str (split sentences?); a document is one str: join them first "
            "(a .jsonl file: `jq -c '.text |= join(\" \")'`)")]
    with pytest.raises(ValueError, match=r"s\.jsonl:1: value of 'text' is a list of 2 str"):
        p.preprocess(p.open(path, strict=True), tmp_path / "strict", progress_enabled=False)


def test_directories_match_suffixes_in_any_case_and_skip_hidden_files(tmp_path, tokenizer, caplog):
    (tmp_path / "in" / ".git").mkdir(parents=True)
    (tmp_path / "in" / "UPPER.TXT").write_text("upper\n")
    (tmp_path / "in" / "b.JSONL").write_text(json.dumps({"text": "json"}) + "\n")
    (tmp_path / "in" / ".hidden.txt").write_text("hidden\n")
    (tmp_path / "in" / ".git" / "c.txt").write_text("in a hidden folder\n")
    (tmp_path / "in" / "notes.md").write_text("ignored")
    p = DatasetPreprocessor(tokenizer)
    with caplog.at_level(logging.WARNING, logger="atorch.data.sources"):
        assert list(p.open(tmp_path / "in")) == ["upper", "json"]
    assert "ignoring 1 files that are not .txt/.jsonl/.json and 2 hidden files" in caplog.text
    assert list(p.open(tmp_path / "in" / "UPPER.TXT")) == ["upper"]
    (tmp_path / "hidden_only" / ".x").mkdir(parents=True)
    (tmp_path / "hidden_only" / ".x" / "a.txt").write_text("x\n")
    with pytest.raises(ValueError, match=r"has no .txt/.jsonl/.json files \(found 0 other files and 1 hidden ones\)"):
        p.open(tmp_path / "hidden_only")
