"""Per-process peak tensor memory, on CPU as on GPU, with an optional simulated device limit.

GPU: the caching allocator's high-water mark (`torch.cuda.max_memory_allocated`). CPU has no
such counter, and the process RSS is useless for small models (the runtime alone is hundreds
of MB and `ru_maxrss` never goes down), so on CPU a `TorchDispatchMode` counts the bytes of every
tensor storage created while it is active and subtracts them when the storage is freed. Checked
against the CPU allocator's own accounting (`torch.profiler` with `profile_memory=True`) on a
tiny Llama training step: the two peaks agree to within a few bytes. What it does not see:
allocations that never become a tensor (a kernel's private workspace, gloo's socket buffers)
and tensors created before it started.

`memory_limit_bytes` makes the out-of-memory path real on a machine with plenty of memory: the
allocation that crosses the limit raises `torch.OutOfMemoryError` on that rank, exactly where
a device would have failed.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """Raised by `PeakMemoryTracker` when live tensor bytes cross the simulated device limit."""


_ACTIVE_COUNTERS: List["_StorageCounter"] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _counting_resize(storage: torch.UntypedStorage, size: int) -> Any:
    out = _ORIGINAL_RESIZE(storage, size)
    for counter in _ACTIVE_COUNTERS:
        counter.resized(storage)
    return out


def _patch_storage_resize() -> None:
    """`UntypedStorage.resize_` on CPU bypasses the dispatcher, so a dispatch mode cannot see it;
    FSDP2 frees its gathered parameters with `resize_(0)`. Counting it keeps the live bytes true."""
    if torch.UntypedStorage.resize_ is not _counting_resize:
        # Deliberately patching torch's method while a counter is active (`_unpatch_storage_resize`
        # puts the original back when the last one exits).
        torch.UntypedStorage.resize_ = _counting_resize  # type: ignore[method-assign,assignment]


def _unpatch_storage_resize() -> None:
    """Torch's own `UntypedStorage.resize_` again once no counter is active (left alone if another
    library patched it over ours meanwhile: that patch calls ours, which then counts nothing)."""
    if not _ACTIVE_COUNTERS and torch.UntypedStorage.resize_ is _counting_resize:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


class _StorageCounter(TorchDispatchMode):
    """Counts live bytes of storages created by ops run under it; raises past `limit`."""

    def __init__(self, limit: Optional[int]) -> None:
        super().__init__()
        self.limit = limit
        self.live = 0
        self.peak = 0
        # storage identity (its StorageImpl address, shared by views) -> bytes counted for it now
        self._sizes: Dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.limit is not None and self.live > self.limit:
            raise SimulatedOutOfMemoryError(
                f"out of memory: {self.live} bytes of tensors live > simulated device memory limit "
                f"{self.limit} bytes (ATORCH_DEVICE_MEMORY_LIMIT)")

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A counted storage changed size in place (FSDP2 frees and re-allocates its buffers this way)."""
        key = storage._cdata
        if key in self._sizes:
            old, new = self._sizes[key], storage.nbytes()
            self._sizes[key] = new
            self.live -= old
            self._add(new)

    def __enter__(self) -> "_StorageCounter":
        _ACTIVE_COUNTERS.append(self)
        _patch_storage_resize()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _ACTIVE_COUNTERS.remove(self)
            _unpatch_storage_resize()

    def _count(self, tensor: torch.Tensor, inputs: Set[Optional[int]]) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # DTensor and friends own no storage; their inner (local) tensors do.
            for inner in _inner_tensors(tensor):
                self._count(inner, inputs)
            return
        if _storage_key(tensor) in inputs:
            return   # an in-place result or a view of an input's (inner) storage: nothing was allocated
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or opaque tensors
            return
        nbytes = storage.nbytes()
        key = storage._cdata
        if nbytes == 0 or storage.data_ptr() == 0 or key in self._sizes:
            return
        self._sizes[key] = nbytes
        # The storage's Python object lives exactly as long as the storage (PyObject preservation),
        # so the finalizer runs when the memory goes back to the allocator.
        weakref.finalize(storage, self._release, key)
        self._add(nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: nothing was allocated. Counting
        # them would count a storage created before entry (a parameter `.t()` in a linear; the
        # local shard under a DTensor that an in-place `addcdiv_` returns: per-tensor AdamW on
        # FSDP2 shards read as 3 kept copies of every shard that were never allocated).
        inputs: Set[Optional[int]] = set()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                inputs.update(_storage_keys(t))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf, inputs)
        return out


