"""The caller's side of a deployment: the worker processes and the model-like proxy in front of them."""

from __future__ import annotations

import builtins
import subprocess
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List, Optional, Set, Union, cast

import torch

from atorch.deploy import protocol

POLL_S = 0.2
CLOSE_WAIT_S = 5.0


class WorkerError(RuntimeError):
    """A deployed model's worker died or could not be reached; the deployment is unusable."""


class WorkerGroup:
    """The worker processes and their sockets; one request at a time (a lock serializes callers)."""

    def __init__(self, procs: List[subprocess.Popen], conns: List[Connection]) -> None:
        self.procs = procs
        self.conns = conns
        self._lock = threading.Lock()
        self._broken: Optional[str] = None
        self._closed = False
        # Ranks that still owe a reply to a call the caller abandoned (an exception such as
        # KeyboardInterrupt while waiting): their replies must be read and dropped before the next
        # call, or each later call would be answered with its predecessor's result.
        self._owed: Set[int] = set()
        self._sending = False       # a call was interrupted while being sent: the ranks are out of step

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, setup: Dict[str, Any], state: Optional[Dict[str, torch.Tensor]], timeout_s: float) -> None:
        """Send each worker the setup (and weights) and wait until every rank has built its shard."""
        with self._lock:
            for rank, conn in enumerate(self.conns):
                self._send(rank, conn, {"setup": setup}, state)
            self._collect(timeout_s, "building the model")

    def close(self) -> None:
        """Ask the workers to exit, then kill what is left; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        acquired = self._lock.acquire(timeout=CLOSE_WAIT_S)  # a call in flight: do not wait for it forever
        try:
            for conn in self.conns:
                try:
                    protocol.send(conn, {"op": "close"})
                except OSError:
                    pass
            deadline = time.monotonic() + CLOSE_WAIT_S
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for conn in self.conns:
                conn.close()
        finally:
            if acquired:
                self._lock.release()

    def alive(self) -> bool:
        return not self._closed and self._broken is None and all(p.poll() is None for p in self.procs)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    # -- requests --------------------------------------------------------------------------
    def request(self, op: str, payload: Any, seed: Optional[int], device: Optional[torch.device]) -> Any:
        """Run `op` on every rank with the same inputs; rank 0's result, on `device`."""
        with self._lock:
            self._check_usable()
            self._finish_abandoned()
            frames = protocol.encode({"op": op, "seed": seed}, payload)   # a payload it cannot carry raises here
            self._sending = True
            for rank, conn in enumerate(self.conns):
                self._send_frames(rank, conn, frames)
                self._owed.add(rank)
            self._sending = False
            return self._collect(None, op, device)[0]

    def _finish_abandoned(self) -> None:
        """Read and drop the replies of a call the caller abandoned (they arrive once the ranks finish it)."""
        if self._sending:
            self._fail("deployed model: a call was interrupted while it was being sent to the workers, so some "
                       "ranks run it and wait for the others; the deployment is unusable, deploy again")
        if not self._owed:
            return
        try:
            self._collect(None, "finishing a call that was interrupted", ranks=sorted(self._owed))
        except WorkerError:
            raise
        except Exception:  # noqa: BLE001 - the abandoned call's own error belongs to nobody now
            pass

    def _check_usable(self) -> None:
        if self._closed:
            raise WorkerError("the deployed model is closed")
        if self._broken is not None:
            raise WorkerError(self._broken)
        self._check_processes()

    def _check_processes(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                self._fail(f"deployed model: worker rank {rank} (pid {proc.pid}) exited with code {code}; the "
                           "deployment is unusable, deploy again")

    def _fail(self, message: str) -> None:
        self._broken = message
        for proc in self.procs:  # the other ranks would wait in a collective for the dead one
            if proc.poll() is None:
                proc.kill()
        raise WorkerError(message)

    def _send(self, rank: int, conn: Connection, header: Dict[str, Any], payload: Any) -> None:
        self._send_frames(rank, conn, protocol.encode(header, payload))

    def _send_frames(self, rank: int, conn: Connection, frames: List[Union[bytes, memoryview]]) -> None:
        try:
            protocol.send_frames(conn, frames)
        except OSError:
            self._check_processes()
            self._fail(f"deployed model: cannot reach worker rank {rank} (pid {self.procs[rank].pid})")

    def _collect(self, timeout_s: Optional[float], what: str, device: Optional[torch.device] = None,
                 ranks: Optional[List[int]] = None) -> List[Any]:
        """Every rank's (or `ranks`') reply; raises the first error a rank reported, or WorkerError when one died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {r: c for r, c in enumerate(self.conns) if ranks is None or r in ranks}
        replies: Dict[int, Any] = {}
        errors: Dict[int, Dict[str, Any]] = {}
        while pending:
            for conn in wait(list(pending.values()), timeout=POLL_S):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    header, payload = protocol.recv(cast(Connection, conn), device)  # wait() returns what it was given
                except (EOFError, OSError):
                    del pending[rank]
                    self._check_processes()
                    self._fail(f"deployed model: worker rank {rank} (pid {self.procs[rank].pid}) closed its socket "
                               f"while {what}")
                del pending[rank]
                self._owed.discard(rank)
                if header.get("ok"):
                    replies[rank] = payload
                else:
                    errors[rank] = header
            self._check_processes()
            if deadline is not None and time.monotonic() > deadline and pending:
                self._fail(f"deployed model: ranks {sorted(pending)} did not finish {what} within {timeout_s} s")
        if errors:
            rank, header = min(errors.items())
            if what == "building the model":
                self._broken = f"deployed model: rank {rank} failed while {what}: {header['error']}"
                raise WorkerError(f"{self._broken}\n{header.get('traceback', '')}")
            raise _rebuild_error(rank, header)
        return [replies[r] for r in sorted(replies)]


def _rebuild_error(rank: int, header: Dict[str, Any]) -> Exception:
    """The worker's exception as the same builtin type (ValueError stays ValueError), with its traceback."""
    name, _, message = header["error"].partition(": ")
    cls = getattr(builtins, name, None)
    text = f"{message} (raised by deployed rank {rank}; worker traceback:\n{header.get('traceback', '')})"
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:  # noqa: BLE001 - an exception type with another signature
            pass
    return RuntimeError(f"{header['error']} {text}")


def _first_tensor_device(args: Any, kwargs: Dict[str, Any]) -> torch.device:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _refuse_stop_strings(kwargs: Dict[str, Any]) -> None:
    """ValueError for `stop_strings` (as an argument or in a generation_config) and `tokenizer`: transformers' stop
    strings need the tokenizer object in every worker, and a tokenizer cannot be sent to them."""
    gc = kwargs.get("generation_config")
    in_config = gc.get("stop_strings") if isinstance(gc, dict) else getattr(gc, "stop_strings", None)
    for name, value in (("stop_strings", kwargs.get("stop_strings")), ("generation_config.stop_strings", in_config),
                        ("tokenizer", kwargs.get("tokenizer"))):
        if value is not None:
            raise ValueError(f"deployed model: generate({name}=...) is not supported: stop strings need the "
                             "tokenizer object in the workers, which cannot be sent to them; stop on token ids "
                             "instead with eos_token_id=<a token id or a list of them> (e.g. the ids your tokenizer "
                             "gives the stop text)")


class DeployedModel:
    """Stands in for the deployed model: `generate`, `__call__`/`forward` and `config` as on the model.

    Tensors go in and come out on the caller's device (that of the first tensor argument).
    Calls are serialized: concurrent threads each get their own complete answer, one after
    the other. `generate(..., fused_no_repeat_ngram_blocking=True)` uses atorch's vectorized
    n-gram blocking. Sampling draws one seed from the caller's torch RNG per call, so every
    rank samples the same tokens and `torch.manual_seed` in the caller makes it repeatable.
    `stop_strings` (and `tokenizer`) are refused with a ValueError: the workers have no tokenizer
    object; stop on token ids with `eos_token_id` instead.
    """

    def __init__(self, workers: WorkerGroup, config: Any, tensor_parallel_size: int,
                 generation_config: Any = None) -> None:
        self._workers = workers
        self.config = config
        self.tensor_parallel_size = tensor_parallel_size
        # The workers' models' defaults (a folder's generation_config.json); None: from `config`, on first use.
        self._generation_config: Any = generation_config

    @property
    def generation_config(self) -> Any:
        if self._generation_config is None:
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_model_config(self.config)
        return self._generation_config

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_stop_strings(kwargs)
        gc = kwargs.get("generation_config")
        if gc is not None and hasattr(gc, "to_dict"):
            kwargs["generation_config"] = gc.to_dict()
        do_sample = kwargs.get("do_sample", getattr(gc, "do_sample", None) or self.generation_config.do_sample)
        seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if do_sample else None
        return self._workers.request("generate", {"args": list(args), "kwargs": kwargs}, seed,
                                     _first_tensor_device(args, kwargs))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._workers.request("forward", {"args": list(args), "kwargs": kwargs}, None,
                                     _first_tensor_device(args, kwargs))

    __call__ = forward

    @property
    def worker_pids(self) -> List[int]:
        return self._workers.pids

    def is_alive(self) -> bool:
        return self._workers.alive()

    def close(self) -> None:
        self._workers.close()

    def __enter__(self) -> "DeployedModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else "closed"
        return (f"DeployedModel({type(self.config).__name__}, tensor_parallel_size={self.tensor_parallel_size}, "
                f"{state}, pids={self.worker_pids})")
