"""A worker stops when its launcher is killed outright (torch elastic stops it only when asked)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from atorch.distributed.launcher_watch import LAUNCHER_PID_ENV, launcher_pid

_CHILD = r"""
import time
from atorch.distributed.launcher_watch import watch_launcher
assert watch_launcher()
print("watching", flush=True)
time.sleep(60)
"""

# Stands in for the launcher: starts one worker naming it, reports the worker's pid, waits.
_PARENT = r"""
import os, subprocess, sys, time
env = dict(os.environ, ATORCH_LAUNCHER_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:     # a zombie (exited, not yet reaped by init) is gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_worker_whose_launcher_is_killed_stops():
    """kill -9 on `atorch.distributed.run` left both workers running (an outside probe); now they get
    SIGTERM within about a second of the launcher's death."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the worker outlived its launcher"
    finally:
        parent.kill()


def test_only_a_child_of_the_named_launcher_watches_it(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getppid()))
    assert launcher_pid() == os.getppid()
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))     # named, but not this process's parent
    assert launcher_pid() is None
    monkeypatch.setenv(LAUNCHER_PID_ENV, "not a pid")
    assert launcher_pid() is None
    monkeypatch.delenv(LAUNCHER_PID_ENV)
    assert launcher_pid() is None


def test_the_launcher_names_itself_for_the_launch_only(monkeypatch):
    from atorch.distributed.launcher_watch import naming_this_launcher

    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    with naming_this_launcher():
        assert os.environ[LAUNCHER_PID_ENV] == str(os.getpid())
    assert LAUNCHER_PID_ENV not in os.environ
