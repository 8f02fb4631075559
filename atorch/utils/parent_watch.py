"""Act when this process's parent is gone: a daemon thread polling `os.getppid()`.

Shared by deploy's workers (which exit) and the launcher's workers (which are sent SIGTERM). A poll
rather than Linux's PR_SET_PDEATHSIG alone, which fires when the *thread* that started the process
exits, not the process, and exists on Linux only.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


def on_parent_exit(parent_pid: int, action: Callable[[], None], poll_s: float, name: str) -> None:
    """Run `action` in a daemon thread named `name` once `parent_pid` is no longer this process's parent
    (checked at once, then every `poll_s` seconds)."""
    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        action()

    threading.Thread(target=poll, name=name, daemon=True).start()
