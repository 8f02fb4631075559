"""The Llama 2 entry scripts hand every environment variable to the launcher and the script (no training run).

A stand-in for `python` records the command line each entry script would exec; the recorded
arguments are then parsed by the training script's own parser, so a variable the README lists
but the script ignores fails here. Also the shared helpers' argument and data checks (milliseconds).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "llama2"
sys.path.insert(0, str(EXAMPLES))

import bayes_opt_sg_llama2  # noqa: E402
import example_utils as eu  # noqa: E402
import fsdp_llama2  # noqa: E402

# Every variable an entry script reads; cleared so the caller's environment cannot leak in.
ENTRY_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DATASET_PATH",
              "MODEL_NAME_OR_PATH", "CONFIG_NAME", "TOKENIZER_NAME", "PER_DEVICE_TRAIN_BATCH_SIZE", "BLOCK_SIZE",
              "MAX_STEPS", "LEARNING_RATE", "PEAK_TFLOPS", "LOG_STEPS", "LOG_WITH", "SAVE_STEPS", "RESUME", "USE_LORA", "USE_FP8",
              "PIPELINE_PARALLEL_SIZE", "MODEL_PARALLEL_SIZE", "MICRO_BATCH_SIZE", "ACCU_STEPS", "BO_SG_MAX_IETR",
              "RANDOM_SAMPLE", "OUTPUT_DIR", "PYTHON")

RECORDER = f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:2] == ["-c"]:   # the NPROC_PER_NODE default probe: let the real interpreter answer
    os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])
search_env = {{k: os.environ.get(k) for k in ("BO_SG_MAX_IETR", "RANDOM_SAMPLE", "TORCH_EXTENSIONS_DIR")}}
print(json.dumps({{"argv": sys.argv[1:], "env": search_env}}))
"""


