"""The preprocessing command (`atorch preprocess`, `python -m atorch.data.preprocess`) on a tiny corpus with the
bundled tokenizer: the files it writes read back as the API's, and bad input is a usage error that writes nothing."""

import json
import subprocess
import sys

import pytest

from atorch.cli import main
from atorch.data import MMapIndexedDataset, open_indexed_dataset
from atorch.testing.assets import TOKENIZER_DIR, load_tokenizer


def read_all(prefix, impl="mmap"):
    ds = open_indexed_dataset(prefix, impl)
    return [ds[i].tolist() for i in range(len(ds))]


def test_atorch_preprocess_writes_what_the_api_writes(tmp_path, capsys):
    tok = load_tokenizer()
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("first file line\nsecond line\n")
    (tmp_path / "corpus" / "b.jsonl").write_text(json.dumps({"body": "json body"}) + "\n{bad\n")
    (tmp_path / "corpus" / "sub" / "c.TXT").write_text("nested upper\n")
    texts = ["first file line", "second line", "json body", "nested upper"]
    base = ["preprocess", "--input", str(tmp_path / "a.txt"), str(tmp_path / "corpus"), "--tokenizer",
            str(TOKENIZER_DIR), "--json-key", "body"]
    assert main(base + ["--output-prefix", str(tmp_path / "out" / "web"), "--workers", "2", "--chunk-size", "1"]) == 0
    assert "wrote 4 documents" in capsys.readouterr().out
    assert read_all(tmp_path / "out" / "web") == [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert MMapIndexedDataset(tmp_path / "out" / "web").dtype.name == "uint16"
    assert main(base + ["--output-prefix", str(tmp_path / "noeod"), "--no-append-eod", "--dataset-impl", "lazy"]) == 0
    assert read_all(tmp_path / "noeod", "lazy") == [tok(t)["input_ids"] for t in texts]
    # --strict: the bad JSON line is a usage error naming file and line, and nothing is written.
    with pytest.raises(SystemExit) as exit_info:
        main(base + ["--output-prefix", str(tmp_path / "strict"), "--strict"])
    assert exit_info.value.code == 2 and "b.jsonl:2: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["preprocess", "--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "m"),
              "--tokenizer", str(TOKENIZER_DIR)])
    assert "corpus file" in capsys.readouterr().err and not list(tmp_path.glob("strict*")) + list(tmp_path.glob("m.*"))


def test_the_module_prints_its_help():
    # It printed nothing and exited 0: the module had no command.
    done = subprocess.run([sys.executable, "-m", "atorch.data.preprocess", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--output-prefix" in done.stdout and "--tokenizer" in done.stdout
    assert "RuntimeWarning" not in done.stderr, done.stderr     # the package no longer imports it first
    assert "preprocess" in subprocess.run([sys.executable, "-m", "atorch.cli", "--help"], capture_output=True,
                                          text=True, timeout=120).stdout


def test_an_output_prefix_without_a_file_name_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("a line\n")
    with pytest.raises(SystemExit) as exit_info:   # it wrote the hidden files out/.bin and out/.idx
        main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix", f"{tmp_path}/out/", "--tokenizer",
              str(TOKENIZER_DIR)])
    assert exit_info.value.code == 2 and "has no file name part" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
