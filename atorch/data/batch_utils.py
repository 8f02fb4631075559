"""Batch helpers at ATorch's `atorch.data` import path: `data_to_device` and `expand_batch_dim`."""

from __future__ import annotations

from typing import Any

from atorch.common.util_func import apply_to_tensors, data_to_device

__all__ = ["data_to_device", "expand_batch_dim"]


def expand_batch_dim(data: Any, batch_size: int = 1) -> Any:
    """Every tensor of `data` with a new leading batch dimension of `batch_size` (a view, no copy).

    Turns one sample into a batch, e.g. a sample from a dataset into the `sample_batch` a
    planner dry-runs; every row of the result is the same sample.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"expand_batch_dim: batch_size={batch_size!r} must be an integer >= 1")
    return apply_to_tensors(lambda t: t.unsqueeze(0).expand(batch_size, *t.shape), data)