def record(tmp_path, entry, **env_vars):
    """(launcher args, script path, script args, recorded env) of the command `entry` would exec."""
    recorder = tmp_path / "python"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ENTRY_VARS + ("TORCH_EXTENSIONS_DIR",)}
    env.update(PYTHON=str(recorder), **{k: str(v) for k, v in env_vars.items()})
    out = subprocess.run(["bash", str(EXAMPLES / entry)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    recorded = json.loads(out.stdout.strip().splitlines()[-1])
    argv = recorded["argv"]
    assert argv[:2] == ["-m", "atorch.distributed.run"], argv
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return argv[2:script], argv[script], argv[script + 1:], recorded["env"], out.stderr


def pairs(args):
    """{--flag: value} (None for a bare flag)."""
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = None
            i += 1
    return out


def test_fsdp_entry_passes_every_variable(tmp_path):
    launch, script, args, _, _ = record(
        tmp_path, "fsdp_llama2_entry.sh", NPROC_PER_NODE=3, NNODES=2, NODE_RANK=1, MASTER_ADDR="10.0.0.7",
        DATASET_PATH="/data/c.jsonl", MODEL_NAME_OR_PATH="/models/llama", PER_DEVICE_TRAIN_BATCH_SIZE=5,
        BLOCK_SIZE=128, MAX_STEPS=7, LEARNING_RATE=0.01, LOG_STEPS=2, SAVE_STEPS=3, RESUME=1, USE_LORA=1, USE_FP8=1,
        OUTPUT_DIR=str(tmp_path / "out"), TOKENIZER_NAME="/tok", PEAK_TFLOPS=312, LOG_WITH="tensorboard")
    assert pairs(launch) == {"--nnodes": "2", "--node_rank": "1", "--master_addr": "10.0.0.7",
                             "--nproc_per_node": "3", "--master_port": "29500"}   # multi-node: a fixed default port
    assert script == str(EXAMPLES / "fsdp_llama2.py")
    assert pairs(args) == {"--output_dir": str(tmp_path / "out"), "--per_device_train_batch_size": "5",
                           "--block_size": "128", "--max_steps": "7", "--log_steps": "2", "--save_steps": "3",
                           "--model_name_or_path": "/models/llama", "--tokenizer_name": "/tok",
                           "--dataset_path": "/data/c.jsonl", "--learning_rate": "0.01", "--peak_tflops": "312",
                           "--log_with": "tensorboard", "--resume": None,
                           "--use_lora": None, "--use_fp8": None}
    parsed = fsdp_llama2.build_parser().parse_args(args)
    assert (parsed.per_device_train_batch_size, parsed.block_size, parsed.max_steps, parsed.log_steps,
            parsed.save_steps, parsed.learning_rate, parsed.peak_tflops, parsed.resume, parsed.use_lora,
            parsed.use_fp8, parsed.log_with) == (5, 128, 7, 2, 3, 0.01, 312.0, "latest", True, True, "tensorboard")


def test_defaults_single_node_and_resume_path(tmp_path):
    launch, _, args, env, _ = record(tmp_path, "fsdp_llama2_entry.sh", RESUME="/ckpt/step_10", USE_LORA="false")
    # NPROC_PER_NODE: the GPU count, else 2; no MASTER_PORT on one node -> the launcher's free port.
    assert pairs(launch) == {"--nnodes": "1", "--node_rank": "0", "--master_addr": "127.0.0.1",
                             "--nproc_per_node": str(torch.cuda.device_count() or 2)}
    # DeepSpeed's CPU comm op: the one `make install` prebuilt inside the venv, when there is one.
    prebuilt = Path(sys.prefix) / "torch_extensions"
    assert env["TORCH_EXTENSIONS_DIR"] == (str(prebuilt) if prebuilt.is_dir() else None)
    parsed = fsdp_llama2.build_parser().parse_args(args)
    assert parsed.resume == "/ckpt/step_10" and not parsed.use_lora and not parsed.use_fp8
    assert (parsed.output_dir, parsed.block_size, parsed.per_device_train_batch_size, parsed.max_steps,
            parsed.log_steps, parsed.save_steps) == ("./outputs/fsdp_llama2", 256, 4, 100, 10, 50)


def test_bayes_entry_exports_the_search_variables(tmp_path):
    _, script, args, env, _ = record(tmp_path, "bayes_opt_sg_llama2_entry.sh", NPROC_PER_NODE=2,
                                     BO_SG_MAX_IETR=4, RANDOM_SAMPLE=1, USE_LORA=1, CONFIG_NAME="/cfg")
    assert script == str(EXAMPLES / "bayes_opt_sg_llama2.py")
    # The planner reads them in each worker.
    assert (env["BO_SG_MAX_IETR"], env["RANDOM_SAMPLE"]) == ("4", "1")
    parsed = bayes_opt_sg_llama2.build_parser().parse_args(args)
    assert parsed.use_lora and parsed.config_name == "/cfg" and parsed.output_dir == "./outputs/bayes_opt_sg_llama2"
    _, _, _, env, _ = record(tmp_path, "bayes_opt_sg_llama2_entry.sh", NPROC_PER_NODE=2)
    assert (env["BO_SG_MAX_IETR"], env["RANDOM_SAMPLE"]) == ("10", "3")


def test_ds_3d_entry_passes_the_parallel_sizes(tmp_path):
    import ds_3d_llama2

    launch, script, args, _, stderr = record(
        tmp_path, "ds_3d_llama2_entry.sh", NPROC_PER_NODE=8, MODEL_PARALLEL_SIZE=2, PIPELINE_PARALLEL_SIZE=2,
        MICRO_BATCH_SIZE=3, ACCU_STEPS=5, USE_FP8=0, USE_LORA="no", PER_DEVICE_TRAIN_BATCH_SIZE=4)
    assert script == str(EXAMPLES / "ds_3d_llama2.py")
    assert "PER_DEVICE_TRAIN_BATCH_SIZE is not used by the 3D script" in stderr
    parsed = ds_3d_llama2.build_parser().parse_args(args)
    assert (parsed.model_parallel_size, parsed.pipeline_parallel_size, parsed.micro_batch_size,
            parsed.accu_steps) == (2, 2, 3, 5)
    for var, needle in (("USE_FP8", "conflicts with fp8"), ("USE_LORA", "no LoRA on DeepSpeed pipeline stages")):
        env = {k: v for k, v in os.environ.items() if k not in ENTRY_VARS}
        env.update(NPROC_PER_NODE="1", PYTHON="/bin/false", **{var: "1"})
        out = subprocess.run(["bash", str(EXAMPLES / "ds_3d_llama2_entry.sh")], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and f"error: {var}=1 is not supported by the 3D example" in out.stderr
        assert needle in out.stderr


@pytest.mark.parametrize("entry", ["fsdp_llama2_entry.sh", "ds_3d_llama2_entry.sh", "bayes_opt_sg_llama2_entry.sh"])
def test_a_bad_boolean_is_an_error_naming_the_variable(tmp_path, entry):
    env = {k: v for k, v in os.environ.items() if k not in ENTRY_VARS}
    env.update(NPROC_PER_NODE="1", USE_FP8="maybe", PYTHON="/bin/false")
    out = subprocess.run(["bash", str(EXAMPLES / entry)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "USE_FP8=maybe; expected 1 or 0" in out.stderr


# -- shared helpers ------------------------------------------------------------------------------


def args_for(tmp_path, *argv):
    args = fsdp_llama2.build_parser().parse_args(["--output_dir", str(tmp_path), *argv])
    eu.validate_common_args(args)
    return args


def test_argument_mistakes_are_usage_errors_with_the_values(tmp_path):
    with pytest.raises(eu.UsageError, match="--block_size=0 must be >= 1"):
        args_for(tmp_path, "--block_size", "0")
    with pytest.raises(eu.UsageError, match="--block_size=1 \\(BLOCK_SIZE\\) must be >= 2: a sample of one token has no "
                                            "next token to predict"):
        args_for(tmp_path, "--block_size", "1")
    with pytest.raises(eu.UsageError, match="not both"):
        args_for(tmp_path, "--model_name_or_path", "/a", "--config_name", "/b")
    with pytest.raises(eu.UsageError, match="--tokenizer_name='/t' needs --config_name"):
        args_for(tmp_path, "--tokenizer_name", "/t")
    with pytest.raises(eu.UsageError, match="--model_name_or_path\\)=.*missing' does not exist"):
        args_for(tmp_path, "--model_name_or_path", str(tmp_path / "missing"))


def test_fp8_on_cpu_is_refused_before_any_work():
    if torch.cuda.is_available():
        pytest.skip("this machine may run fp8; the CPU refusal is what is tested here")
    eu.check_fp8_supported(False)
    with pytest.raises(eu.UsageError, match="USE_FP8=1 .*compute capability >= 8.9.*device 'cpu'"):
        eu.check_fp8_supported(True)


def test_dataset_path_missing_falls_back_wrong_is_an_error(tmp_path, caplog):
    from atorch.testing.assets import load_tokenizer

    tokenizer = load_tokenizer()
    with pytest.raises(eu.UsageError, match=r"DATASET_PATH \(--dataset_path\) '.*nope.jsonl' does not exist"):
        eu.tokenized_corpus(args_for(tmp_path, "--dataset_path", str(tmp_path / "nope.jsonl")), tokenizer)
    with caplog.at_level("WARNING"):
        prefix, source = eu.tokenized_corpus(args_for(tmp_path), tokenizer)
    assert "not set: training on the bundled corpus" in caplog.text
    assert source.endswith("corpus.txt")
    assert Path(prefix + ".bin").is_file() and Path(prefix).parent == tmp_path / "data_cache"
    # Cached: a second call tokenizes nothing and returns the same files.
    mtime = Path(prefix + ".bin").stat().st_mtime_ns
    assert eu.tokenized_corpus(args_for(tmp_path), tokenizer)[0] == prefix
    assert Path(prefix + ".bin").stat().st_mtime_ns == mtime
    # A preprocessed prefix is used as is; a changed corpus gets a new cache entry.
    assert eu.tokenized_corpus(args_for(tmp_path, "--dataset_path", prefix + ".bin"), tokenizer)[0] == prefix
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    first, _ = eu.tokenized_corpus(args_for(tmp_path, "--dataset_path", str(corpus)), tokenizer)
    corpus.write_text(corpus.read_text() + json.dumps({"text": "one more"}) + "\n")
    assert eu.tokenized_corpus(args_for(tmp_path, "--dataset_path", str(corpus)), tokenizer)[0] != first


def test_a_corpus_smaller_than_one_batch_is_a_usage_error(tmp_path):
    from atorch.testing.assets import load_tokenizer

    corpus = tmp_path / "small.txt"
    corpus.write_text("a short document\n")
    with pytest.raises(eu.UsageError, match="max_seq_length=64 is larger than split"):
        eu.load_train_dataset(args_for(tmp_path, "--dataset_path", str(corpus), "--block_size", "64"),
                              load_tokenizer(), global_batch_size=8, vocab_size=1024)


def test_a_preprocessed_corpus_with_ids_outside_the_models_vocabulary_is_a_usage_error(tmp_path):
    """It loaded, then every rank failed inside the embedding ("index out of range"; a device assert on GPUs)."""
    import numpy as np

    from atorch.data import IndexedDatasetWriter
    from atorch.testing.assets import load_tokenizer

    with IndexedDatasetWriter(tmp_path / "big", np.uint16) as writer:
        for start in range(0, 400, 40):
            writer.add_sequence(np.arange(start, start + 40) * 12)    # ids up to 4788
    for given in ("big", "big.bin"):
        args = args_for(tmp_path, "--dataset_path", str(tmp_path / given), "--block_size", "8")
        with pytest.raises(eu.UsageError, match=r"'.*big\.bin' holds token id 4788, but the model's vocab_size is "
                                                "1024"):
            eu.load_train_dataset(args, load_tokenizer(), global_batch_size=2, vocab_size=1024)
    assert len(eu.load_train_dataset(args, load_tokenizer(), global_batch_size=2, vocab_size=4789)) == 50


@pytest.mark.parametrize("files, given, message", [
    ({"emptydir/": ""}, "emptydir", "'.*emptydir': corpus directory .* has no .txt/.jsonl/.json files"),
    ({"array.json": '[{"text": "a"}]'}, "array.json", "'.*array.json': .*holds a JSON array"),
    ({"x.bin": "ab"}, "x.bin", r"'.*x.bin': '.*x.idx' is missing next to '.*x.bin'"),
    ({"x.bin": "ab"}, "x", r"'.*x': '.*x.idx' is missing next to '.*x.bin'"),
    ({"x.idx": "ab"}, "x.idx", r"'.*x.idx': '.*x.bin' is missing next to '.*x.idx'"),
])
def test_a_corpus_of_the_wrong_shape_is_a_usage_error(tmp_path, files, given, message):
    """A ValueError (a traceback on every rank, exit 1) before; `x.bin` without `x.idx` did not say the .idx
    was missing, and the prefix `x` was said not to exist."""
    from atorch.testing.assets import load_tokenizer

    for name, text in files.items():
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text(text)
    args = args_for(tmp_path / "run", "--dataset_path", str(tmp_path / given))
    with pytest.raises(eu.UsageError, match=r"DATASET_PATH \(--dataset_path\) " + message):
        eu.tokenized_corpus(args, load_tokenizer())


def test_warmup_cosine_schedule():
    f = eu.WarmupCosine(warmup=2, total=10, floor=0.1)
    assert [round(f(s), 4) for s in (0, 1)] == [round(1 / 3, 4), round(2 / 3, 4)]
    assert f(2) == 1.0 and f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)


def test_batch_stream_counts_epochs_and_batches():
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2, drop_last=True)
    stream = eu.BatchStream(loader)
    seen = [next(stream).tolist() for _ in range(5)]
    assert seen == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert (stream.epoch, stream.batches_in_epoch) == (2, 1)
    with pytest.raises(RuntimeError, match="yields no batch"):
        next(eu.BatchStream(torch.utils.data.DataLoader([], batch_size=2)))


def test_parameter_counts_are_elements_all_three():
    """`params: total=... trainable=... trainable_non_lora=...`: the last counted tensors (21) next to two
    counts of elements (213312)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)
    assert eu.parameter_counts(model) == {"total": 15 + 8, "trainable": 15 + 2, "trainable_non_lora": 15 + 2}


@pytest.mark.parametrize("name, value, said", [
    ("BO_SG_MAX_IETR", "0", "BO_SG_MAX_IETR"),
    ("ATORCH_DRYRUN_MAX_STEPS", "0", "ATORCH_DRYRUN_MAX_STEPS"),
    ("ATORCH_DRYRUN_TIMEOUT", "0", "ATORCH_DRYRUN_TIMEOUT"),
    ("ATORCH_DRYRUN_TARGET_CI", "-1", "ATORCH_DRYRUN_TARGET_CI"),
])
def test_the_search_examples_settings_are_usage_errors_before_the_model_loads(monkeypatch, name, value, said):
    """The search and dry-run variables are read inside auto_accelerate, after the model and data load: a bad
    value is a usage error first (it was a traceback on every rank after the loads, exit 1)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(eu.UsageError, match=said):
        bayes_opt_sg_llama2.check_search_settings()
