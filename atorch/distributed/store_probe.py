"""Before a node that does not host the rendezvous store joins: is a torch store listening at the endpoint?

Why by hand: torch's store client (`TCPStore(is_master=False)`, used by the static and c10d
rendezvous alike) retries until its timeout while nothing listens, but once *something* accepts
the connection it waits for the store's answer with no deadline at all (its `timeout` does not
cover the handshake). A node started with the wrong `--master_port` (a web server, another
service, a stale half-dead process) then hangs for good, silently. No torch option bounds it, so
the launcher checks first, from a thread it can abandon:

1. wait (up to the join timeout) until the endpoint accepts a TCP connection, as torch would;
2. connect a store client in a daemon thread; a real store answers in milliseconds, so one that has
   not answered within `answer_s` is not a store, and the launcher says so and exits.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import List, Optional

STORE_ANSWER_S = 30.0
"""How long a listening endpoint may take to answer the store handshake (a live store: milliseconds)."""


class StoreProbeError(RuntimeError):
    """The endpoint cannot serve as the rendezvous store (see the subclasses)."""


class StoreNotUpError(StoreProbeError):
    """Nothing accepted a connection at the endpoint in time (or its host does not resolve)."""


class NotAStoreError(StoreProbeError):
    """Something accepts connections at the endpoint but does not answer as a torch store."""


def _accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except socket.gaierror as e:
        raise StoreNotUpError(f"cannot resolve the rendezvous host {host!r}: {e}") from None
    except OSError:     # refused, unreachable, timed out: not up yet
        return False


def _store_answers(host: str, port: int, answer_s: float) -> Optional[str]:
    """None when a store client connects within `answer_s`; else why not. The client thread is a daemon:
    when it hangs in torch's handshake it is left behind (the launcher is about to exit)."""
    import torch.distributed as dist

    outcome: List[Optional[str]] = []

    def connect() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=answer_s),
                                  wait_for_workers=False)
            del store
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - reported to the caller as text
            outcome.append(f"{type(e).__name__}: {e}".splitlines()[0][:300])

    thread = threading.Thread(target=connect, name="atorch-store-probe", daemon=True)
    thread.start()
    thread.join(answer_s + 1.0)
    if not outcome:
        return f"it accepted a connection but did not answer as a torch store within {answer_s:g} s"
    return outcome[0]


def check_store_endpoint(host: str, port: int, wait_s: float, answer_s: float = STORE_ANSWER_S,
                         poll_s: float = 1.0) -> None:
    """Wait up to `wait_s` for `host:port` to accept connections, then check that it answers as a torch store.

    Raises StoreNotUpError naming the endpoint when nothing listened in time, NotAStoreError when what
    listens is not a store (a client of a non-store hangs forever in torch)."""
    deadline = time.monotonic() + wait_s
    while not _accepts(host, port, timeout_s=min(poll_s * 5, max(0.1, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise StoreNotUpError(f"nothing accepted connections at {host}:{port} within {wait_s:g} s")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    why = _store_answers(host, port, answer_s)
    if why is not None:
        raise NotAStoreError(f"{host}:{port} is not a torch rendezvous store: {why}")
