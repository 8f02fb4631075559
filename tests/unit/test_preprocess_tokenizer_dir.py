"""`--tokenizer DIR` / `DatasetPreprocessor("DIR")` where DIR holds no tokenizer files: an error naming the
directory and the files expected (as `atorch merge --tokenizer` gives), not transformers' "Couldn't instantiate
the backend tokenizer ... install sentencepiece or tiktoken"."""

import json
import re

import pytest

from atorch.checkpoint.tokenizer_files import TOKENIZER_FILES
from atorch.cli import main
from atorch.data import DatasetPreprocessor
from atorch.testing.assets import TOKENIZER_DIR


def test_a_directory_without_tokenizer_files_names_the_directory_and_the_files(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")       # a model's directory saved without its tokenizer
    expected = (rf"tokenizer directory {re.escape(str(model_dir))} has none of the tokenizer files "
                r"\['tokenizer\.json', .*\] \(it holds \['config\.json'\]\); pass the directory a tokenizer was "
                r"saved to")
    with pytest.raises(ValueError, match=expected):
        DatasetPreprocessor(str(model_dir))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has none of the tokenizer files .* \(it is empty\)"):
        DatasetPreprocessor(empty)


def test_the_command_reports_it_as_a_usage_error_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("a line\n")
    (tmp_path / "tok").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out"),
              "--tokenizer", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"tokenizer directory {tmp_path / 'tok'} has none of the tokenizer files" in err
    assert all(name in err for name in TOKENIZER_FILES)
    assert "sentencepiece" not in err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizer", "GPT2Tokenizer", "BertTokenizer"])
def test_settings_without_a_vocabulary_are_refused(tmp_path, tokenizer_class):
    """transformers 5 builds a tokenizer of 1-5 tokens from tokenizer_config.json alone: every document would be
    unknown tokens."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    (tmp_path / "special_tokens_map.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"tokenizer directory {re.escape(str(tmp_path))} holds no vocabulary "
                                         rf"\(\[.*'tokenizer_config.json'.*\]\): the {tokenizer_class} "
                                         r"transformers built from it knows \d tokens"):
        DatasetPreprocessor(str(tmp_path))


def test_a_byte_level_tokenizer_needs_no_vocabulary_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    assert DatasetPreprocessor(str(tmp_path)).vocab_size >= 256


def test_a_tokenizer_directory_still_loads():
    assert DatasetPreprocessor(str(TOKENIZER_DIR)).vocab_size > 0
