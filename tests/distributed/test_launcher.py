"""The launcher runs a 2-process script and, with --fault_tolerant, restarts a failed one; what it does when a
port is taken, a node never arrives, a worker fails, or the script is not Python."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

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
    # On a node range of which one node came (c10d; the static rendezvous waited for the 2nd node until the
    # join timeout failed it): it starts once no other node joined for the last call, within ATORCH_INIT_TIMEOUT.
    out = _launch(tmp_path, "--nnodes", "1:2", env_extra={"ATORCH_INIT_TIMEOUT": "6"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "for 1 to 2 nodes at 127.0.0.1:" in out.stderr and "no other joined for 3 s" in out.stderr, out.stderr
    assert "sum 3.0" in out.stdout
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.0", "done.1"]


def test_fault_tolerant_restarts_after_failure(tmp_path):
    out = _launch(tmp_path, "--fault_tolerant", "--max_restarts", "1", env_extra={"FAIL_FIRST": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "attempt 1" in out.stdout
    assert (tmp_path / "done.0").read_text() == "1"


def test_without_fault_tolerance_a_failure_fails_the_job(tmp_path):
    out = _launch(tmp_path, env_extra={"FAIL_FIRST": "1"})
    assert out.returncode == 3, out.stderr[-3000:]        # the failed worker's exit code (was always 1)
    assert "worker rank 1 (local rank 1, pid " in out.stderr and "failed with exit code 3" in out.stderr
    assert not (tmp_path / "done.0").exists()


# -- what the launcher does when something is wrong around the job ------------------------------------------

def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
                                                             "LOCAL_RANK", "ATORCH_INIT_TIMEOUT")}
    return dict(env, **extra)


def _run(args, timeout=60, env=None, module="atorch.distributed.run"):
    """Run a launcher; a launcher that has not exited after `timeout` s fails the test (it used to hang)."""
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                             timeout=timeout, env=env or _env())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module} {args} did not exit within {timeout} s: {e.stderr!r}"[-3000:])
    return out, time.monotonic() - start


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def listening_port():
    """A port held by something that is not a rendezvous store (the launcher used to hang on it for good)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def test_fault_tolerant_with_a_taken_port_fails_at_once(tmp_path, listening_port):
    script = _write(tmp_path, "ok.py", "print('ran')\n")
    out, took = _run(["--fault_tolerant", "--master_port", str(listening_port), "--nproc_per_node", "1", script],
                     timeout=30)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"port {listening_port} of the rendezvous at 127.0.0.1:{listening_port} is already in use" in out.stderr
    assert "ran" not in out.stdout and "Traceback" not in out.stderr and took < 25


def test_second_fault_tolerant_job_on_a_port_never_joins_the_first(tmp_path):
    """Job B on job A's port fails at once; A runs on undisturbed (B used to join A's rendezvous `atorch-<port>`)."""
    gate = tmp_path / "gate"
    job_a = _write(tmp_path, "a.py", f"""
        import os, pathlib, sys, time
        print("A started, restart", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
        deadline = time.time() + 60
        while not pathlib.Path({str(gate)!r}).exists() and time.time() < deadline:
            time.sleep(0.1)
        sys.exit(0 if pathlib.Path({str(gate)!r}).exists() else 5)
    """)
    job_b = _write(tmp_path, "b.py", "print('B ran')\n")
    from atorch.distributed import find_free_port

    port = str(find_free_port())
    a = subprocess.Popen([sys.executable, "-m", "atorch.distributed.run", "--fault_tolerant", "--master_port", port,
                          "--nproc_per_node", "1", job_a], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=_env())
    try:
        assert a.stdout is not None
        lines = []
        for line in a.stdout:            # until A's worker runs: A's store is up
            lines.append(line)
            if "A started" in line:
                break
        out, _ = _run(["--fault_tolerant", "--master_port", port, "--nproc_per_node", "1", job_b], timeout=30)
        assert out.returncode == 1 and f"port {port} of the rendezvous" in out.stderr, out.stderr[-3000:]
        assert "B ran" not in out.stdout
        gate.write_text("")
        rest, _ = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    log = "".join(lines) + rest
    assert a.returncode == 0, log[-3000:]
    assert "A started, restart 0" in log and "restart 1" not in log, log[-3000:]


@pytest.mark.parametrize("mode", [[], ["--fault_tolerant"]], ids=["static", "fault_tolerant"])
def test_a_node_that_never_arrives_fails_after_atorch_init_timeout(tmp_path, mode):
    from atorch.distributed import find_free_port

    script = _write(tmp_path, "ok.py", "print('ran')\n")
    port = find_free_port()
    out, took = _run([*mode, "--nnodes", "2", "--node_rank", "0", "--master_port", str(port), "--nproc_per_node",
                      "1", script], timeout=40, env=_env(ATORCH_INIT_TIMEOUT="3"))
    assert out.returncode == 1, out.stderr[-3000:]
    assert (f"atorch.distributed.run: waiting up to 3 s (ATORCH_INIT_TIMEOUT) for 2 nodes at 127.0.0.1:{port}"
            in out.stderr), out.stderr[-3000:]
    assert (f"atorch.distributed.run: error: the rendezvous at 127.0.0.1:{port} did not gather 2 nodes within 3 s "
            "(ATORCH_INIT_TIMEOUT)") in out.stderr, out.stderr[-3000:]
    assert "ran" not in out.stdout and took < 35          # was torch's 600 s


