"""Asynchronous checkpoint saving: training blocks only while the state is copied to host memory.

`save_checkpoint(..., async_save=True)` calls `stage()` in the foreground (a copy of every
tensor into host buffers that this module keeps and reuses from one save to the next), then
hands the rest of the save (DCP write, fsync, checksums, manifest, atomic rename, `latest`,
rotation) to `AsyncCheckpointer.submit`, which runs it on one background thread.

Why our own staging and thread rather than `torch.distributed.checkpoint.async_save`:
  * the background part is more than the DCP write: the manifest, the rename and `latest` must
    follow it (the crash-safety protocol of manifest.py), and a background thread of our own
    runs it as one unit, with one error to re-raise;
  * DCP's async path has changed its API across the torch versions atorch supports (>= 2.4:
    staging options, `AsyncCheckpointerType`, the returned future), while `dcp.save` with an
    explicit `process_group` is stable;
  * every collective of the background part runs on a process group of its own, a gloo group
    made once (in the foreground, where all ranks call `new_group` in the same order). Gloo
    works for host tensors under both a gloo (CPU) and an nccl (GPU) default group, and a
    separate group means the background barrier / gather never interleave with the training
    step's collectives on the default group (two threads on one group would deadlock or
    mismatch).
The staged copies are plain host tensors (DTensors keep their mesh and placements around a
host local shard), so the training step may change the live parameters at once.

One save runs at a time: `submit` (and every synchronous save or load) first waits for the
previous one. The foreground copy is voted on (`agree_on_error` on the default vote group) before
anything is submitted: a rank that cannot stage its tensors makes `save_checkpoint` raise on every
rank, and no rank starts a background part. Each local step of the background part ends in a
vote on the background group (`agree_on_error(..., group=)`), so a failure on one rank ends
every rank's background part at once with the same error naming that rank, never a wait for the
collective timeout. Either way rank 0 removes the failed save's staging directory. A background
error is raised by the next `wait()`, which the next save or load calls; call
`wait_for_checkpoint()` before `destroy_process_group()` or exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Callable, Dict, Optional, cast

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


class AsyncCheckpointer:
    """Host staging buffers, the background gloo group and the one background save in flight."""

    def __init__(self) -> None:
        self._buffers: Dict[str, torch.Tensor] = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._group: Optional[dist.ProcessGroup] = None
        self._group_of: Optional[dist.ProcessGroup] = None  # the default group the background group was made for

    # -- foreground --------------------------------------------------------------------

    def background_group(self) -> Optional[dist.ProcessGroup]:
        """The gloo group background collectives use (None without a process group).

        Collective: the first call on each rank must happen in the same order on every rank,
        which `save_checkpoint` guarantees by calling it in its foreground part, after comparing
        `async_save` across ranks (a rank alone in `new_group` would wait for the others forever).
        """
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:
            self._group = dist.new_group(backend="gloo")
            self._group_of = world
        return self._group

    def stage(self, tensors: Dict[str, Any]) -> Dict[str, Any]:
        """Host copies of `tensors` in reused buffers (the only part of an async save training waits for)."""
        self.wait()  # the previous save still reads the buffers
        staged: Dict[str, Any] = {}
        live = set()
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                staged[key] = value
                continue
            live.add(key)
            if _is_dtensor(value):
                from torch.distributed.tensor import DTensor

                dtensor = cast(DTensor, value)
                local = self._copy(key, dtensor.to_local())
                staged[key] = DTensor.from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False,
                                                 shape=dtensor.shape, stride=dtensor.stride())
            else:
                staged[key] = self._copy(key, value)
        for key in set(self._buffers) - live:  # a tensor the model no longer has
            del self._buffers[key]
        return staged

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            # Pinned memory makes the device-to-host copy of a GPU tensor asynchronous and fast.
            pin = src.is_cuda
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` (the write-and-commit part of a save) on the background thread."""
        self.wait()
        if any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()  # the non_blocking copies into the pinned buffers are done

        def run() -> None:
            try:
                work()
            except BaseException as e:  # re-raised in the training thread by wait()
                logger.error("background checkpoint save failed: %s", e)
                self._error = e

        # Not a daemon: an interpreter that exits normally finishes the save in flight first.
        self._thread = threading.Thread(target=run, name="atorch-checkpoint-save", daemon=False)
        self._thread.start()

    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def release(self) -> None:
        """Wait, then free the host staging buffers (they hold a copy of the whole local state)."""
        self.wait()
        self._buffers.clear()


_CHECKPOINTER = AsyncCheckpointer()


def checkpointer() -> AsyncCheckpointer:
    """The process's one async checkpointer (one save in flight per process)."""
    return _CHECKPOINTER


def wait_for_checkpoint() -> None:
    """Block until this process's asynchronous save (if any) is on disk and committed.

    Raises the background save's error, if it failed. Call on every rank before
    `destroy_process_group()` and at the end of training.
    """
    _CHECKPOINTER.wait()


def _wait_at_exit() -> None:
    try:
        _CHECKPOINTER.wait()
    except BaseException as e:  # nothing to raise to at exit; the previous checkpoint stays `latest`
        logger.error("the last asynchronous checkpoint save failed: %s", e)


atexit.register(_wait_at_exit)
