"""Small training state: JSON encoding, RNG states, data position, and a single-process exact resume."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from atorch.checkpoint import DataPosition, load_checkpoint, resume_dataloader, save_checkpoint
from atorch.checkpoint.state import from_json_value, rng_state, set_rng_state, to_json_value
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def test_json_values_round_trip_exactly():
    import json

    value = {"lr": 1e-3, "betas": (0.9, 0.999), "nested": [{"a": None, "b": True}], "inf": float("inf"),
             "t": torch.arange(6, dtype=torch.int64).reshape(2, 3), "f": torch.tensor(0.1, dtype=torch.float32),
             1: "int key", "np": np.float32(2.5)}
    back = from_json_value(json.loads(json.dumps(to_json_value(value, "state"))))
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back["nested"] == [{"a": None, "b": True}] and back["inf"] == float("inf") and back[1] == "int key"
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.int64
    assert torch.equal(back["f"], value["f"]) and back["np"] == 2.5


def test_json_refuses_objects_that_would_need_pickle():
    with pytest.raises(ValueError, match=r"lr_scheduler.lr_lambdas\[0\]: a builtins.function cannot be saved as JSON"):
        to_json_value({"lr_lambdas": [lambda step: 1.0]}, "lr_scheduler")


def test_rng_states_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(saved)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_data_position_after_steps():
    assert DataPosition.after_steps(7, batches_per_epoch=3) == DataPosition(epoch=2, batches_in_epoch=1)
    assert DataPosition.after_steps(3, batches_per_epoch=3, epoch=1) == DataPosition(epoch=2, batches_in_epoch=0)
    assert DataPosition.from_json(DataPosition(1, 2, 8).to_json()) == DataPosition(1, 2, 8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_dataloader_gives_the_same_global_batches_at_any_data_parallel_size(shuffle):
    """Saved after 2 global batches of 8 at dp=4; resumed at dp=2: the same samples in the next global batches."""
    data = TokenDataset(n=64)

    def global_batches(dp, position=None, epoch=0):
        per_rank = []
        for r in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=r, shuffle=shuffle, seed=3, drop_last=True)
            sampler.set_epoch(epoch)
            loader = DataLoader(data, batch_size=8 // dp, sampler=sampler, drop_last=True)
            if position is not None:
                loader = resume_dataloader(loader, position)
            per_rank.append([b["input_ids"] for b in loader])
        return [torch.cat(sorted((p[k] for p in per_rank), key=lambda t: t[0, 0].item())).tolist()
                for k in range(len(per_rank[0]))]

    straight = global_batches(4, epoch=1)
    resumed = global_batches(2, DataPosition(epoch=1, batches_in_epoch=2, global_batch_size=8), epoch=1)
    key = lambda b: sorted(map(tuple, b))  # noqa: E731 - the order inside a global batch is the ranks' business
    assert [key(b) for b in resumed] == [key(b) for b in straight[2:]]
    assert len(resumed) == len(straight) - 2


def test_resume_sampler_skips_only_in_the_resumed_epoch():
    data = TokenDataset(n=16)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=3))
    assert len(resumed) == 5 and len(list(resumed)) == 5
    resumed.sampler.set_epoch(1)
    assert len(list(resumed)) == 8


def test_single_process_resume_is_exact(tmp_path):
    """Plain loop, no process group: 4 steps straight == 2 steps, save, fresh objects, load, 2 steps."""
    batches = [torch.randint(4, 1000, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def make(seed):
        model = tiny_llama(seed=seed)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optim, torch.optim.lr_scheduler.StepLR(optim, 1, 0.7)

    def step(model, optim, sched, x):
        torch.manual_seed(int(torch.randint(0, 1000, ())))  # consumes RNG: the restored state must match
        loss = model(x, labels=x).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        return loss.item()

    torch.manual_seed(0)
    reference, optim, sched = make(0)
    straight = [step(reference, optim, sched, x) for x in batches]

    torch.manual_seed(0)
    model, optim, sched = make(0)
    first = [step(model, optim, sched, x) for x in batches[:2]]
    save_checkpoint(model, str(tmp_path / "c"), step=2, optimizer=optim, lr_scheduler=sched)
    torch.manual_seed(1234)
    model2, optim2, sched2 = make(1)
    state = load_checkpoint(model2, str(tmp_path / "c"), optimizer=optim2, lr_scheduler=sched2)
    assert state.rng_restored and state.optimizer_restored and state.step == 2
    rest = [step(model2, optim2, sched2, x) for x in batches[2:]]
    assert first + rest == straight
    for a, b in zip(reference.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_resume_with_a_parameter_that_had_no_gradient_yet_is_exact(tmp_path):
    """A parameter no step had reached when the checkpoint was saved (an MoE expert no token was routed to, a
    branch not taken yet) has no optimizer state there; the checkpoint loads, that parameter gets no state (as
    the saving run had), and the step that first reaches it matches the straight run exactly."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) for _ in range(4)]

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(6, 6), "late": torch.nn.Linear(6, 6)})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optim, i, x):
        y = model["used"](x)
        loss = (model["late"](y) if i >= 3 else y).square().mean()   # "late" first gets a gradient at step 3
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    reference, optim = make(0)
    straight = [step(reference, optim, i, x) for i, x in enumerate(batches)]
    model, optim = make(0)
    first = [step(model, optim, i, x) for i, x in enumerate(batches[:2])]
    save_checkpoint(model, str(tmp_path / "c"), step=2, optimizer=optim)
    model2, optim2 = make(1)
    state = load_checkpoint(model2, str(tmp_path / "c"), optimizer=optim2)
    assert state.optimizer_restored
    assert [p for p in model2.parameters() if p in optim2.state] == list(model2["used"].parameters())
    rest = [step(model2, optim2, i, x) for i, x in enumerate(batches[2:], 2)]
    assert first + rest == straight
    for a, b in zip(reference.parameters(), model2.parameters()):
        assert torch.equal(a, b)
