"""Shard any sampler across data-parallel ranks, and a DataLoader that never runs out.

`torch.utils.data.DistributedSampler` only shards `range(len(dataset))`; the proxy shards the
output of an arbitrary sampler (weighted, grouped by length, ...) the same way.
"""

from __future__ import annotations

import collections.abc
import itertools
import math
import warnings
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Sampler

from atorch import distributed as adist
from atorch.data.indexed_dataset import is_int


class WholeStepsSampler(Sampler):
    """The first indices of `sampler` that fill whole steps of `step` samples; the rest of each epoch is left out.

    For a loader whose items are micro-batches of which an engine takes a fixed number per optimizer step
    (DeepSpeed 3D's `train_batch` pulls gradient_accumulation_steps of them): an epoch ending mid-step would leave
    the engine without its last micro-batches on some stages. Everything else (`set_epoch`, `epoch`,
    `num_replicas`, ...) is the wrapped sampler's, so resuming and `set_epoch` see through it.
    """

    def __init__(self, sampler: Any, step: int) -> None:
        self.sampler = sampler
        self.step = int(step)

    def __len__(self) -> int:
        return len(self.sampler) // self.step * self.step

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), len(self))

    def __getattr__(self, name: str) -> Any:
        if name in ("sampler", "step"):   # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


class DistributedProxySampler(Sampler):
    """Each rank gets every `num_replicas`-th position of the wrapped sampler's output.

    Per epoch, the positions of `sampler`'s output are optionally permuted (by `seed + epoch`,
    the same on every rank), then rank r takes positions r, r + num_replicas, ... Every
    position goes to exactly one rank. With `drop_last=False` the list is padded by repeating
    its start so every rank has `ceil(len / num_replicas)` items (the `padding` positions are
    the only ones seen twice); with `drop_last=True` the last `len % num_replicas` are dropped.

    The wrapped sampler must yield the same sequence on every rank (seed its generator);
    its `set_epoch` is called too. It is read again every epoch, so it must be re-iterable (a
    Sampler, list or range; not a one-shot iterator). One without `len()` is counted as it is
    read; only `len()` of the proxy (and of a DataLoader over it) then raises.
    """

    def __init__(self, sampler: Any, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        num_replicas = adist.world_size() if num_replicas is None else num_replicas
        rank = adist.rank() if rank is None else rank
        # Checked here, not at the first epoch: a float rank or count used to fail only inside __iter__
        # ("slice indices must be integers"), a str with a bare TypeError.
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if not is_int(value):
                raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if isinstance(sampler, collections.abc.Iterator):
            # Its first epoch would consume it, and every later epoch would be empty.
            raise ValueError(f"sampler is a one-shot iterator ({type(sampler).__name__}), but it is read again every "
                             "epoch; pass something re-iterable: the list or range itself, or a torch Sampler")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is outside [0, num_replicas={num_replicas})")
        self.sampler = sampler
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self._warn_if_every_rank_is_empty()

    def _warn_if_every_rank_is_empty(self) -> None:
        # As torch's DistributedSampler, an empty epoch is not an error (the wrapped sampler may grow, and
        # InfiniteDataLoader refuses a loader without batches); but say so where it is set up.
        try:
            n = len(self.sampler)
        except TypeError:  # no len(): counted as each epoch is read
            return
        if self.drop_last and 0 < n < self.num_replicas:
            warnings.warn(f"DistributedProxySampler: drop_last=True with {n} samples over num_replicas="
                          f"{self.num_replicas} ranks drops them all; every rank gets 0 samples per epoch "
                          "(pass drop_last=False to pad instead)", stacklevel=3)

    def _sampler_len(self) -> int:
        try:
            return len(self.sampler)
        except TypeError:
            raise TypeError(f"DistributedProxySampler: the wrapped sampler ({type(self.sampler).__name__}) has no "
                            "len(), so the samples per rank are known only once an epoch is read; give it __len__ "
                            "(len() of the proxy and of a DataLoader over it need it)") from None

    def _per_rank(self, n: int) -> int:
        return n // self.num_replicas if self.drop_last else math.ceil(n / self.num_replicas)

    @property
    def num_samples(self) -> int:
        """Items per rank per epoch."""
        return self._per_rank(self._sampler_len())

    @property
    def padding(self) -> int:
        """Positions repeated per epoch to even out the ranks (0 with drop_last)."""
        return 0 if self.drop_last else self.num_samples * self.num_replicas - self._sampler_len()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[Any]:
        items: List[Any] = list(self.sampler)
        try:
            expected: Optional[int] = len(self.sampler)
        except TypeError:  # no len(): the epoch is what it yields (the same on every rank)
            expected = None
        if expected is not None and len(items) != expected:
            raise ValueError(f"wrapped sampler yielded {len(items)} items but its len() is {expected}")
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            items = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]
        total = self._per_rank(len(items)) * self.num_replicas
        if total > len(items):
            repeats = math.ceil((total - len(items)) / max(len(items), 1))
            items = items + (items * repeats)[: total - len(items)]
        return iter(items[self.rank:total:self.num_replicas])


class InfiniteDataLoader:
    """Iterates `dataloader` forever; before each pass, `set_epoch(epoch)` on its samplers.

    `epoch` counts the passes started, from `start_epoch`. Raises ValueError if a pass yields
    no batch (an empty dataloader would otherwise loop forever).
    """

    def __init__(self, dataloader: DataLoader, start_epoch: int = 0) -> None:
        self.dataloader = dataloader
        self.epoch = start_epoch - 1
        self._iterator: Optional[Iterator[Any]] = None

    def _samplers(self) -> List[Any]:
        found: List[Any] = []
        batch_sampler = getattr(self.dataloader, "batch_sampler", None)
        for candidate in (getattr(self.dataloader, "sampler", None), batch_sampler,
                          getattr(batch_sampler, "sampler", None)):
            if hasattr(candidate, "set_epoch") and all(candidate is not f for f in found):
                found.append(candidate)
        return found

    def _passes(self) -> Iterator[Any]:
        while True:
            self.epoch += 1
            for sampler in self._samplers():
                sampler.set_epoch(self.epoch)
            empty = True
            for batch in self.dataloader:
                empty = False
                yield batch
            if empty:
                raise ValueError(f"dataloader yielded no batch in epoch {self.epoch}; it cannot be repeated forever")

    def __iter__(self) -> "InfiniteDataLoader":
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._passes()
        return next(self._iterator)


# Set on a sampler by `record_set_epoch`: whether its set_epoch has been called since it was built.
SET_EPOCH_CALLED = "_atorch_set_epoch_called"


def record_set_epoch(sampler: Any) -> Any:
    """Make `sampler` remember whether its `set_epoch` was ever called (`SET_EPOCH_CALLED`); returns it.

    A checkpoint saved right after an epoch's last batch must tell a loop that sets the sampler to
    each epoch (the resume starts the next epoch in the order `set_epoch(epoch + 1)` gives) from one
    that never does (every pass in epoch 0's order): both show epoch 0 at the first boundary. The
    instance's own `set_epoch` wraps the class's, so subclasses and user samplers are covered alike.
    """
    method = getattr(sampler, "set_epoch", None)
    if method is None or getattr(sampler, SET_EPOCH_CALLED, None) is not None:
        return sampler

    def set_epoch(epoch: int) -> None:
        setattr(sampler, SET_EPOCH_CALLED, True)
        method(epoch)

    try:
        sampler.set_epoch = set_epoch
        setattr(sampler, SET_EPOCH_CALLED, False)
    except AttributeError:   # __slots__ or a read-only attribute: assumed set, as any unmarked sampler
        pass
    return sampler
