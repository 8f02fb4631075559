"""Launches under a real Slurm: `srun -N1 -n2 python`, an `sbatch` of examples/slurm/, a launcher per node.

A one-node cluster of this machine (scripts/slurm_local.sh: munged, slurmctld and slurmd on
127.0.0.1) and a two-node one (two slurmd daemons posing as nodes) are started for this module,
each in a directory and on ports of its own, and stopped after it. Skipped when `srun` is not on
PATH (Debian: apt-get install slurm-wlm munge) or a cluster cannot start (the reason says why);
with ATORCH_REQUIRE_SLURM=1 (set by .ci/run when it could install Slurm) a cluster that does not
start fails instead.

Every run trains the tiny Llama with DDP for 3 steps on 2 ranks (examples/slurm/train.py); each
rank writes what it was told and what it computed. Checked: distinct ranks 0 and 1 of a world of 2,
the same rendezvous, identical losses and trained weights on both ranks, and the same losses as
plain single-process training on the same global batches (fp32: rel 1e-5, the DDP parity tolerance).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from atorch.distributed import find_free_port
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

pytestmark = [pytest.mark.heavy, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
TRAIN = REPO / "examples" / "slurm" / "train.py"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS, GLOBAL_BATCH = 3, 8
RUN_TIMEOUT_S = 300
# Variables of an enclosing job or launcher must not leak into the jobs started here.
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


def _cluster(nodes: int) -> Iterator[Dict[str, str]]:
    """The environment for srun/sbatch against a cluster of `nodes` nodes of its own, stopped afterwards."""
    if shutil.which("srun") is None:
        pytest.skip("srun is not on PATH: no Slurm to test against (Debian: apt-get install slurm-wlm munge)")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the Slurm tests run 2 tasks on a core each: this machine has 1 CPU")
    # Short path: munge's unix socket lives under it (108-byte limit).
    cluster_dir = tempfile.mkdtemp(prefix="atorch-slurm-", dir="/tmp")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "TORCHELASTIC_")) and k not in _LEAKY}
    env.update({"ATORCH_SLURM_DIR": cluster_dir, "ATORCH_SLURM_NODES": str(nodes),
                "ATORCH_SLURM_TIMEOUT": "60", "SLURM_CONF": os.path.join(cluster_dir, "slurm.conf"),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"})
    try:
        for _ in range(2):   # a port found free may be taken before slurmctld binds it: then once more
            env["ATORCH_SLURM_CTLD_PORT"], env["ATORCH_SLURM_SLURMD_PORT"] = map(str, _two_free_ports())
            started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True,
                                     timeout=180)
            if started.returncode == 0:
                break
            print(f"scripts/slurm_local.sh start failed; retrying on other ports:\n{started.stderr[-2000:]}")
            subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        if started.returncode != 0:
            reason = f"the local Slurm cluster ({nodes} node(s)) did not start:\n{started.stderr[-3000:]}"
            if os.environ.get("ATORCH_REQUIRE_SLURM") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


def _two_free_ports() -> Tuple[int, int]:
    """slurmctld's port and a base port p with p and p + 1 free (slurmd of node i listens on p + i)."""
    for _ in range(50):
        ctld, base = find_free_port(), find_free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        if ctld not in (base, base + 1):
            return ctld, base
    raise RuntimeError("no two consecutive free ports for the local Slurm cluster")


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[Dict[str, str]]:
    yield from _cluster(1)


@pytest.fixture(scope="module")
def slurm_two_nodes_env() -> Iterator[Dict[str, str]]:
    yield from _cluster(2)


