"""`atorch plan --device-memory-gb` and `atorch convert-strategy` destinations: usage errors (exit 2), honest output."""

import pickle

import pytest

from atorch.auto.search.cluster_plan import load_model_config, plan_cluster
from atorch.cli import main

PLAN = ["plan", "--model", "llama2-7b", "--nproc", "8", "--global-batch", "8", "--seq", "128"]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_plan_refuses_a_device_memory_that_is_not_positive(capsys, value):
    with pytest.raises(SystemExit) as info:
        main(PLAN + ["--device-memory-gb", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--device-memory-gb={float(value)} must be a positive number of GB" in err
    with pytest.raises(ValueError, match="device_memory_bytes=0 must be > 0"):
        plan_cluster(load_model_config("llama2-7b"), 8, "h100", 8, 128, device_memory_bytes=0)


def test_plan_header_reports_the_memory_used(capsys):
    assert main(PLAN + ["--device-memory-gb", "40"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "(40 GB each, --device-memory-gb overriding the device's 80 GB)" in header, header
    assert main(PLAN) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "(80 GB each)" in header, header


@pytest.fixture
def pickled(tmp_path):
    src = tmp_path / "s.pkl"
    src.write_bytes(pickle.dumps([("parallel_mode", None), "amp_native"]))
    return src


def test_convert_strategy_to_a_bad_destination_is_one_line_and_leaves_nothing(capsys, tmp_path, pickled):
    (tmp_path / "adir").mkdir()
    for dst, says in ((tmp_path / "missing" / "x.json", "which is not an existing directory; create it first"),
                      (tmp_path / "adir", "is a directory; give the path of the JSON file to write")):
        with pytest.raises(SystemExit) as info:
            main(["convert-strategy", str(pickled), str(dst)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "s.pkl"]   # no adir.tmp
    assert main(["convert-strategy", str(pickled), str(tmp_path / "ok.json")]) == 0
    assert (tmp_path / "ok.json").is_file() and not (tmp_path / "ok.json.tmp").exists()


def test_a_failed_strategy_save_removes_its_temporary_file(tmp_path):
    from atorch.auto.strategy import Strategy

    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):
        Strategy(["amp_native"]).save(tmp_path / "adir")
    assert not (tmp_path / "adir.tmp").exists()


def test_usage_lists_convert_strategy(capsys):
    assert main([]) == 0
    assert "`convert-strategy`" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("item, says", [
    ({"name": "nosuch_opt"}, "unknown optimization 'nosuch_opt'; valid names are"),
    ({"name": "fsdp", "config": 5}, "item 0 (fsdp): fsdp: config 5 must be None, a dict"),
])
def test_convert_strategy_refuses_what_auto_accelerate_would_refuse(capsys, tmp_path, item, says):
    import json

    src = tmp_path / "s.json"
    src.write_text(json.dumps({"format": "atorch.strategy/1", "items": [item]}))
    with pytest.raises(SystemExit) as info:
        main(["convert-strategy", str(src), str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "out.json").exists()


def test_run_without_a_script_is_a_usage_error(capsys):
    assert main(["run"]) == 2
    assert "give the training script to launch" in capsys.readouterr().err
    assert main(["run", "--help"]) == 0


def test_plan_names_a_small_models_parameter_count(capsys, tmp_path):
    from atorch.testing import tiny_llama_config

    tiny_llama_config().save_pretrained(tmp_path)
    main(["plan", "--model", str(tmp_path), "--nproc", "2", "--global-batch", "8", "--seq", "32"])
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("213.3K parameters on 2 x"), header


def test_plan_into_a_closed_pipe_ends_quietly():
    import subprocess
    import sys

    reader = subprocess.run(f"{sys.executable} -m atorch.cli plan --model llama2-7b --nproc 8 --global-batch 64 "
                            f"--seq 2048 | head -1", shell=True, capture_output=True, text=True, timeout=120)
    assert "parameters on 8 x" in reader.stdout and "Traceback" not in reader.stderr, reader.stderr
