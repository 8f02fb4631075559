"""A plain process (a notebook, a script) can tear its world of one down and start again."""

import os

import torch.distributed as dist

import atorch


def test_init_reset_init_in_one_plain_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    atorch.init_distributed("gloo")
    assert dist.get_world_size() == 1
    atorch.reset_distributed()
    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ   # the fill-in is undone
    atorch.init_distributed("gloo")          # would fail with EADDRINUSE on the first world's port
    assert dist.is_initialized() and dist.get_world_size() == 1 and os.environ["MASTER_PORT"]
    atorch.reset_distributed()


def test_new_groups_take_the_collective_timeout_until_reset(monkeypatch):
    """Groups created after init (a DeviceMesh's, DeepSpeed's) take ATORCH_COLLECTIVE_TIMEOUT, not torch's 30 min."""
    import datetime

    import torch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ATORCH_COLLECTIVE_TIMEOUT", "42")
    before = dist.distributed_c10d.default_pg_timeout
    atorch.init_distributed("gloo")
    group = dist.new_group([0])            # no timeout given, as DeepSpeed and DeviceMesh create theirs
    assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=42)
    assert atorch.distributed.process_group.default_group_timeout() == datetime.timedelta(seconds=42)
    atorch.reset_distributed()
    assert dist.distributed_c10d.default_pg_timeout == before       # torch's own again after the world is gone


def test_a_users_own_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(atorch.distributed.find_free_port()))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    port = os.environ["MASTER_PORT"]
    atorch.init_distributed("gloo")
    atorch.reset_distributed()
    assert os.environ["MASTER_PORT"] == port and os.environ["MASTER_ADDR"] == "127.0.0.1"


_DDP_JOB = r"""
import gc, os, torch
import atorch
atorch.init_distributed("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))   # imports torch._dynamo
model(torch.randn(2, 4)).sum().backward()
del model
atorch.reset_distributed()
gc.collect()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


_DDP_IN_A_CYCLE_JOB = r"""
import os, torch
import atorch
atorch.init_distributed("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
holder = {"model": model}
holder["self"] = holder      # held only by a reference cycle, as a deleted training result often is
del model, holder
atorch.reset_distributed()   # no gc.collect() of the script's own
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


def _threads_after(job: str) -> str:
    import subprocess
    import sys

    if not os.path.isdir("/proc/self/task"):
        import pytest

        pytest.skip("thread names are read from /proc (Linux)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", job], env=dict(env, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_no_gloo_thread_outlives_the_reset_of_a_ddp_job_held_by_a_cycle():
    """The Slurm example deletes its result and resets: a DDP model kept only by a reference cycle
    still held the group through destroy_process_group, gloo's workers lived into finalization and
    one aborted the finished job again ("terminate called without an active exception", a
    fresh-clone CI run of session 7). reset_distributed collects cycles before destroying."""
    threads = _threads_after(_DDP_IN_A_CYCLE_JOB)
    assert "gloo" not in threads and "tcpstore" not in threads, threads


def test_no_gloo_thread_outlives_the_reset_of_a_ddp_job():
    """gloo's worker threads left alive at interpreter finalization abort the process when one needs
    the GIL there (a finished Slurm job's worker did). DDP imports torch._dynamo, and imported after
    the group exists it keeps the group alive through destroy and gc: atorch imports it first.
    A fresh interpreter, since this pytest process may have imported torch._dynamo already."""
    threads = _threads_after(_DDP_JOB)
    assert "gloo" not in threads and "tcpstore" not in threads, threads


def test_a_rank_that_cannot_reach_the_store_fails_within_the_init_timeout(monkeypatch):
    """torch retries a timed-out connect once more with the same timeout (plus a back-off), so a rank
    whose rank 0 never came up failed after more than twice ATORCH_INIT_TIMEOUT (23.5 s for 10)."""
    import datetime

    from atorch.distributed import process_group

    now = [0.0]
    attempts = []

    class NeverReachable:
        def __init__(self, *args, timeout, is_master, **kwargs):
            attempts.append(timeout.total_seconds())
            now[0] += 2.3 * timeout.total_seconds()     # what torch's client took: two tries and a back-off
            raise dist.DistNetworkError("The client socket has timed out")

    monkeypatch.setattr(process_group.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(process_group.dist, "TCPStore", NeverReachable)
    join = datetime.timedelta(seconds=60)
    try:
        process_group._connect_store("127.0.0.1", 1, 2, False, join)
    except dist.DistNetworkError:
        pass
    else:
        raise AssertionError("no error")
    assert now[0] <= 60 + 2.3 * 5, (now[0], attempts)       # the deadline, overrun by at most one attempt
    assert max(attempts) <= process_group._CONNECT_ATTEMPT_S and len(attempts) > 1, attempts


_FAILING_JOB = r"""
import atexit, logging, sys
atexit.register(lambda: print("interpreter finalization reached", flush=True))   # runs after atorch's handler
import torch
import atorch
atorch.init_distributed("gloo")
logging.basicConfig(stream=sys.stdout, level=logging.INFO)
logging.getLogger("job").info("logged before the error")
print("printed without a newline", end="")
raise ValueError("the user's error")
"""


def test_a_failing_rank_exits_1_without_finalization_and_flushes_its_output():
    """A rank ending with an uncaught exception keeps its groups (a pending collective would make their
    destroy wait), so gloo's threads met finalization and the process sometimes aborted after the
    traceback (SIGABRT, 134 from the launcher; 1 in 8 runs of a failing tensor-parallel job). It
    now leaves with Python's status 1 before finalization, its output flushed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _FAILING_JOB], env=dict(env, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "ValueError: the user's error" in out.stderr
    assert "logged before the error" in out.stdout and out.stdout.endswith("printed without a newline"), out.stdout
    assert "interpreter finalization reached" not in out.stdout