def _run(cmd: List[str], env: Dict[str, str], job_name: str) -> subprocess.CompletedProcess:
    """Run a Slurm client command; on a timeout cancel the job so no task outlives the test."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", job_name], env=env, timeout=60)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish in {RUN_TIMEOUT_S} s\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n"
                    f"{err[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited with {proc.returncode}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n"
                    f"{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED")


def _sbatch(args: List[str], env: Dict[str, str], job_name: str, log: Path) -> None:
    """Submit a batch job and wait for it, as `sbatch --wait` does but polling every 0.5 s.

    (`sbatch --wait` of Slurm 22.05 sleeps 2, 4, 8, ... 32 s between its polls: measured here, a
    12 s job returned after 42 s.) Fails the test with the job's log unless it COMPLETED with exit code 0.
    """
    job_id = _run(["sbatch", "--parsable", f"--job-name={job_name}", f"--output={log}", *args], env,
                  job_name).stdout.strip().split(";")[0]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    state = exit_code = ""
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                               timeout=60).stdout
        state = (re.findall(r"\bJobState=(\S+)", shown) or [""])[0]
        exit_code = (re.findall(r"\bExitCode=(\S+)", shown) or [""])[0]
        if state in _DONE_STATES:
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job_id], env=env, timeout=60)
    text = log.read_text() if log.exists() else "(no log)"
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"batch job {job_id}: {state} {exit_code}\n{text[-4000:]}"


def _job_name() -> str:
    return f"atorch-test-{uuid.uuid4().hex[:8]}"


def _ranks(out_dir: Path) -> List[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], f"rank files in {out_dir}: {files}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def expected_losses() -> List[float]:
    return reference_losses(tiny_llama(seed=0), global_batches(TokenDataset(), GLOBAL_BATCH, STEPS))


def _check_two_ranks(records: List[dict], expected: List[float], what: str, local_ranks=(0, 1)) -> None:
    assert [r["rank"] for r in records] == [0, 1], what
    assert [r["world_size"] for r in records] == [2, 2], what
    assert tuple(r["local_rank"] for r in records) == local_ranks, what
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"], what
    assert records[0]["env"]["MASTER_ADDR"] == records[1]["env"]["MASTER_ADDR"], what
    # DDP: the ranks' global losses and their trained weights are the same, bit for bit.
    assert records[0]["global_losses"] == records[1]["global_losses"], what
    assert records[0]["weights_checksum"] == records[1]["weights_checksum"], what
    assert records[0]["local_losses"] != records[1]["local_losses"], f"{what}: both ranks saw the same half-batch"
    assert_close_losses(records[0]["global_losses"], expected, rel=1e-5, what=what)


def test_srun_two_tasks_train_as_two_ranks(slurm_env, expected_losses, tmp_path):
    name = _job_name()
    _run(["srun", "-N1", "-n2", "--kill-on-bad-exit=1", "--time=10", f"--job-name={name}", sys.executable,
          str(TRAIN), "--steps", str(STEPS), "--global_batch", str(GLOBAL_BATCH), "--out", str(tmp_path)],
         slurm_env, name)
    records = _ranks(tmp_path)
    _check_two_ranks(records, expected_losses, "srun -n2")
    for r in records:   # the rank is Slurm's task id, the rendezvous host the step's (only) node
        assert r["env"]["SLURM_PROCID"] == str(r["rank"])
        assert r["env"]["MASTER_ADDR"] == r["host"]
    # Slurm binds each task to CPUs of its own (task/affinity): the two ranks never share a core.
    assert not set(records[0]["cpus"]) & set(records[1]["cpus"]), [r["cpus"] for r in records]


def test_sbatch_example(slurm_env, expected_losses, tmp_path):
    name = _job_name()
    log = tmp_path / "job.out"
    env = {**slurm_env, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "ranks"), "STEPS": str(STEPS)}
    _sbatch([str(SBATCH)], env, name, log)
    records = _ranks(tmp_path / "ranks")
    _check_two_ranks(records, expected_losses, "sbatch examples/slurm/train.sbatch")
    text = log.read_text()
    assert "2 tasks on" in text and f"done: 2 ranks, {STEPS} steps" in text, text


def test_launcher_per_node_of_a_two_node_step(slurm_two_nodes_env, expected_losses, tmp_path):
    # srun -N2 --ntasks-per-node=1 atorch run: each node's launcher takes --nnodes, --node_rank and the
    # rendezvous (the step's first node) from the step, and starts that node's worker.
    name = _job_name()
    done = _run(["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--time=10", f"--job-name={name}",
                 sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "1", str(TRAIN), "--steps",
                 str(STEPS), "--global_batch", str(GLOBAL_BATCH), "--out", str(tmp_path)], slurm_two_nodes_env, name)
    records = _ranks(tmp_path)
    _check_two_ranks(records, expected_losses, "srun -N2 --ntasks-per-node=1 atorch.distributed.run", (0, 0))
    # Both "nodes" are this machine, named <host> and <host>-2 by scripts/slurm_local.sh.
    placements = sorted(re.findall(r"--nnodes=2 --node_rank=(\d) --master_addr=(\S+) --master_port=(\d+)",
                                   done.stderr))
    assert [p[0] for p in placements] == ["0", "1"], done.stderr
    assert placements[0][1:] == placements[1][1:] and "-2" not in placements[0][1], placements


def test_launcher_in_a_one_cpu_task_warns_that_its_workers_share_the_cpu(slurm_env, tmp_path):
    # srun -n1 gives the task one CPU and Slurm binds it there: both workers of the launcher inherit that one
    # core. The launcher says so (and how to ask for more); with -c2 the workers get both cores, no warning.
    script = tmp_path / "where.py"
    # One write(2) per worker: both share the launcher's stdout, and print() may split a line (seen: 1 run in 5).
    script.write_text("import os\nos.write(1, f\"worker {os.environ['RANK']} {sorted(os.sched_getaffinity(0))}\\n\""
                      ".encode())\n")
    name = _job_name()
    launch = [sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "2", str(script)]
    one = _run(["srun", "-n1", "--time=5", f"--job-name={name}", *launch], slurm_env, name)
    cpus = set(re.findall(r"worker [01] (\[\d+\])", one.stdout))
    assert len(cpus) == 1, one.stdout                       # the same single CPU for both workers
    assert "may use 1 CPU(s) but the launcher starts 2 workers" in one.stderr and "--cpus-per-task=2" in one.stderr
    two = _run(["srun", "-n1", "-c2", "--time=5", f"--job-name={name}", *launch], slurm_env, name)
    assert "worker 0 [0, 1]" in two.stdout and "worker 1 [0, 1]" in two.stdout, two.stdout
    assert "may use" not in two.stderr, two.stderr


def test_a_batch_script_alone_is_a_world_of_one(slurm_env, tmp_path):
    # The batch script of a 2-task job has SLURM_PROCID=0 and SLURM_NTASKS=2 but no step: not rank 0 of 2
    # (that would wait for a rank 1 that never starts), a world of one with a warning naming srun.
    name = _job_name()
    script = tmp_path / "alone.sbatch"
    script.write_text("#!/bin/bash\n" f'"{sys.executable}" -c "import atorch; atorch.init_distributed(\'gloo\'); '
                      'print(\'world\', atorch.world_size(), \'rank\', atorch.rank())"\n')
    log = tmp_path / "job.out"
    _sbatch(["--ntasks=2", str(script)], slurm_env, name, log)
    text = log.read_text()
    assert "world 1 rank 0" in text, text
    assert "outside an srun step" in text, text
