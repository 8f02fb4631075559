"""The Llama 2 entry scripts, run as a user runs them: tiny defaults, bundled corpus, CPU processes, gloo.

Each run prints one metrics line per step (LOG_STEPS=1); the tests parse them. Runs are few
and short (a launch costs 10-30 s on the 2-core CI machine), each checked for several things.
"""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from atorch.distributed import find_free_port
from atorch.testing.spawn import QUIET_ENV
from atorch.utils.metrics import parse_metrics_line

pytestmark = [pytest.mark.heavy, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "llama2"
ENTRY_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DATASET_PATH",
              "MODEL_NAME_OR_PATH", "CONFIG_NAME", "TOKENIZER_NAME", "PER_DEVICE_TRAIN_BATCH_SIZE", "BLOCK_SIZE",
              "MAX_STEPS", "LEARNING_RATE", "PEAK_TFLOPS", "LOG_STEPS", "SAVE_STEPS", "RESUME", "USE_LORA", "USE_FP8",
              "PIPELINE_PARALLEL_SIZE", "MODEL_PARALLEL_SIZE", "MICRO_BATCH_SIZE", "ACCU_STEPS", "BO_SG_MAX_IETR",
              "RANDOM_SAMPLE", "OUTPUT_DIR")
# Small enough for 2 cores, large enough that 20 steps visibly learn the corpus.
TINY = {"BLOCK_SIZE": 64, "PER_DEVICE_TRAIN_BATCH_SIZE": 4, "LOG_STEPS": 1, "NPROC_PER_NODE": 2}
RUN_TIMEOUT_S = 420


