"""examples/slurm/train.py: its arguments and its step loop, without Slurm or a process group (milliseconds).

The real two-task srun run lives in tests/distributed/test_slurm_real.py.
"""

import pytest
from torch.utils.data import DataLoader, DistributedSampler


@pytest.fixture(scope="module")
def train(load_example):
    return load_example("slurm/train.py")


def test_more_steps_than_one_epoch_run_over_epochs(train):
    """--steps 20 over 8 batches an epoch: 20 batches, each epoch shuffled anew by the sampler."""
    sampler = DistributedSampler(list(range(8)), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(list(range(8)), batch_size=1, sampler=sampler)
    seen = [int(b) for b in train.batches(loader, 20)]
    assert len(seen) == 20
    assert sorted(seen[0:8]) == sorted(seen[8:16]) == list(range(8))   # two whole epochs
    assert seen[0:8] != seen[8:16]                                       # set_epoch reshuffled the second
    sampler.set_epoch(2)
    assert seen[16:] == [int(i) for i in sampler][:4]                    # then the third epoch's first 4
    assert [int(b) for b in train.batches(loader, 3)] == seen[:3]        # a new run starts at epoch 0


def test_a_loader_without_batches_is_an_error_not_a_hang(train):
    with pytest.raises(RuntimeError, match="yields no batch"):
        list(train.batches(DataLoader([], batch_size=2), 5))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--steps", "-3"], "--steps=-3 must be >= 1"),
    (["--global_batch", "0"], "--global_batch=0 must be >= 1"),
    (["--global_batch", "1000"], "--global_batch=1000 exceeds the 64 samples"),
])
def test_bad_steps_or_batch_are_usage_errors(train, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_parse(train):
    args = train.parse_args([])
    assert (args.steps, args.global_batch, args.out) == (3, 8, "")
