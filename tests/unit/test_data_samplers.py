"""DistributedProxySampler coverage (no index twice, none missing) and InfiniteDataLoader, in one process."""

import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler,
                              WeightedRandomSampler)

from atorch.data import DistributedProxySampler, InfiniteDataLoader


def shards(sampler_factory, n_replicas, **kwargs):
    return [list(DistributedProxySampler(sampler_factory(), n_replicas, r, **kwargs)) for r in range(n_replicas)]


@pytest.mark.filterwarnings("ignore:DistributedProxySampler.*drops them all")  # n < replicas with drop_last
@pytest.mark.parametrize("n", [0, 1, 7, 12, 100])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_on_exactly_one_rank(n, replicas, shuffle):
    parts = shards(lambda: SequentialSampler(range(n)), replicas, shuffle=shuffle)
    sampler = DistributedProxySampler(SequentialSampler(range(n)), replicas, 0, shuffle=shuffle)
    assert all(len(p) == len(sampler) == -(-n // replicas) for p in parts)
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(n))  # none missing
    # Repeated only to even out the ranks, exactly `padding` of them.
    assert sum(counts.values()) - n == sampler.padding == len(sampler) * replicas - n
    if n % replicas == 0:
        assert max(counts.values(), default=1) == 1  # no index twice
    if not shuffle:
        assert parts[0][:2] == list(range(n))[: 2 * replicas:replicas][:2]
    # drop_last: no index twice, and only the remainder missing.
    dropped = shards(lambda: SequentialSampler(range(n)), replicas, shuffle=shuffle, drop_last=True)
    flat = [i for p in dropped for i in p]
    assert len(flat) == len(set(flat)) == n - n % replicas
    assert all(len(p) == n // replicas for p in dropped)


def test_epochs_reshuffle_deterministically_and_reach_the_wrapped_sampler():
    class EpochSampler(SequentialSampler):
        epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    inner = EpochSampler(range(50))
    a = DistributedProxySampler(inner, 2, 0, seed=5)
    b = DistributedProxySampler(SequentialSampler(range(50)), 2, 1, seed=5)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a)
    assert first != second and sorted(second + list(b)) == list(range(50))
    a.set_epoch(0)
    assert list(a) == first
    assert inner.epochs == [1, 0]


def test_wraps_any_sampler():
    # A weighted sampler with replacement: positions are sharded, so ranks share its exact draws.
    def weighted():
        return WeightedRandomSampler([0.1, 0.9, 0.5], 40, generator=torch.Generator().manual_seed(0))

    draws = list(weighted())
    parts = shards(weighted, 4, shuffle=False)
    assert [parts[i % 4][i // 4] for i in range(40)] == draws
    # A batch sampler: whole batches are sharded.
    batches = shards(lambda: BatchSampler(SequentialSampler(range(10)), 3, drop_last=False), 2, shuffle=False)
    assert batches == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, num_replicas=2\)"):
        DistributedProxySampler(SequentialSampler(range(4)), 2, 2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        DistributedProxySampler(SequentialSampler(range(4)), 0, 0)
    # Without a process group: a world of one.
    assert len(DistributedProxySampler(SequentialSampler(range(4)))) == 4

    class Lying(SequentialSampler):
        def __len__(self):
            return 5

    with pytest.raises(ValueError, match="yielded 4 items but its len"):
        list(DistributedProxySampler(Lying(range(4)), 1, 0))


def test_infinite_dataloader_repeats_and_advances_epochs():
    sampler = DistributedProxySampler(SequentialSampler(range(6)), 2, 1, seed=0)
    loader = InfiniteDataLoader(DataLoader(list(range(6)), batch_size=2, sampler=sampler))
    batches = [next(loader).tolist() for _ in range(7)]  # 2 batches per pass: 3 full passes and one more
    assert loader.epoch == 3 and sampler.epoch == 3
    passes = [sum(batches[i:i + 2], []) for i in range(0, 6, 2)]
    for epoch, items in enumerate(passes):
        sampler.set_epoch(epoch)
        assert items == list(sampler)
    assert passes[0] != passes[1] or passes[1] != passes[2]
    # A plain RandomSampler has no set_epoch; the loader still repeats.
    plain = InfiniteDataLoader(DataLoader(list(range(3)), sampler=RandomSampler(range(3))), start_epoch=5)
    seen = [int(b) for _, b in zip(range(9), plain)]
    assert Counter(seen) == {0: 3, 1: 3, 2: 3} and plain.epoch == 7


def test_infinite_dataloader_refuses_an_empty_loader():
    with pytest.raises(ValueError, match="yielded no batch in epoch 0"):
        next(InfiniteDataLoader(DataLoader([], batch_size=2)))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_replicas": 2.5}, "num_replicas must be an int, got float 2.5"),
    ({"num_replicas": "2"}, "num_replicas must be an int, got str '2'"),
    ({"num_replicas": True}, "num_replicas must be an int, got bool True"),
    ({"rank": 1.0}, "rank must be an int, got float 1.0"),
    ({"seed": "1"}, "seed must be an int, got str '1'"),
    ({"seed": 1.5}, "seed must be an int, got float 1.5"),
])
def test_argument_types_are_checked_at_construction(kwargs, message):
    # They failed only at the first epoch ("slice indices must be integers") or with a bare TypeError.
    args = {"num_replicas": 2, "rank": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        DistributedProxySampler(SequentialSampler(range(10)), **args)
    sampler = DistributedProxySampler(SequentialSampler(range(10)), np.int64(2), np.int64(1), seed=np.int32(3))
    assert type(sampler.num_replicas) is int and type(sampler.rank) is int and len(list(sampler)) == 5


def test_drop_last_that_empties_every_rank_warns():
    with pytest.warns(UserWarning, match="drop_last=True with 3 samples over num_replicas=5 ranks drops them all"):
        parts = shards(lambda: SequentialSampler(range(3)), 5, shuffle=False, drop_last=True)
    assert parts == [[]] * 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedProxySampler(SequentialSampler(range(3)), 5, 0, drop_last=False)  # padded: no warning
        DistributedProxySampler(SequentialSampler(range(5)), 5, 0, drop_last=True)


def test_a_sampler_without_len_is_counted_as_it_is_read_and_a_one_shot_iterator_is_refused():
    class NoLen(Sampler):
        """Re-iterable, with no __len__ (torch's Sampler defines none)."""

        def __iter__(self):
            return iter(range(5))

    for drop_last, per_rank in ((False, 3), (True, 2)):
        proxies = [DistributedProxySampler(NoLen(), 2, r, shuffle=False, drop_last=drop_last) for r in range(2)]
        for epoch in range(2):   # every epoch reads it again
            for p in proxies:
                p.set_epoch(epoch)
            parts = [list(p) for p in proxies]
            assert [len(p) for p in parts] == [per_rank] * 2
            assert set(parts[0] + parts[1]) == set(range(2 * per_rank if drop_last else 5))
    # It failed with a bare "object of type 'range_iterator' has no len()" at iteration.
    with pytest.raises(TypeError, match=r"wrapped sampler \(NoLen\) has no len\(\).*give it __len__"):
        len(proxies[0])
    with pytest.raises(ValueError, match=r"sampler is a one-shot iterator \(range_iterator\).*read again every "
                                         r"epoch; pass something re-iterable"):
        DistributedProxySampler(iter(range(4)), 2, 0)


def test_auto_accelerate_refuses_the_proxy_as_distributed_sampler_cls_and_the_suggested_wrapper_works():
    from atorch.auto.compat import check_sampler_cls

    # It passed the parameter-name check, then got the dataset as its sampler and failed at the first batch
    # ("'<=' not supported between instances of 'int' and 'dict'").
    with pytest.raises(ValueError, match=r"distributed_sampler_cls DistributedProxySampler wraps a sampler.*"
                                         r"lambda dataset, \*\*kw: DistributedProxySampler\(MySampler\(dataset\)"):
        check_sampler_cls(DistributedProxySampler)

    class Subclass(DistributedProxySampler):
        pass

    def own(sampler, num_replicas=None, rank=None):
        return DistributedProxySampler(sampler, num_replicas, rank)

    for refused in (Subclass, own):
        with pytest.raises(ValueError, match="wraps a sampler"):
            check_sampler_cls(refused)

    # The suggested wrapper, built by the engine (data rank 0 of 2 here) as auto_accelerate builds it.
    from torch import nn

    from atorch.auto.engine import _make_sampler
    from atorch.auto.model_context import ModelContext

    def wrapper(dataset, **kw):
        return DistributedProxySampler(SequentialSampler(dataset), **kw)

    check_sampler_cls(wrapper)
    dataset = [{"x": i} for i in range(7)]
    ctx = ModelContext(model=nn.Linear(2, 2), dataset=dataset, distributed_sampler_cls=wrapper)
    sampler = _make_sampler(ctx, 2, shuffle=True, seed=3, drop_last=False)
    other = wrapper(dataset, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=False)
    assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 0, 3)
    assert sorted(set(list(sampler) + list(other))) == list(range(7)) and len(sampler) == len(other) == 4
