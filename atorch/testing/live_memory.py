"""Bytes of tensors still reachable from Python: what a finished candidate must not leave behind.

Used by `tests/distributed/test_dry_run_sequence.py` and `benchmarks/dry_run_memory_release.py`
to see a dry run that keeps its model or optimizer state alive (the allocator's RSS cannot: it
keeps freed memory).
"""

from __future__ import annotations

import gc

import torch


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the distinct storages of every tensor on `device_type` Python can reach, after a gc."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