def entry_env(**env_vars) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENTRY_VARS}
    env.update(QUIET_ENV)
    env["PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({k: str(v) for k, v in env_vars.items()})
    return env


def start(entry: str, **env_vars) -> subprocess.Popen:
    # A session of its own, so a timeout kills the launcher and every worker it started.
    return subprocess.Popen(["bash", str(EXAMPLES / entry)], cwd=REPO, env=entry_env(**env_vars),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout} s\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n"
                    f"{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(entry: str, **env_vars) -> subprocess.CompletedProcess:
    return finish(start(entry, **env_vars))


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"exit {out.returncode}\n--- stdout ---\n{out.stdout[-6000:]}\n--- stderr ---\n" \
                                f"{out.stderr[-6000:]}"
    return out.stdout


def metrics_lines(stdout: str) -> List[Dict[str, float]]:
    return [m for m in map(parse_metrics_line, stdout.splitlines()) if m is not None]


def line_with(stdout: str, prefix: str) -> str:
    found = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert found, f"no line starting with {prefix!r} in:\n{stdout[-4000:]}"
    return found[0]


def fields(line: str) -> Dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def check_learns(metrics: List[Dict[str, float]], steps: int, world_size: int, block_size: int = 64) -> None:
    """One parseable line per step 1..steps, sane throughput, and a loss that falls."""
    assert [int(m["step"]) for m in metrics] == list(range(1, steps + 1)), metrics
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["step_s"] > 0 and m["samples_s"] > 0 and m["tflops_model"] > 0 and m["peak_mem_mb"] > 0, m
        assert m["mfu"] > 0 and m["hfu"] >= m["mfu"], m
        # tokens/s per device = samples/s x block / devices (both printed rounded: 1% slack)
        assert m["tokens_s_per_device"] == pytest.approx(m["samples_s"] * block_size / world_size, rel=1e-2)
    losses = [m["loss"] for m in metrics]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # The tiny model starts at ~ln(1024) = 6.93; 20 steps on the bundled corpus bring it near 4.7.
    assert last < 0.9 * first, f"loss did not fall: first 5 mean {first:.4f}, last 5 mean {last:.4f}: {losses}"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """20 steps of the FSDP example, checkpoints at 10 and 20."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    out = run("fsdp_llama2_entry.sh", OUTPUT_DIR=out_dir, MAX_STEPS=20, SAVE_STEPS=10, **TINY)
    return out_dir, out


def test_fsdp_example_learns_and_reports_metrics(fsdp_run):
    out_dir, out = fsdp_run
    stdout = ok(out)
    check_learns(metrics_lines(stdout), steps=20, world_size=2)
    assert fields(line_with(stdout, "launch:"))["world_size"] == "2"
    assert "not set: training on the bundled corpus" in out.stderr
    assert "strategy ['parallel_mode', 'checkpoint', ('amp_native', {'dtype': 'bf16'}), 'fsdp']" in stdout
    header = line_with(stdout, "metrics:")
    assert "measured CPU matmul peak" in header and "process RSS high-water mark" in header
    # Activation checkpointing recomputes the forward: hardware FLOPs exceed model FLOPs.
    assert all(m["hfu"] > m["mfu"] for m in metrics_lines(stdout))
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step_20"
    assert (out_dir / "checkpoints" / "step_10" / "manifest.json").is_file()


def test_fsdp_example_resumes_where_it_stopped(fsdp_run, tmp_path):
    out_dir, first = fsdp_run
    uninterrupted = {int(m["step"]): m["loss"] for m in metrics_lines(ok(first))}
    out = run("fsdp_llama2_entry.sh", OUTPUT_DIR=tmp_path, MAX_STEPS=20, SAVE_STEPS=0,
              RESUME=out_dir / "checkpoints" / "step_10", **TINY)
    stdout = ok(out)
    assert "resume: loaded" in stdout and "at step 10 (data: epoch 0, 10 loader batches in)" in stdout
    resumed = {int(m["step"]): m["loss"] for m in metrics_lines(stdout)}
    assert sorted(resumed) == list(range(11, 21))
    # Same weights, optimizer state, schedule and batches: the same arithmetic as the uninterrupted
    # run. Losses are printed to 4 decimals; 2e-4 allows a last-digit rounding difference only.
    for step, loss in resumed.items():
        assert abs(loss - uninterrupted[step]) <= 2e-4, (step, loss, uninterrupted[step])


def test_lora_fine_tuning_loads_weights_and_trains_only_adapters(fsdp_run, tmp_path):
    """Export the FSDP run's checkpoint to a Hugging Face dir, then fine-tune it with LoRA on a .jsonl corpus."""
    from atorch.checkpoint import merge_checkpoint
    from atorch.testing.assets import corpus_documents, load_tokenizer

    out_dir, first = fsdp_run
    ok(first)
    model_dir = tmp_path / "model"
    merge_checkpoint(str(out_dir / "checkpoints" / "step_20"), str(model_dir), tokenizer=load_tokenizer())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in corpus_documents()))

    out = run("fsdp_llama2_entry.sh", OUTPUT_DIR=tmp_path / "lora", MAX_STEPS=3, SAVE_STEPS=0, USE_LORA=1,
              MODEL_NAME_OR_PATH=model_dir, DATASET_PATH=corpus, **TINY)
    stdout = ok(out)
    assert f"model: fine-tuning ({model_dir})" in stdout and "'lora'" in stdout
    params = fields(line_with(stdout, "params:"))
    # Rank-8 adapters on q_proj and v_proj (64 -> 64) of 2 layers: 2 x 2 x (64*8 + 8*64) = 4096.
    assert int(params["trainable"]) == 4096 and int(params["trainable_non_lora"]) == 0
    assert int(params["total"]) == 213312 + 4096
    metrics = metrics_lines(stdout)
    assert len(metrics) == 3
    # The pretrained weights were loaded: the loss starts near where the FSDP run ended, far
    # below the ~6.9 of a random init.
    assert metrics[0]["loss"] < 5.5, metrics[0]
    assert f"from {corpus} (tokenized:" in line_with(stdout, "data:")


