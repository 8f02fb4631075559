"""The launcher runs a 2-process script and, with --fault_tolerant, restarts a failed one."""

import os
import subprocess
import sys
import textwrap

from atorch.distributed import find_free_port

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, atorch
    atorch.init_distributed("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    marker = sys.argv[1]
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()} attempt {attempt}", flush=True)
    if os.environ.get("FAIL_FIRST") and attempt == 0 and dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()
    open(f"{marker}.{dist.get_rank()}", "w").write(str(attempt))
    dist.destroy_process_group()
""")


def _launch(tmp_path, *extra, env_extra=None):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, **(env_extra or {}))
    cmd = [sys.executable, "-m", "atorch.distributed.run", *extra, "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()),
           str(script), str(tmp_path / "done")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_launcher_runs_two_processes(tmp_path):
    out = _launch(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sum 3.0" in out.stdout
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.0", "done.1"]


def test_fault_tolerant_restarts_after_failure(tmp_path):
    out = _launch(tmp_path, "--fault_tolerant", "--max_restarts", "1", env_extra={"FAIL_FIRST": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "attempt 1" in out.stdout
    assert (tmp_path / "done.0").read_text() == "1"


def test_without_fault_tolerance_a_failure_fails_the_job(tmp_path):
    out = _launch(tmp_path, env_extra={"FAIL_FIRST": "1"})
    assert out.returncode != 0
    assert not (tmp_path / "done.0").exists()
