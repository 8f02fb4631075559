"""Timeouts of process-group setup and of collectives, and what a timed-out collective says.

- `ATORCH_INIT_TIMEOUT` (seconds, default 60): how long a rank waits for the others to join
  the rendezvous at MASTER_ADDR:MASTER_PORT. A rank that connects to another job's store
  (MASTER_PORT already in use) fails after it, naming the address, instead of waiting 30 min.
- `ATORCH_COLLECTIVE_TIMEOUT` (seconds, default 1800): the process groups' timeout. A rank
  that stalls inside a training collective makes the others fail after it; the message names
  the collective (from torch's flight recorder) and the ranks that did not arrive (a roll
  call through the rendezvous store), and the launcher then ends the job.

The roll call: every rank whose collective timed out writes `<pg>/<sequence number>/<rank>`
into the store, waits a grace period (the skew between ranks entering the collective, at most
the timeout), and lists the ranks of the group that did not write: those never reached it.
What a rank writes is the collective it was in at that sequence number (name, input sizes and
dtypes), so that ranks that all arrived but in different collectives (one that runs on some
ranks only, e.g. a save behind `if rank == 0`) or with different tensor sizes are told apart
from a slow or lost transfer, where every rank agrees.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch.distributed as dist

INIT_TIMEOUT_ENV = "ATORCH_INIT_TIMEOUT"
COLLECTIVE_TIMEOUT_ENV = "ATORCH_COLLECTIVE_TIMEOUT"
DEFAULT_INIT_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
# torch's flight recorder (one ring buffer of recent collectives per process group) names the
# collective that timed out; atorch turns it on unless the user configured it.
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = "2000"
# Phrases of gloo's and NCCL's errors when a collective times out or a peer is gone.
_TIMEOUT_MARKERS = ("Timed out waiting", "timed out", "Timeout", "timeout")
_PEER_LOST_MARKERS = ("closed by peer", "Connection reset", "pair closure", "Broken pipe", "Connection refused")
NODE_KEY = "atorch/node"
_MAX_GRACE_S = 30.0
# The roll call's wait after a peer closed its connection: the peer is gone and will not answer, and the ranks
# that lost it learn so within moments of each other. With _MAX_GRACE_S every survivor spent 30 s waiting for it
# (a job whose rank exited early took 34 s to end instead of 4).
_LOST_PEER_GRACE_S = 5.0
# How long a rank that has read every answer of a roll call waits for the others to have read them too.
READ_WAIT_S = 10.0
# Collectives whose input tensors have the same sizes and dtypes on every rank of the group (names after
# the backend's "gloo:"/"nccl:" prefix). An allow-list: the others (scatter, gather, all_to_all with uneven
# splits, ...) may differ legitimately, and a size difference there says nothing about the timeout.
_SAME_INPUT_ON_EVERY_RANK = frozenset({
    "all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced", "broadcast", "_broadcast_oop",
    "reduce", "_reduce_oop", "all_gather", "allgather", "_all_gather_base", "_allgather_base",
    "all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
})
# Longest rendering of one rank's tensor sizes in a message (a coalesced collective lists hundreds).
_MAX_SIZES_CHARS = 120


# The longest timeout accepted: far beyond any job, well inside timedelta and the process groups' limits.
MAX_TIMEOUT_S = 365 * 24 * 3600.0


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within ATORCH_COLLECTIVE_TIMEOUT; names it and the ranks that did not arrive."""


class DistributedInitError(RuntimeError):
    """The process group could not be formed at MASTER_ADDR:MASTER_PORT (port in use, a rank missing, ...)."""


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable `name` (ValueError naming it otherwise)."""
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT_S:   # also refuses nan; inf and beyond overflow timedelta and torch's int timeouts
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds, at most "
                         f"{MAX_TIMEOUT_S:.0f} (about a year)")
    return value


def init_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds_from_env(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S))


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds_from_env(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S))


def enable_flight_recorder() -> None:
    """Record recent collectives (must run before the first process group is created)."""
    os.environ.setdefault(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)


def is_timeout_error(exc: BaseException) -> bool:
    """A collective's timeout or lost peer (gloo/NCCL), as opposed to any other error."""
    return isinstance(exc, (RuntimeError, dist.DistError)) \
        and any(m in str(exc) for m in _TIMEOUT_MARKERS + _PEER_LOST_MARKERS) \
        and not isinstance(exc, (CollectiveTimeoutError, DistributedInitError))


def this_node() -> str:
    """'node N (host)': the launcher's node rank (GROUP_RANK) and this machine's name."""
    import socket

    return f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def _nodes_of(store: dist.Store, ranks: Sequence[int]) -> str:
    nodes: Dict[str, List[int]] = {}
    for r in ranks:
        try:
            where = store.get(f"{NODE_KEY}/{r}").decode() if store.check([f"{NODE_KEY}/{r}"]) else "unknown node"
        except Exception:  # noqa: BLE001 - best effort
            where = "unknown node"
        nodes.setdefault(where, []).append(r)
    return ", ".join(f"{where}: ranks {rs}" for where, rs in nodes.items())