def test_fsdp_checkpoint_exports_to_a_hugging_face_model(fsdp_run, tmp_path):
    """The README's export step: `merge_checkpoint` of the example's checkpoint, then `from_pretrained`.
    The example records its tokenizer with each checkpoint, so the merge copies it without being told."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atorch.checkpoint import merge_checkpoint
    from atorch.testing.assets import load_tokenizer

    out_dir, first = fsdp_run
    ok(first)
    merge_checkpoint(str(out_dir / "checkpoints" / "step_20"), str(tmp_path / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("hello world")["input_ids"] == load_tokenizer()("hello world")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 213312 and all(
        torch.isfinite(p).all() for p in model.parameters())


def test_fp8_on_cpu_fails_at_start_with_a_clear_message(tmp_path):
    out = run("fsdp_llama2_entry.sh", OUTPUT_DIR=tmp_path, USE_FP8=1, NPROC_PER_NODE=1)
    assert out.returncode != 0
    assert "error: USE_FP8=1 (--use_fp8): fp8 needs an NVIDIA GPU with compute capability >= 8.9" in out.stderr
    assert "Unset USE_FP8" in out.stderr
    assert not metrics_lines(out.stdout) and "data:" not in out.stdout   # nothing loaded or trained


def test_two_launchers_form_one_four_process_job_pretraining_from_a_config(tmp_path):
    """NNODES=2 on one machine: node 0 and node 1 launchers on 127.0.0.1 rendezvous into world size 4."""
    from atorch.testing import tiny_llama_config
    from atorch.testing.assets import load_tokenizer

    config_dir = tmp_path / "config"
    tiny_llama_config().save_pretrained(config_dir)
    load_tokenizer().save_pretrained(tmp_path / "tokenizer")
    common = dict(TINY, NNODES=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=find_free_port(), MAX_STEPS=2,
                  SAVE_STEPS=0, OUTPUT_DIR=tmp_path / "out", CONFIG_NAME=config_dir,
                  TOKENIZER_NAME=tmp_path / "tokenizer")
    nodes = [start("fsdp_llama2_entry.sh", NODE_RANK=r, **common) for r in (0, 1)]
    outs = [finish(p) for p in nodes]
    node0 = ok(outs[0])
    ok(outs[1])
    launch = fields(line_with(node0, "launch:"))
    assert (launch["world_size"], launch["local_world_size"], launch["nodes"]) == ("4", "2", "2")
    assert f"model: pretraining ({config_dir})" in node0
    assert "launch:" not in outs[1].stdout   # rank 0 lives on node 0 only
    metrics = metrics_lines(node0)
    assert [int(m["step"]) for m in metrics] == [1, 2]
    # The global batch spans 4 ranks: 4 per device x 4 = 16 samples a step.
    assert "global batch 16 x 64 tokens" in node0


def test_ds_3d_example_learns_and_resumes_at_another_layout(tmp_path):
    """(tensor 1, pipeline 2, data 2) on 4 CPU processes; its step-10 checkpoint, resumed on 2 processes
    as (1, 2, 1) with micro-batches twice as large (the same global batch), repeats steps 11-13."""
    common = dict(MODEL_PARALLEL_SIZE=1, PIPELINE_PARALLEL_SIZE=2, ACCU_STEPS=2, BLOCK_SIZE=64, LOG_STEPS=1)
    out = run("ds_3d_llama2_entry.sh", OUTPUT_DIR=tmp_path / "a", MAX_STEPS=20, SAVE_STEPS=10, NPROC_PER_NODE=4,
              MICRO_BATCH_SIZE=2, **common)
    stdout = ok(out)
    assert fields(line_with(stdout, "launch:"))["world_size"] == "4"
    assert "layout tensor=1 data=2 pipeline=2" in stdout and "global batch 8 = micro 2 x accu 2 x data 2" in stdout
    check_learns(metrics_lines(stdout), steps=20, world_size=4)
    uninterrupted = {int(m["step"]): m["loss"] for m in metrics_lines(stdout)}

    out = run("ds_3d_llama2_entry.sh", OUTPUT_DIR=tmp_path / "b", MAX_STEPS=13, SAVE_STEPS=0, NPROC_PER_NODE=2,
              MICRO_BATCH_SIZE=4, RESUME=tmp_path / "a" / "checkpoints" / "step_10", **common)
    stdout = ok(out)
    assert "layout tensor=1 data=1 pipeline=2" in stdout and "global batch 8 = micro 4 x accu 2 x data 1" in stdout
    # 10 steps x 2 micro-batches (of 2 x 2 ranks = 4 samples) were consumed: the same 80 samples.
    assert "at step 10 (data: epoch 0, 20 loader batches in)" in stdout
    resumed = {int(m["step"]): m["loss"] for m in metrics_lines(stdout)}
    assert sorted(resumed) == [11, 12, 13]
    # Same weights, optimizer state (resharded from 2 data ranks to 1), schedule and samples. Losses
    # are printed to 4 decimals; 2e-4 allows last-digit rounding and the changed summation order of
    # the data-parallel average.
    for step, loss in resumed.items():
        assert abs(loss - uninterrupted[step]) <= 2e-4, (step, loss, uninterrupted[step])


def test_bayes_search_example_saves_strategy_and_plot_then_learns(tmp_path):
    from atorch.auto import Strategy

    out = run("bayes_opt_sg_llama2_entry.sh", OUTPUT_DIR=tmp_path, MAX_STEPS=20, SAVE_STEPS=0, BO_SG_MAX_IETR=3,
              RANDOM_SAMPLE=2, **TINY)
    stdout = ok(out)
    check_learns(metrics_lines(stdout), steps=20, world_size=2)
    best = Strategy.load(str(tmp_path / "best_strategy.json"))
    assert best.describe() in line_with(stdout, "search: best strategy")
    assert (tmp_path / "search" / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "search" / "trials.csv").is_file()
