"""Run a function on N gloo ranks in child processes: the one spawn helper of the test suite.

Every child's traceback reaches the caller, and the whole group is killed at a timeout,
so a distributed test can fail but never hang. Children are forked from a forkserver that has
already imported torch, transformers and DeepSpeed (see `_start_method` for when it is not used).
One thing forked ranks share that spawned ones did not: Python's str hash seed, so a set of strings
iterates in the same order on every rank (a launcher's fresh interpreters may differ).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from multiprocessing import forkserver, reduction
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


# What the forkserver imports once, so that a rank does not: measured on the 2-core CI machine, a spawned
# rank spent 3-8 s importing these (torch._dynamo: init_distributed imports it; the model classes of
# tiny_llama and tiny_gpt2; DeepSpeed with its CPU accelerator). atorch itself is not preloaded (cheap,
# and it is then imported in each rank with that rank's environment, as with spawn).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2", "deepspeed")

# Environment variables that may differ between the forkserver and a child and still let the child be
# forked: none of the preloaded libraries reads them (checked by grep in torch, transformers, DeepSpeed).
# An allow-list: any other difference (a test's env= or monkeypatch) gets a spawned child, as before,
# because a preloaded library may have read that variable at import (DS_ACCELERATOR, HF_HUB_OFFLINE...).
_FORK_SAFE_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                              "PYTEST_CURRENT_TEST", "BO_SG_MAX_IETR", "MAX_PATIENCE", "RANDOM_SAMPLE"})
_FORK_SAFE_PREFIXES = ("ATORCH_",)

# The environment the running forkserver was started with, and its pid (None: not started by us).
_forkserver_env: Optional[Dict[str, str]] = None
_forkserver_pid: Optional[int] = None
_forkserver_lock = threading.Lock()


class DistributedTestError(AssertionError):
    """One or more ranks failed or timed out; the message holds every rank's traceback."""


def _fork_safe(name: str) -> bool:
    return name in _FORK_SAFE_NAMES or name.startswith(_FORK_SAFE_PREFIXES)


def _start_method(server_env: Optional[Dict[str, str]], child_env: Dict[str, str], cuda: bool) -> str:
    """"forkserver" when a child forked from a server started with `server_env` is the same as a spawned one.

    It is when every variable in which `child_env` (the child's whole environment) differs from the
    server's is one no preloaded library reads. Spawn otherwise, and always on a CUDA machine: a
    preloading import that probes the device would leave the server with an initialized CUDA driver,
    which a forked child cannot use.
    """
    if cuda or server_env is None:
        return "spawn"
    names = set(server_env) | set(child_env)
    differing = [n for n in names if server_env.get(n) != child_env.get(n)]
    return "forkserver" if all(_fork_safe(n) for n in differing) else "spawn"


def _ensure_forkserver() -> Optional[Dict[str, str]]:
    """Start (once per process, again if it died) the preloading forkserver; return its environment.

    It starts with QUIET_ENV in its environment, not only in the children's: torch, transformers and
    DeepSpeed read some of these at import (DS_ACCELERATOR picks DeepSpeed's accelerator for good).
    None when the server running is not ours (another caller started it first): then spawn.
    """
    global _forkserver_env, _forkserver_pid
    with _forkserver_lock:
        server: Any = forkserver._forkserver      # private state: its pid and preload list
        saved = dict(os.environ)
        os.environ.update(QUIET_ENV)
        try:
            if server._forkserver_pid is None:
                mp.set_forkserver_preload(list(PRELOAD))
            server.ensure_running()
            started_env = dict(os.environ)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if server._forkserver_pid != _forkserver_pid:      # started (or restarted) just now, by us
            if server._preload_modules != list(PRELOAD):
                return None
            _forkserver_pid, _forkserver_env = server._forkserver_pid, started_env
        return _forkserver_env


class _Stdio:
    """The caller's stdout and stderr, carried to a forked child.

    A spawned child inherits the caller's file descriptors 1 and 2 at start, which pytest points at
    the current test's capture; a forked child would inherit the forkserver's, pointed wherever the
    first test that started the server had them. Pickled only while a child is started (DupFd).
    """

    def __init__(self, fds: Tuple[Any, ...] = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> Any:
        return _Stdio, (tuple(reduction.DupFd(fd) for fd in (1, 2)),)

    def install(self) -> None:
        for target, dup in zip((1, 2), self.fds):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _reseed_numpy() -> None:
    """Give a forked rank numpy's global random state from fresh entropy, as a new interpreter has.

    Python's `random` reseeds itself at fork; numpy's legacy global state would otherwise be the
    server's, the same in every rank of every test. torch's default generator needs nothing: a new
    interpreter starts it at a fixed seed, and the server never draws from it.
    """
    import sys

    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _exit_like_an_interpreter() -> None:
    """Run what a spawned child's interpreter exit ran and a forked child's exit skips.

    The forkserver ends a child with `os._exit` (as the "fork" start method does): no interpreter
    finalization. A spawned child joined its non-daemon threads and then ran the atexit handlers,
    among them atorch's: wait for an asynchronous checkpoint save, tear down the process groups.
    """
    import atexit

    threading._shutdown()       # type: ignore[attr-defined]  # what interpreter exit calls first
    atexit._run_exitfuncs()


def _child(fn: Callable, rank: int, world_size: int, port: int, backend: str, base_env: Dict[str, str],
           env: Dict[str, str], stdio: Optional[_Stdio], args: Sequence[Any], kwargs: Dict[str, Any],
           results: "mp.Queue") -> None:
    if stdio is not None:       # forked from the server
        stdio.install()
        _reseed_numpy()
    # The caller's environment at start, as a spawned child inherits it (a forked one has the server's).
    os.environ.clear()
    os.environ.update(base_env)
    os.environ.update(QUIET_ENV)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_PORT": str(port)})
    try:
        _run_rank(fn, rank, backend, args, kwargs, results)
    finally:
        if stdio is not None:
            _exit_like_an_interpreter()


def _run_rank(fn: Callable, rank: int, backend: str, args: Sequence[Any], kwargs: Dict[str, Any],
              results: "mp.Queue") -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from atorch.distributed import destroy_distributed, init_distributed

        init_distributed(backend)
        # Pickled here, by value: the queue's pickler (torch's reductions) would pass a tensor's storage
        # as a file descriptor served by this process, which the caller could no longer fetch once this
        # rank had exited (FileNotFoundError in the caller; seen with forked ranks, which exit fast).
        value = pickle.dumps(fn(*args, **kwargs))
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
    Each child starts with the caller's environment, then QUIET_ENV, then `env`, then its rank's.
    """
    import torch

    env = dict(env or {})
    base_env = dict(os.environ)
    cuda = torch.cuda.is_available()
    method = _start_method(None if cuda else _ensure_forkserver(), {**base_env, **QUIET_ENV, **env}, cuda)
    ctx: Any = mp.get_context(method)
    stdio = _Stdio() if method == "forkserver" else None
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, base_env, env, stdio, args,
                                              kwargs, results), daemon=True)
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
    return [pickle.loads(outcome[r]) for r in range(world_size)]


def _drain(results: "mp.Queue", outcome: Dict[int, Any], errors: Dict[int, str], wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            r, status, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        (outcome if status == "ok" else errors)[r] = value
