"""Stop a worker whose launcher is gone.

torch elastic's agent (inside `atorch.distributed.run`) stops its workers when it is asked to
(SIGTERM, SIGINT) but not when it is killed outright (SIGKILL, an out-of-memory kill of the
launcher): its workers then run on as orphans, holding devices and ports, training to the end or
waiting in a collective until its timeout. The launcher names itself to its workers
(`ATORCH_LAUNCHER_PID`), and a worker that initializes atorch's process group watches its
parent: once the launcher is gone the worker is sent SIGTERM (its handlers run, as when torch
elastic stops it), and SIGKILL if it is still alive `GRACE_S` later (`utils.parent_watch`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Iterator, Mapping, Optional

from atorch.utils.parent_watch import on_parent_exit

LAUNCHER_PID_ENV = "ATORCH_LAUNCHER_PID"
POLL_S = 1.0
GRACE_S = 30.0

_watching = False


@contextlib.contextmanager
def naming_this_launcher() -> Iterator[None]:
    """Name this process as the launcher in the environment its workers inherit, for the launch only."""
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def launcher_pid(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The launcher's pid when this process is one of its workers (its parent), else None."""
    raw = (os.environ if env is None else env).get(LAUNCHER_PID_ENV, "")
    try:
        pid = int(raw)
    except ValueError:
        return None
    return pid if pid > 1 and os.getppid() == pid else None


def watch_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """Start watching the launcher (once per process); whether this process is watching it."""
    global _watching
    if _watching:
        return True
    pid = launcher_pid(env)
    if pid is None:
        return False
    on_parent_exit(pid, lambda: _stop_this_worker(pid), POLL_S, "atorch-launcher-watch")
    _watching = True
    return True


def _stop_this_worker(pid: int) -> None:
    print(f"[atorch] worker pid {os.getpid()}: its launcher (pid {pid}) is gone; stopping this worker (SIGTERM)",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
