"""The `atorch` command: plan (the cost model's table for a cluster), env, run's help, merge."""

import json
import re
import subprocess
import sys

import pytest
import torch

from atorch.auto.cost_model import calibrated_shape, estimate
from atorch.auto.devices import device_spec
from atorch.auto.search.cluster_plan import load_model_config, meta_model, plan_cluster
from atorch.cli import main


def test_plan_7b_on_64_h100_is_the_cost_model_ranked():
    config = load_model_config("llama2-7b")
    result = plan_cluster(config, 64, "h100", global_batch=512, seq_len=4096, nnodes=8)
    assert 6.5e9 < result.num_params < 7e9
    assert not result.table.empty and list(result.table["rank"])[:3] == [1, 2, 3]
    # Ranked by predicted throughput; every row fits and every refused one does not.
    assert result.table["samples_per_s"].is_monotonic_decreasing
    assert (result.table["memory_gb"] <= 80).all() and (result.too_big["memory_gb"] > 80).all()
    # The figures are the cost model's own for that strategy, cluster and device profile.
    from atorch.auto.search.space import SearchSpace

    model = meta_model(config)
    shape = calibrated_shape(model, 4096)
    by_label = {c.label(): c.strategy for c in SearchSpace.default_for(model, 64, "cuda",
                                                                        global_batch_size=512).candidates()}
    top = result.table.iloc[0]
    est = estimate(shape, by_label[top["strategy"]], 512, 4096, 64, "cuda",
                   profile=device_spec("h100").profile(multi_node=True, ranks_per_node=8))
    assert top["memory_gb"] == pytest.approx(est.peak_memory_bytes / 1e9)
    assert top["step_time_s"] == pytest.approx(est.step_time_s)
    # Plain data parallelism of a 7B model with fp32 Adam cannot fit an 80 GB device.
    assert "parallel_mode(data=64)+ddp" in set(result.too_big["strategy"])
    text = result.format(5)
    assert "64 x NVIDIA H100" in text and "do not fit" in text
    # 8 nodes of 8: tensor splits stay inside a node (16 or more would all-reduce over the network).
    labels = list(result.table["strategy"]) + list(result.too_big["strategy"])
    degrees = {int(m) for label in labels for m in re.findall(r"tensor=(\d+)", label)}
    assert degrees and max(degrees) == 8


def test_plan_refuses_layouts_the_global_batch_does_not_split_over(capsys):
    # auto_accelerate refuses a global batch of 4 over data=8 (validate_batch_layout): the plan ranks none of them,
    # and lists them as refused with the reason.
    config = load_model_config("llama2-7b")
    result = plan_cluster(config, 8, "h100", global_batch=4, seq_len=512)
    ranked = list(result.table["strategy"]) + list(result.too_big["strategy"])
    assert ranked and not [s for s in ranked if "data=8" in s]
    assert not result.refused.empty and all("data=8" in s for s in result.refused["strategy"])
    assert "parallel_mode(data=8)" in set(result.refused["strategy"])
    assert (result.refused["reason"].str.contains("batch_size']=4 .* not divisible by the data-parallel size 8")).all()
    text = result.format(3)
    assert "refused: the global batch does not split" in text and "data-parallel size 8" in text
    # 7 rows on 8 ranks: data must divide 7, and only data=1 does (tensor x pipeline x data = 8).
    result = plan_cluster(config, 8, "h100", global_batch=7, seq_len=512)
    ranked = list(result.table["strategy"]) + list(result.too_big["strategy"])
    assert ranked and all(s.startswith("parallel_mode(tensor=8,data=1)") for s in ranked)
    assert {s.split("+")[0] for s in result.refused["strategy"]} == {
        "parallel_mode(data=8)", "parallel_mode(tensor=2,data=4)", "parallel_mode(tensor=4,data=2)"}
    # Pipelines are offered only where the rows per data rank split into their chunks.
    result = plan_cluster(config, 8, "h100", global_batch=16, seq_len=512)
    assert any("pipeline=" in s for s in result.table["strategy"]) and result.refused.empty
    # Every candidate refused (gpt2-xl's 25 heads allow no tensor split, 7 rows no pipeline): one line, exit 2.
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "gpt2-xl", "--nproc", "8", "--global-batch", "7", "--seq", "512"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "auto_accelerate would refuse every one" in err and "size 8" in err


def test_plan_command_and_bad_input(capsys, tmp_path):
    assert main(["plan", "--model", "gpt2-xl", "--nproc", "8", "--device", "a100", "--global-batch", "64",
                 "--seq", "1024", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "x NVIDIA A100 80GB" in out and "rank" in out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "no-such-model", "--nproc", "8", "--global-batch", "8", "--seq", "8"])
    assert "neither a preset" in capsys.readouterr().err
    # Usage mistakes are one line naming the flag or file and exit 2, not a traceback.
    not_json = tmp_path / "config.json"
    not_json.write_text("model_type: llama")
    for argv, text in ((["plan", "--model", str(not_json), "--nproc", "8", "--global-batch", "8", "--seq", "8"],
                        "is not a JSON model config"),
                       (["plan", "--model", "gpt2-xl", "--nproc", "8", "--nnodes", "0", "--global-batch", "8",
                         "--seq", "8"], "--nnodes=0 must be >= 1"),
                       (["merge", str(tmp_path / "no_ckpt"), str(tmp_path / "hf")], "no such checkpoint directory")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and text in capsys.readouterr().err, argv


def test_plan_reads_config_files_as_transformers_does(capsys, tmp_path):
    """A config transformers wrote itself loads (an infinite float is written as {"__float__": "Infinity"}: the
    planner's own json.loads + for_model raised a traceback); a value transformers refuses is one line, exit 2,
    naming the file and transformers' reason (it was a traceback with exit status 1)."""
    from transformers import FalconH1Config

    saved = tmp_path / "falcon_h1"
    FalconH1Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128).save_pretrained(str(saved))   # time_step_limit (0, inf)
    assert "Infinity" in (saved / "config.json").read_text()
    for model in (saved, saved / "config.json"):
        loaded = load_model_config(str(model))
        assert type(loaded).__name__ == "FalconH1Config" and tuple(loaded.time_step_limit) == (0.0, float("inf"))

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": "big"}))
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", str(bad), "--nproc", "8", "--global-batch", "8", "--seq", "128"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    assert f"transformers refuses {bad} as a 'llama' config" in err and "'hidden_size'" in err, err


def test_env_run_help_and_unknown_command(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "distributed backends: gloo" in out
    assert main(["run", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert help_text.index("--fault_tolerant") < help_text.index("torchrun's")
    assert main(["frobnicate"]) == 2


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--nproc_per_node", "2", "--help"]])
def test_the_launcher_module_prints_its_help(argv, capsys):
    """`python -m atorch.distributed.run --help` failed with "no training script in ['--help']"."""
    from atorch.distributed.run import main as run_main

    with pytest.raises(SystemExit) as info:
        run_main(argv)
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: atorch.distributed.run ") and "--fault_tolerant" in out


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "atorch.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "atorch plan" in out.stdout


def test_plan_exits_1_when_nothing_fits(capsys):
    code = main(["plan", "--model", "llama2-7b", "--nproc", "1", "--device", "a100", "--device-memory-gb", "1",
                 "--global-batch", "4", "--seq", "512", "--top", "1"])
    assert code == 1 and "no candidate strategy fits in device memory" in capsys.readouterr().out