def _pending_collective() -> Optional[Dict[str, Any]]:
    """The newest flight-recorder entry that did not complete (this rank's stuck collective), if any."""
    try:
        # A private torch function absent from its stubs (hence the ImportError guard).
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

        trace = json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - the recorder is optional; the message then omits the name
        return None
    entries = [e for e in trace.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return None
    pending = [e for e in entries if e.get("state") != "completed"]
    entry = (pending or entries)[-1]
    pg_name, pg_desc = (list(entry.get("process_group") or []) + ["", ""])[:2]
    ranks = None
    for cfg in (trace.get("pg_config") or {}).values():
        if cfg.get("name") == pg_name and cfg.get("name"):
            try:
                ranks = json.loads(cfg.get("ranks", "null"))
            except ValueError:
                ranks = None
    if ranks is None and pg_name and dist.is_initialized():
        ranks = _ranks_of_group_named(pg_name)
    if ranks is None and pg_desc == "default_pg" and dist.is_initialized():
        ranks = list(range(dist.get_world_size()))
    return {"name": entry.get("profiling_name"), "seq": entry.get("collective_seq_id"),
            "pg": pg_desc or pg_name, "pg_id": pg_name, "sizes": entry.get("input_sizes"),
            "dtypes": entry.get("input_dtypes"), "ranks": ranks}


def _ranks_of_group_named(name: str) -> Optional[List[int]]:
    """Global ranks of this process's group called `name` (None: no such group).

    The recorder lists the ranks of a gloo subgroup nowhere (torch 2.13: its `pg_config` holds one empty
    entry), and without them the roll call took the whole world for a parallel group's members.
    """
    try:
        for group, group_name in dist.distributed_c10d._world.pg_names.items():
            if group_name == name:
                return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):   # a group already destroyed
        return None
    return None


def roll_call(store: dist.Store, key: str, ranks: Sequence[int], me: int, grace_s: float,
              doing: Optional[Dict[str, Any]] = None) -> Dict[int, Dict[str, Any]]:
    """What each rank of `ranks` that wrote `key/<rank>` within `grace_s` was doing; this rank writes `doing`.

    The ranks absent from the answer never reached the collective. A rank's answer is the collective it
    was in at this sequence number ({"name", "sizes", "dtypes"}, as far as its flight recorder knew;
    empty when it knew nothing), so the caller can tell ranks in different collectives apart.
    """
    store.set(f"{key}/{me}", json.dumps(doing or {}))
    deadline = time.monotonic() + grace_s
    answers: Dict[int, Dict[str, Any]] = {}
    while True:
        for r in ranks:     # each answer read as soon as it is there, once
            if r not in answers and store.check([f"{key}/{r}"]):
                answers[r] = _answer(store.get(f"{key}/{r}"))
        if len(answers) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    # No rank leaves before every rank that answered has read the answers: the store may live in one of these
    # processes (rank 0's, as under the spawn helper), and a rank still reading when it exits found it gone
    # ("the rendezvous store is unreachable" in a 2-rank test, 1 run in ~20). Bounded: a rank that dies now
    # costs at most READ_WAIT_S.
    store.set(f"{key}/read/{me}", "1")
    read_deadline = time.monotonic() + min(grace_s, READ_WAIT_S)
    while not all(store.check([f"{key}/read/{r}"]) for r in answers) and time.monotonic() < read_deadline:
        time.sleep(0.05)
    return answers


def _answer(raw: bytes) -> Dict[str, Any]:
    """One rank's roll-call answer; {} for one that is not a JSON object (a rank that knew nothing to tell)."""
    try:
        answer = json.loads(raw.decode())
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _by_rank(values: Dict[int, str]) -> str:
    """'A on rank(s) [0]; B on rank(s) [1, 2]': ranks grouped by value, so a 64-rank job's message stays short."""
    groups: Dict[str, List[int]] = {}
    for r in sorted(values):
        groups.setdefault(values[r], []).append(r)
    return "; ".join(f"{value} on rank(s) {rs}" for value, rs in groups.items())


def _short(value: Any) -> str:
    """`value` as text, cut to _MAX_SIZES_CHARS (the sizes of a coalesced collective fill a screen)."""
    text = str(value)
    return text if len(text) <= _MAX_SIZES_CHARS else text[:_MAX_SIZES_CHARS - 3] + "..."


def _op_of(name: str) -> str:
    """'all_reduce' of 'gloo:all_reduce': the collective without its backend."""
    return name.split(":", 1)[-1]