def _inner_tensors(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a wrapper subclass (DTensor and friends) holds, which own its storage."""
    attrs, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # on wrapper subclasses only
    return [inner for inner in (getattr(tensor, attr) for attr in attrs) if isinstance(inner, torch.Tensor)]


def _storage_keys(tensor: torch.Tensor) -> Set[Optional[int]]:
    """The storage identities of a tensor, or of the inner tensors of a wrapper subclass."""
    if is_traceable_wrapper_subclass(tensor):
        return set().union(*(_storage_keys(inner) for inner in _inner_tensors(tensor)))
    return {_storage_key(tensor)}


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    """The identity of a plain tensor's storage (None for wrapper subclasses and opaque tensors)."""
    if is_traceable_wrapper_subclass(tensor) or tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class PeakMemoryTracker:
    """Context manager measuring the peak tensor bytes allocated inside it on `device`.

    `peak_bytes` is relative to entry: tensors that existed before are not counted. On CPU it
    is exact for tensor storages (see the module docstring); on CUDA it is the allocator's
    high-water mark minus what was allocated at entry. With `memory_limit_bytes`, crossing the
    limit raises `torch.OutOfMemoryError` (CPU: at the allocation; CUDA: through the allocator's
    per-process memory fraction).
    """

    def __init__(self, device: torch.device, memory_limit_bytes: Optional[int] = None) -> None:
        self.device = torch.device(device)
        self.memory_limit_bytes = memory_limit_bytes
        self._counter: Optional[_StorageCounter] = None
        self._cuda_base = 0
        self._cuda_fraction: Optional[float] = None
        self.peak_bytes = 0

    def __enter__(self) -> "PeakMemoryTracker":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            if self.memory_limit_bytes is not None:
                total = torch.cuda.get_device_properties(self.device).total_memory
                self._cuda_fraction = min(1.0, (self._cuda_base + self.memory_limit_bytes) / total)
                torch.cuda.set_per_process_memory_fraction(self._cuda_fraction, self.device)
        else:
            self._counter = _StorageCounter(self.memory_limit_bytes)
            self._counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._counter is not None:
            self._counter.__exit__(*exc)
            self.peak_bytes = self._counter.peak
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
            if self._cuda_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    @property
    def live_bytes(self) -> int:
        """Bytes of tensors created inside the context and still alive (CPU; CUDA: allocated minus entry)."""
        if self._counter is not None:
            return self._counter.live
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._cuda_base
        return 0

    @property
    def current_peak_bytes(self) -> int:
        """The peak so far, readable inside the context (CPU and CUDA)."""
        if self._counter is not None:
            return self._counter.peak
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        return self.peak_bytes


# How an allocation failure reads when it does not come as torch.OutOfMemoryError: the CPU
# allocator's RuntimeError, CUDA's own wording re-wrapped by DeepSpeed or NCCL, and the CUDA
# libraries' status codes (a cuBLAS/cuDNN handle or workspace that cannot be allocated on a full
# device fails with *_ALLOC_FAILED, the usual first symptom of a device out of memory).
_OOM_MARKERS = ("out of memory", "outofmemory", "defaultcpuallocator: can't allocate memory", "alloc_failed",
                "cudaerrormemoryallocation")


def mentions_out_of_memory(text: str) -> bool:
    """Whether an error message says an allocation failed (see _OOM_MARKERS)."""
    lowered = text.lower()
    return any(marker in lowered for marker in _OOM_MARKERS)


def is_out_of_memory(error: BaseException) -> bool:
    """True for a device or host out-of-memory error, simulated or real."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and mentions_out_of_memory(str(error))
