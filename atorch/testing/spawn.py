"""Run a function on N gloo ranks in spawned processes: the one spawn helper of the test suite.

Every child's traceback reaches the caller, and the whole group is killed at a timeout,
so a distributed test can fail but never hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

from atorch.distributed.process_group import find_free_port

# Measured on the 2-core CI machine: a torch import plus gloo rendezvous takes 3-8 s a rank.
DEFAULT_TIMEOUT_S = 240.0

QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "MASTER_ADDR": "127.0.0.1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class DistributedTestError(AssertionError):
    """One or more ranks failed or timed out; the message holds every rank's traceback."""


def _child(fn: Callable, rank: int, world_size: int, port: int, backend: str, env: Dict[str, str],
           args: Sequence[Any], kwargs: Dict[str, Any], results: "mp.Queue") -> None:
    os.environ.update(QUIET_ENV)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_PORT": str(port)})
    try:
        import torch

        torch.set_num_threads(1)
        from atorch.distributed import destroy_distributed, init_distributed

        init_distributed(backend)
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        destroy_distributed()
    except Exception:  # noqa: BLE001 - the result is already reported
        pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    backend: str = "gloo", env: Optional[Dict[str, str]] = None, **kwargs: Any) -> List[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` ranks with a process group initialized.

    Returns the per-rank return values (index = rank). `fn` must be importable (module level)
    and its return value picklable. Raises DistributedTestError with all tracebacks on failure.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, dict(env or {}), args, kwargs,
                                              results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                r, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and i not in outcome and i not in errors]
                for i in dead:
                    errors[i] = f"process exited with code {procs[i].exitcode} without reporting"
                # One failed rank usually leaves the others blocked in a collective: stop waiting.
                if errors:
                    _drain(results, outcome, errors, wait_s=2.0)
                    break
                continue
            (outcome if status == "ok" else errors)[r] = value
            if errors:
                _drain(results, outcome, errors, wait_s=2.0)
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors and len(outcome) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    if errors or len(outcome) < world_size:
        missing = [r for r in range(world_size) if r not in outcome and r not in errors]
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        if missing and errors:
            parts.append(f"--- ranks {missing} were still running after the failure above (killed) ---")
        elif missing:
            parts.append(f"--- ranks {missing} did not finish within {timeout:.0f} s (killed) ---")
        raise DistributedTestError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(parts))
    return [outcome[r] for r in range(world_size)]


def _drain(results: "mp.Queue", outcome: Dict[int, Any], errors: Dict[int, str], wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            r, status, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        (outcome if status == "ok" else errors)[r] = value