def _describe_disagreement(answers: Dict[int, Dict[str, Any]]) -> Optional[str]:
    """What the ranks of a roll call disagree on (different collectives, sizes or dtypes), None if nothing.

    Only what the ranks recorded is compared: a rank without a flight recorder agrees with everyone.
    Sizes and dtypes are compared only for collectives whose inputs must match on every rank.
    """
    names = {r: a["name"] for r, a in answers.items() if a.get("name")}
    if len(set(names.values())) > 1:
        ops = {r: names[r] + (f" (input sizes {_short(answers[r]['sizes'])})" if answers[r].get("sizes") else "")
               for r in names}
        return (f"; the ranks were in different collectives at this sequence number: {_by_rank(ops)}. A collective "
                "that runs on some ranks only (a save, a log or a metric behind `if rank == 0`, or a branch on "
                "rank-local data) desynchronizes them; run it on every rank of the group, or on none")
    if not names or _op_of(next(iter(names.values()))) not in _SAME_INPUT_ON_EVERY_RANK:
        return None
    for field in ("sizes", "dtypes"):
        values = {r: answers[r][field] for r in names if answers[r].get(field) is not None}
        if len({json.dumps(v) for v in values.values()}) > 1:
            shown = _by_rank({r: _short(v) for r, v in values.items()})
            return (f"; every rank of the group reached it but with different input tensor {field}: {shown}. Every "
                    f"rank must pass tensors of the same {field} (one whose shape or dtype depends on the rank: an "
                    "uneven last batch, a rank-local list, a branch on the rank?)")
    return None


def _roll_call_outcome(store: dist.Store, key: str, ranks: Sequence[int], me: int, grace_s: float,
                       doing: Dict[str, Any]) -> str:
    """The roll call's part of the message: the ranks that did not arrive, what the ranks disagree on, or neither."""
    answers = roll_call(store, key, ranks, me, grace_s, doing)
    missing = [r for r in ranks if r not in answers]
    if missing:
        return f"; rank(s) {missing} did not arrive ({_nodes_of(store, missing)})"
    return _describe_disagreement(answers) or "; every rank of the group reached it (a slow or lost transfer)"


def describe_collective_timeout(exc: BaseException, store: Optional[dist.Store]) -> str:
    """A message naming the collective that timed out on this rank and the ranks that never reached it.

    When every rank reached the same sequence number but in different collectives (or with different
    tensor sizes), the message says so and lists each rank's collective instead of blaming the network.
    """
    timeout_s = collective_timeout().total_seconds()
    me = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    pending = _pending_collective()
    doing: Dict[str, Any] = {}
    if pending is None:
        what, ranks, key = "a collective", None, "unknown"
    else:
        sizes = f", input sizes {pending['sizes']}" if pending.get("sizes") else ""
        what = (f"collective {pending['name']} (sequence number {pending['seq']} of process group "
                f"{pending['pg']!r}{sizes})")
        ranks, key = pending["ranks"], f"{pending['pg_id']}/{pending['seq']}"
        doing = {"name": pending["name"], "sizes": pending.get("sizes"), "dtypes": pending.get("dtypes")}
    if ranks is None and dist.is_initialized():
        ranks = list(range(dist.get_world_size()))
    lost = any(m in str(exc) for m in _PEER_LOST_MARKERS) and not any(m in str(exc) for m in _TIMEOUT_MARKERS)
    missing_text = ""
    if store is not None and ranks:
        try:
            missing_text = _roll_call_outcome(store, f"atorch/timeout/{key}", ranks, me,
                                              min(timeout_s, _LOST_PEER_GRACE_S if lost else _MAX_GRACE_S), doing)
        except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
            missing_text = "; the other ranks could not be asked (the rendezvous store is unreachable)"
    outcome = "failed: a peer closed its connection" if lost else \
        f"did not complete within {COLLECTIVE_TIMEOUT_ENV}={timeout_s:g} s"
    return f"rank {me}: {what} {outcome}{missing_text} (original error: {str(exc).strip()[:300]})"


@contextlib.contextmanager
def diagnose_collective_timeouts() -> Iterator[None]:
    """Turn a collective timeout raised inside the block into a `CollectiveTimeoutError` with the diagnosis."""
    try:
        yield
    except Exception as e:
        if is_timeout_error(e) and dist.is_initialized():
            raise CollectiveTimeoutError(describe_collective_timeout(e, _store)) from e
        raise


_store: Optional[dist.Store] = None
_previous_hook = None
_uncaught = False


def failed_with_uncaught_exception() -> bool:
    """Whether an uncaught exception reached sys.excepthook (the process is exiting with an error)."""
    return _uncaught


def install(store: Optional[dist.Store]) -> None:
    """Remember the rendezvous store and make an uncaught collective timeout print its diagnosis."""
    global _store, _previous_hook
    _store = store
    if _previous_hook is None and store is not None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(exc_type, exc, tb) -> None:
    global _uncaught
    _uncaught = True
    if exc is not None and is_timeout_error(exc) and dist.is_initialized():
        try:
            message = describe_collective_timeout(exc, _store)
        except Exception as e:  # noqa: BLE001 - never hide the original error
            message = f"(could not diagnose the collective timeout: {e})"
        print(f"[atorch] {CollectiveTimeoutError.__name__}: {message}", file=sys.stderr, flush=True)
    (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
