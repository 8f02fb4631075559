"""Faults survived: a worker killed mid-training, a whole job killed mid-save, a lost node.

- `--fault_tolerant --max_restarts 1`: kill -9 one worker of the FSDP example after step K; the agent
  restarts the group, the example resumes from the latest checkpoint (weights, optimizer, RNG, data
  position) and the final weights are bitwise equal to an uninterrupted run with the same seed. Bitwise,
  because the same world size on gloo reduces in the same order and every bit of state is restored.
- Every rank SIGKILLed inside a save (shards written, no manifest): the previous checkpoint loads,
  `latest` names it, the partial directory is ignored and the next save removes it.
- Two launchers on 127.0.0.1 as two nodes, node 1 killed: node 0 exits non-zero within the bound,
  its workers naming the collective that failed and the lost node's ranks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from atorch.checkpoint.layout_handlers import MODEL_PREFIX
from atorch.distributed import find_free_port
from atorch.testing import DistributedTestError, run_distributed, tiny_llama
from atorch.testing.spawn import QUIET_ENV

pytestmark = [pytest.mark.heavy, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llama2" / "fsdp_llama2.py"
RUN_TIMEOUT_S = 480
STEPS, SAVE_EVERY, KILL_AFTER = 6, 2, 3


def _env() -> Dict[str, str]:
    env = dict(os.environ, **QUIET_ENV)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _example_cmd(out_dir: Path, *launcher_args: str) -> List[str]:
    return [sys.executable, "-m", "atorch.distributed.run", *launcher_args, "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()), str(EXAMPLE),
            "--output_dir", str(out_dir), "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY),
            "--save_total_limit", "10", "--block_size", "64", "--per_device_train_batch_size", "2",
            "--log_steps", "1", "--resume"]


def _children(pid: int) -> List[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and its workers (torch elastic starts each worker in a session of its own)."""
    for child in _children(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _final_weights(out_dir: Path) -> Dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ckpt = out_dir / "checkpoints" / f"step_{STEPS}" / "dcp"
    with warnings.catch_warnings():   # one process reading the whole checkpoint is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        state = _load_state_dict_from_keys(checkpoint_id=str(ckpt))
    return {k: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def _run_killing_one_worker(out_dir: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(_example_cmd(out_dir, "--fault_tolerant", "--max_restarts", "1"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: List[str] = []
    killed = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if killed is None and re.search(rf"\bstep[ =:]+{KILL_AFTER}\b", line) and "resume" not in line:
            workers = sorted(_children(proc.pid))
            assert len(workers) == 2, f"launcher children {workers}"
            killed = workers[-1]
            os.kill(killed, signal.SIGKILL)
        if time.monotonic() > deadline:
            _kill_tree(proc.pid)
            pytest.fail("the fault-tolerant run did not finish:\n" + "".join(lines[-60:]))
    proc.wait(timeout=60)
    assert killed is not None, "never saw step %d:\n%s" % (KILL_AFTER, "".join(lines[-60:]))
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), "")


def test_killed_worker_restarts_and_resumes_to_the_same_weights(tmp_path):
    reference = subprocess.run(_example_cmd(tmp_path / "a"), cwd=REPO, env=_env(), capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    out = _run_killing_one_worker(tmp_path / "b")
    assert out.returncode == 0, out.stdout[-4000:]
    # The second attempt resumed from the last checkpoint written before the kill, data position included.
    resumed = re.findall(r"resume: loaded (\S+) at step (\d+) \(data: epoch (\d+), (\d+) loader batches in\)",
                         out.stdout)
    assert resumed, out.stdout[-4000:]
    path, step, _, batches = resumed[-1]
    assert int(step) in (KILL_AFTER - KILL_AFTER % SAVE_EVERY, KILL_AFTER - KILL_AFTER % SAVE_EVERY + SAVE_EVERY)
    assert int(batches) == int(step) and path.endswith(f"step_{step}")

    expected, got = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert sorted(expected) == sorted(got) and len(expected) > 10
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def _save_then_all_die(root: str) -> None:
    from atorch.auto import auto_accelerate, train_step
    from atorch.checkpoint import save_checkpoint
    from atorch.checkpoint import save_load
    from atorch.testing.parity import TokenDataset

    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode", "fsdp"])
    assert status
    batches = iter(result.dataloader)
    train_step(result, next(batches))
    save_checkpoint(result, os.path.join(root, "step_1"), step=1)
    train_step(result, next(batches))

    def everyone_dies(staging: str) -> None:
        dist.barrier()   # every rank has written its shards and RNG file
        os.kill(os.getpid(), signal.SIGKILL)

    save_load._before_commit_hook = everyone_dies
    save_checkpoint(result, os.path.join(root, "step_2"), step=2)


def _resume_and_save(root: str) -> Dict[str, object]:
    from atorch.auto import auto_accelerate
    from atorch.checkpoint import load_checkpoint, save_checkpoint
    from atorch.testing.parity import TokenDataset

    status, result, _ = auto_accelerate(
        tiny_llama(seed=1), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode", "fsdp"])
    assert status
    state = load_checkpoint(result, root)
    path = save_checkpoint(result, os.path.join(root, "step_2"), step=2)
    return {"loaded": state.path, "step": state.step, "batches": state.data_position.batches_in_epoch,
            "saved": path}


def test_whole_job_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    from atorch.checkpoint import manifest as mf

    root = str(tmp_path)
    with pytest.raises(DistributedTestError, match="exited with code -9"):
        run_distributed(_save_then_all_die, 2, root, timeout=240)
    partial = [e for e in os.listdir(root) if e.startswith("step_2" + mf.STAGING_MARK)]
    assert len(partial) == 1 and not os.path.exists(os.path.join(root, "step_2"))
    assert mf.read_latest(root) == os.path.join(root, "step_1")
    assert [os.path.basename(p) for p, _ in mf.list_checkpoints(root)] == ["step_1"]

    # A new job resumes from `latest` (step 1, data position 1 batch in) and its next save cleans up.
    results = run_distributed(_resume_and_save, 2, root, timeout=240)
    assert all(r["loaded"] == os.path.join(root, "step_1") and r["step"] == 1 and r["batches"] == 1 for r in results)
    assert not [e for e in os.listdir(root) if mf.STAGING_MARK in e]
    assert mf.read_latest(root) == os.path.join(root, "step_2")


NODE_SCRIPT = """
import os, time, torch, torch.distributed as dist, atorch
atorch.init_distributed("gloo")
t = torch.ones(4)
for step in range(10_000):
    dist.all_reduce(t)
    if step == 5 and dist.get_rank() == 0:
        print("training", flush=True)
    time.sleep(0.05)
"""


def test_two_launchers_one_node_killed_the_other_fails_naming_the_lost_node(tmp_path):
    script = tmp_path / "node_job.py"
    script.write_text(NODE_SCRIPT)
    port = find_free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "atorch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    node0 = procs[0]
    assert node0.stdout is not None
    lines = []
    for line in node0.stdout:
        lines.append(line)
        if "training" in line:
            break
    start = time.monotonic()
    _kill_tree(procs[1].pid)      # node 1 is lost: its launcher and its worker (a session of its own)
    procs[1].wait(timeout=30)
    try:
        rest, _ = node0.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        _kill_tree(node0.pid)
        pytest.fail("node 0 did not exit after node 1 was killed:\n" + "".join(lines))
    elapsed = time.monotonic() - start
    log = "".join(lines) + rest
    assert node0.returncode != 0, log[-3000:]
    assert "CollectiveTimeoutError: rank 0: collective gloo:all_reduce" in log, log[-3000:]
    assert re.search(r"rank\(s\) \[1\] did not arrive \(node 1 \([^)]*\): ranks \[1\]\)", log), log[-3000:]
    assert elapsed < 150, f"node 0 took {elapsed:.0f} s to fail"
