"""Mix several datasets in fixed proportions, deterministically and evenly over every window.

Random sampling by weight drifts (a 1000-sample window of a 10% dataset holds 100 +- 9
samples); a deterministic low-discrepancy schedule keeps every dataset within a sample or
two of its share at every point of the stream.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Dataset

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def blend_schedule(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Which dataset (and which of its samples) fills each of `size` slots.

    Error feedback in closed form: dataset d's k-th sample (k = 0, 1, ...) is due at time
    (k + phase_d) / w_d, and slots take samples in order of due time, so the dataset furthest
    behind its share goes next. The phases (golden-ratio steps in [0, 1)) keep datasets of equal
    weight from coming due together, which would bunch them into runs. After n slots, dataset d
    holds c_d samples with |c_d - w_d * n| < 1 + w_d * K (K datasets with weight > 0), so over a
    window of W slots its share is within 2 (1 + w_d * K) / W of w_d: 1% at W = 1000 is
    guaranteed while w_d * K <= 4, and measured worst windows stay under 0.4% for up to 100
    datasets (tests/unit/test_data_blender.py). Vectorized, O(size log size): unlike a per-sample
    largest-deficit loop (~1.3 us per sample and dataset in Python), it blends 10M samples in seconds.

    Returns (dataset_index[size], sample_index[size]); sample_index counts per dataset from 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not (w.ndim == 1 and w.size and np.all(np.isfinite(w)) and np.all(w >= 0) and w.max() > 0):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    with np.errstate(over="ignore"):
        total = w.sum()
    w = w / total if np.isfinite(total) else np.asarray(_normalized(w.tolist()))
    times, datasets, samples = [], [], []
    for d, weight in enumerate(w):
        if weight == 0:
            continue
        # More than the largest count the bound above allows within `size` slots.
        k = np.arange(math.ceil(weight * size) + len(w) + 2, dtype=np.int64)
        times.append((k + (0.5 + d * _GOLDEN) % 1.0) / weight)
        datasets.append(np.full(k.size, d, dtype=np.int32))
        samples.append(k)
    time, dataset, sample = np.concatenate(times), np.concatenate(datasets), np.concatenate(samples)
    order = np.lexsort((dataset, time))[:size]  # ties go to the lower dataset index
    return dataset[order], sample[order]


def _normalized(weights: Sequence[float]) -> List[float]:
    """Finite weights >= 0, not all 0, scaled to sum to 1. When their sum overflows ([1e308, 1e308] sums
    to inf, which made every share 0), they are divided by their maximum first."""
    total = sum(weights)
    if not math.isfinite(total):
        weights = [w / max(weights) for w in weights]
        total = sum(weights)
    return [w / total for w in weights]


def _as_number(weight: Any) -> Any:
    """A 0-d tensor or array (`torch.tensor([.25, .75])[0]`, `np.array(.5)`) as the Python number it holds."""
    if getattr(weight, "ndim", None) == 0 and hasattr(weight, "item"):
        return weight.item()
    return weight


class DatasetBlender(Dataset):
    """A dataset whose items come from `datasets` in the proportions `weights`.

    Args:
        datasets: map-style datasets (with `len`).
        weights: one non-negative weight per dataset (numbers, or a 1-d tensor or array of them),
            normalized to sum to 1. Default: each dataset's length, so every sample appears once.
        size: number of blended samples; default the sum of the dataset lengths. A dataset
            asked for more samples than it has wraps around (starts its next epoch, in the same
            order: sample k is its item k % len), with a warning saying how many times it is read.

    The order is fixed by the weights alone (see `blend_schedule`); shuffle with the sampler.
    """

    def __init__(self, datasets: Sequence[Any], weights: Optional[Sequence[float]] = None,
                 size: Optional[int] = None) -> None:
        self.datasets: List[Any] = list(datasets)
        if not self.datasets:
            raise ValueError("datasets is empty; pass at least one dataset to blend")
        lengths = [len(d) for d in self.datasets]
        if weights is None:
            weights = [float(n) for n in lengths]
            if sum(weights) == 0:
                raise ValueError(f"all {len(lengths)} datasets are empty")
        # A tensor or array of weights, or 0-d tensors in a list, count as the numbers they hold.
        weights = [_as_number(w) for w in weights]
        if len(weights) != len(self.datasets):
            raise ValueError(f"weights has {len(weights)} entries but {len(self.datasets)} datasets were given")
        for i, (weight, length) in enumerate(zip(weights, lengths)):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ValueError(f"weights[{i}]={weight!r}; every weight must be a finite number >= 0, not a "
                                 f"{type(weight).__name__}")
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weights[{i}]={weight!r}; every weight must be a finite number >= 0")
            if weight > 0 and length == 0:
                raise ValueError(f"datasets[{i}] is empty but has weight {weight}")
        if max(weights) <= 0:
            raise ValueError("weights sum to 0; at least one must be > 0")
        self.weights = _normalized([float(w) for w in weights])
        if not (all(map(math.isfinite, self.weights)) and sum(self.weights) > 0):  # not expected: say which input
            raise ValueError(f"weights {weights} cannot be normalized to sum to 1 (got {self.weights})")
        if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral)):
            raise ValueError(f"size={size!r} must be an int (the number of blended samples) or None")
        self.size = sum(lengths) if size is None else int(size)
        self.dataset_index, self.sample_index = blend_schedule(self.weights, self.size)
        self._lengths = lengths
        self._warn_about_repeats()

    def _warn_about_repeats(self) -> None:
        """Warn when some dataset is read more than once: its samples then repeat, which a size or
        weights chosen for one pass (weights=[1, 0] with the default size, the sum of all lengths) hide."""
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        repeated = [f"datasets[{d}] {counts[d] / n:.2f} times ({counts[d]} samples of its {n})"
                    for d, n in enumerate(self._lengths) if counts[d] > n]
        if not repeated:
            return
        more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        # The largest size that reads no weighted dataset more than once, give or take the schedule's 1 + w * K.
        once = min(n / w for n, w in zip(self._lengths, self.weights) if w > 0)
        shares = ", ".join(f"{w:.3g}" for w in self.weights)
        warnings.warn(f"DatasetBlender: size={self.size} with weights [{shares}] reads "
                      f"{', '.join(repeated[:5])}{more}; those samples repeat in the same order. Pass size <= about "
                      f"{int(once)} (or other weights) to read each dataset at most once", stacklevel=3)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        try:
            index = operator.index(index)  # ints, numpy integers, 0-d integer tensors
        except TypeError:
            raise TypeError(f"DatasetBlender index must be an int, got {type(index).__name__} {index!r}") from None
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} blended samples")
        d = int(self.dataset_index[index])
        return self.datasets[d][int(self.sample_index[index]) % self._lengths[d]]