@pytest.mark.parametrize("mode", [[], ["--fault_tolerant"]], ids=["static", "fault_tolerant"])
def test_a_node_pointed_at_a_port_that_is_not_a_store_fails_instead_of_hanging(tmp_path, listening_port, mode):
    """Node rank 1 with a --master_port where something else listens: torch's store client waits for the
    store's answer with no deadline (it hung for good); the launcher checks and names the port."""
    script = _write(tmp_path, "ok.py", "print('ran')\n")
    out, took = _run([*mode, "--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port",
                      str(listening_port), "--nproc_per_node", "1", script], timeout=40,
                     env=_env(ATORCH_INIT_TIMEOUT="3"))
    assert out.returncode == 1, out.stderr[-3000:]
    assert (f"atorch.distributed.run: error: 127.0.0.1:{listening_port} is not a torch rendezvous store: it "
            "accepted a connection but did not answer as a torch store within 3 s") in out.stderr, out.stderr[-3000:]
    assert "ran" not in out.stdout and "Traceback" not in out.stderr and took < 35


def test_a_node_whose_store_never_comes_up_fails_after_atorch_init_timeout(tmp_path):
    script = _write(tmp_path, "ok.py", "print('ran')\n")
    port = find_free_port()
    out, took = _run(["--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                      "--nproc_per_node", "1", script], timeout=40, env=_env(ATORCH_INIT_TIMEOUT="3"))
    assert out.returncode == 1, out.stderr[-3000:]
    assert (f"atorch.distributed.run: error: nothing accepted connections at 127.0.0.1:{port} within 3 s "
            "(ATORCH_INIT_TIMEOUT): the node hosting the rendezvous store (node rank 0) never started") in out.stderr
    assert "ran" not in out.stdout and took < 35


@pytest.mark.parametrize("mode", [[], ["--fault_tolerant"]], ids=["static", "fault_tolerant"])
def test_two_nodes_on_one_machine_the_second_node_started_first(tmp_path, mode):
    """The store check on node rank 1 waits for node rank 0's store and does not disturb the rendezvous."""
    port = str(find_free_port())
    marker = tmp_path / "done"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    common = [sys.executable, "-m", "atorch.distributed.run", *mode, "--nnodes", "2", "--nproc_per_node", "1",
              "--master_addr", "127.0.0.1", "--master_port", port]
    env = _env(ATORCH_INIT_TIMEOUT="60")
    second = subprocess.Popen([*common, "--node_rank", "1", str(script), str(marker)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        time.sleep(3)
        first = subprocess.run([*common, "--node_rank", "0", str(script), str(marker)], capture_output=True,
                               text=True, timeout=120, env=env)
        log, _ = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], log[-2000:])
    assert "sum 3.0" in first.stdout + log
    assert (tmp_path / "done.0").exists() and (tmp_path / "done.1").exists()


@pytest.mark.parametrize("module", ["atorch.distributed.run", "atorch.distributed.launch"])
def test_no_python_runs_an_executable(module):
    out, _ = _run(["--nproc_per_node", "1", "--no_python", "/bin/echo", "hi", "there"], timeout=60, module=module)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hi there" in out.stdout


def test_worker_killed_by_a_signal_and_restarts_used_up(tmp_path):
    killed = _write(tmp_path, "killed.py", """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(20)
    """)
    out, _ = _run(["--nproc_per_node", "2", killed], timeout=60)
    assert out.returncode == 128 + 9, out.stderr[-3000:]
    assert "worker rank 1 (local rank 1, pid " in out.stderr and "failed with signal 9 (SIGKILL)" in out.stderr
    failing = _write(tmp_path, "failing.py", "import sys\nsys.exit(7)\n")
    out, _ = _run(["--fault_tolerant", "--max_restarts", "1", "--nproc_per_node", "1", failing], timeout=60)
    assert out.returncode == 7, out.stderr[-3000:]
    assert "failed with exit code 7; gave up after 1 restart (--max_restarts 1)" in out.stderr, out.stderr[-3000:]


def test_old_launcher_names_what_the_scheduler_set(tmp_path):
    script = _write(tmp_path, "ok.py", "print('ran')\n")
    out, _ = _run(["--nproc_per_node", "2", script], env=_env(RANK="5", WORLD_SIZE="2"), timeout=60,
                  module="atorch.distributed.launch")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr == ("atorch.distributed.launch: error: environment variable RANK=5 (read because --node_rank "
                          "was not given) must be below the number of nodes (WORLD_SIZE=2, read because --nnodes "
                          "was not given)\n")
