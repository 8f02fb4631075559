"""Resuming the data stream: dropout RNG, a changed global batch size, and the end of the resumed epoch's skip.

One process each (the 2-rank dropout checks are in tests/distributed/test_checkpoint_resume_dropout.py).
"""

import json
import logging
import os
from typing import Dict, List, Tuple

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import DataPosition, load_checkpoint, resume_dataloader, save_checkpoint, save_load
from atorch.checkpoint.state import convert_position, dataset_change_message, position_in_epoch
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, fork_module_rng
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset

N_SAMPLES = 32


def _build(seed: int, batch: int = 8, dropout: float = 0.0, shuffle: bool = False, n: int = N_SAMPLES):
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed, attention_dropout=dropout), torch.optim.AdamW, TokenDataset(n=n, seq_len=8),
        optim_args={"lr": 1e-3}, dataloader_args={"batch_size": batch, "shuffle": shuffle}, load_strategy=[])
    assert status
    return result


def _rows(batch) -> List[tuple]:
    """Each row's tokens, which tell TokenDataset's samples apart."""
    return [tuple(row) for row in batch["input_ids"].tolist()]


# -- dropout: the resumed loader's first iterator leaves the restored RNG as it is ------------------------------

def test_resume_with_dropout_is_exact(tmp_path):
    """5 steps straight == 2 steps, save, fresh objects (other seed), load, 3 steps; attention dropout 0.3."""
    straight_run = _build(0, dropout=0.3)
    straight = [float(train_step(straight_run, b)) for _, b in zip(range(4), straight_run.dataloader)]

    first_run = _build(0, dropout=0.3)
    batches = iter(first_run.dataloader)
    first = [float(train_step(first_run, next(batches))) for _ in range(2)]
    save_checkpoint(first_run, str(tmp_path / "step_2"), step=2)
    resumed_run = _build(5, dropout=0.3)
    torch.manual_seed(1234)
    state = load_checkpoint(resumed_run, str(tmp_path / "step_2"))
    assert state.rng_restored
    rest = [float(train_step(resumed_run, b)) for b in state.dataloader]
    assert first + rest == straight


def test_first_resumed_pass_leaves_the_global_generators_untouched():
    """A RandomSampler without a generator draws its seed from torch's global one, like DataLoader.__iter__."""
    data = TokenDataset(n=16, seq_len=4)
    loader = DataLoader(data, batch_size=2, sampler=RandomSampler(data))
    resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=3, global_batch_size=2))
    saved = torch.get_rng_state()
    it = iter(resumed)
    next(it)
    assert torch.equal(torch.get_rng_state(), saved)
    assert len(list(it)) == 4
    # Later passes draw as usual (in the uninterrupted run those draws follow the checkpoint too).
    resumed.sampler.set_epoch(1)
    next(iter(resumed))
    assert not torch.equal(torch.get_rng_state(), saved)


# -- a changed global batch size resumes at the same sample, or refuses ---------------------------------------

def test_convert_position_counts_in_samples():
    assert convert_position(DataPosition(1, 3, 8), 4) == DataPosition(1, 6, 4)
    assert convert_position(DataPosition(1, 4, 8), 16) == DataPosition(1, 2, 16)
    assert convert_position(DataPosition(1, 3, 8), 8) == DataPosition(1, 3, 8)
    assert convert_position(DataPosition(1, 3, None), 4) == DataPosition(1, 3, 4)  # nothing recorded: as is
    assert convert_position(DataPosition(2, 0, 8), 12) == DataPosition(2, 0, 12)  # an epoch boundary: any size
    with pytest.raises(ValueError, match=r"3 global batches of 8 samples \(24 samples\).*global batches of 16.*"
                                         r"Resume with global batch size 8"):
        convert_position(DataPosition(0, 3, 8), 16)


def _sample_index() -> Dict[tuple, int]:
    """Each sample's row of tokens -> its index in the dataset (rows tell TokenDataset's samples apart)."""
    return {tuple(row): i for i, row in enumerate(TokenDataset(n=N_SAMPLES, seq_len=8).tokens.tolist())}


def _train_and_save(path: str, steps: int, batch: int) -> None:
    run = _build(0, batch=batch)
    for _, data in zip(range(steps), run.dataloader):
        train_step(run, data)
    save_checkpoint(run, path, step=steps)


@pytest.mark.parametrize("new_batch", [4, 6])
def test_resume_with_another_global_batch_size(tmp_path, new_batch):
    """Saved after 3 batches of 8 (samples 0..23): with batches of 4 or 6 the next sample is 24."""
    key = _sample_index()
    _train_and_save(str(tmp_path / "step_3"), steps=3, batch=8)

    resumed_run = _build(1, batch=new_batch)
    state = load_checkpoint(resumed_run, str(tmp_path / "step_3"))
    assert state.data_position == DataPosition(0, 24 // new_batch, new_batch, sampler_epoch=0)
    seen = [key[t] for batch in state.dataloader for t in _rows(batch)]
    assert seen == list(range(24, N_SAMPLES // new_batch * new_batch))  # drop_last: whole batches only


@pytest.mark.parametrize("use_resumed_loader", [False, True])
def test_a_save_after_a_batch_size_change_counts_steps_from_the_resume(tmp_path, use_resumed_loader):
    """2 batches of 8 (samples 0..15), save at step 2; resume with batches of 4, 3 more steps (16..27), save at
    step 5 (the user's step counts on): the next resume starts at sample 28, not at 5 x 4 = 20."""
    key = _sample_index()
    _train_and_save(str(tmp_path / "step_2"), steps=2, batch=8)
    resumed_run = _build(1, batch=4)
    state = load_checkpoint(resumed_run, str(tmp_path / "step_2"))
    if use_resumed_loader:          # a loop that keeps the resumed loader on the result (its len() is what is left)
        resumed_run.dataloader = state.dataloader
    batches = iter(state.dataloader)
    for _ in range(3):
        train_step(resumed_run, next(batches))
    save_checkpoint(resumed_run, str(tmp_path / "step_5"), step=5)
    again = load_checkpoint(_build(2, batch=4), str(tmp_path / "step_5"))
    assert again.data_position == DataPosition(0, 7, 4, sampler_epoch=0)
    assert [key[t] for t in _rows(next(iter(again.dataloader)))] == [28, 29, 30, 31]


def test_resume_with_a_batch_size_that_does_not_fit_raises_before_loading(tmp_path):
    _train_and_save(str(tmp_path / "step_3"), steps=3, batch=8)
    resumed_run = _build(1, batch=16)
    before = {k: v.clone() for k, v in resumed_run.model.state_dict().items()}
    with pytest.raises(ValueError, match="global batches of 8 samples.*global batches of 16"):
        load_checkpoint(resumed_run, str(tmp_path / "step_3"))
    assert all(torch.equal(v, before[k]) for k, v in resumed_run.model.state_dict().items())


# -- a position past the end of a smaller dataset's epoch starts the next epoch, with a warning -----------------

def test_position_in_epoch_moves_a_position_past_the_end_to_the_next_epoch(caplog):
    with caplog.at_level(logging.WARNING, logger="atorch.checkpoint.state"):
        assert position_in_epoch(DataPosition(1, 2, 8), 4) == DataPosition(1, 2, 8)        # inside: as is
        assert position_in_epoch(DataPosition(1, 0, 8), 0) == DataPosition(1, 0, 8)        # an empty loader
        assert position_in_epoch(DataPosition(1, 5, 8), None) == DataPosition(1, 5, 8)     # length unknown
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="atorch.checkpoint.state"):
        # The sampler was set to each epoch (sampler_epoch == epoch): it moves on; a loop that never sets it
        # (sampler_epoch 0 in epoch 2) keeps its own.
        assert position_in_epoch(DataPosition(1, 4, 8, 1), 4, 32) == DataPosition(2, 0, 8, 2)
        assert position_in_epoch(DataPosition(2, 6, 8, 0), 4) == DataPosition(3, 0, 8, 0)
    assert len(caplog.records) == 2
    assert ("stopped 4 global batches (32 samples) into epoch 1, but this run's epoch has only 4 batches (32 samples)"
            in caplog.records[0].getMessage())
    assert "Resuming at the start of epoch 2" in caplog.records[0].getMessage()


def test_resume_dataloader_past_the_end_gives_the_next_whole_epoch(caplog):
    data = TokenDataset(n=8, seq_len=4)
    loader = DataLoader(data, batch_size=2)
    with caplog.at_level(logging.WARNING, logger="atorch.checkpoint.state"):
        resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=6, global_batch_size=2))
    assert "this run's epoch has only 4 batches (8 samples)" in caplog.text
    assert len(resumed) == 4 and len(list(resumed)) == 4


def test_resume_on_a_smaller_dataset_starts_the_next_epoch(tmp_path, caplog):
    """Saved 3 batches of 8 into a 32-sample epoch; resumed on 16 samples (2 batches an epoch): not an empty rest
    of epoch 0, but epoch 1 from its first sample, with a warning naming both lengths."""
    _train_and_save(str(tmp_path / "step_3"), steps=3, batch=8)
    resumed_run = _build(1, batch=8, n=16)
    with caplog.at_level(logging.WARNING, logger="atorch.checkpoint.state"):
        state = load_checkpoint(resumed_run, str(tmp_path / "step_3"))
    assert "stopped 3 global batches (24 samples) into epoch 0, but this run's epoch has only 2 batches (16 " \
           "samples)" in caplog.text
    assert state.data_position == DataPosition(1, 0, 8, sampler_epoch=1)
    assert len(resumed_run.dataloader) == 2 and len(list(resumed_run.dataloader)) == 2
    # A save after the resume counts from the start of epoch 1.
    train_step(resumed_run, next(iter(resumed_run.dataloader)))
    save_checkpoint(resumed_run, str(tmp_path / "step_4"), step=4)
    assert load_checkpoint(_build(2, batch=8, n=16), str(tmp_path / "step_4")).data_position.epoch == 1


def test_a_resume_on_a_dataset_of_another_length_warns_once_naming_both(tmp_path, caplog, monkeypatch):
    """The checkpoint records its dataset's length (32). Resumed on 40 samples (fine-tuning on other data,
    load_optimizer=False): the position is restored as saved, with one warning naming both lengths and the
    position; on 16 samples one warning, not two, and the next epoch. The same length, or a checkpoint saved
    without the length (an older atorch), warns nothing."""
    path = str(tmp_path / "step_3")
    _train_and_save(path, steps=3, batch=8)
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        assert json.load(f)["dataset_length"] == N_SAMPLES

    def load(n: int, at: str = path, **kwargs) -> Tuple[DataPosition, List[str]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            state = load_checkpoint(_build(1, batch=8, n=n), at, **kwargs)
        return state.data_position, [r.getMessage() for r in caplog.records if "dataset" in r.getMessage()]

    position, warned = load(40, load_optimizer=False)
    assert position == DataPosition(0, 3, 8, sampler_epoch=0)
    assert len(warned) == 1, warned
    assert warned[0].startswith("this run's dataset has 40 samples, the checkpoint's run had 32"), warned
    assert "the resume starts 3 global batches (24 samples) into epoch 0, as saved" in warned[0]
    position, warned = load(16)
    assert position == DataPosition(1, 0, 8, sampler_epoch=1)
    assert len(warned) == 1 and "this run's dataset has 16 samples, the checkpoint's run had 32" in warned[0], warned
    assert "so the resume starts epoch 1 from its first sample" in warned[0]
    assert load(N_SAMPLES) == (DataPosition(0, 3, 8, sampler_epoch=0), [])

    real_meta = save_load._meta

    def meta_of_an_older_atorch(*args, **kwargs):
        meta = real_meta(*args, **kwargs)
        del meta["dataset_length"]
        return meta

    monkeypatch.setattr(save_load, "_meta", meta_of_an_older_atorch)
    _train_and_save(str(tmp_path / "old"), steps=3, batch=8)
    assert load(40, str(tmp_path / "old")) == (DataPosition(0, 3, 8, sampler_epoch=0), [])


def test_the_dataset_change_message_at_an_epoch_boundary_skips_nothing():
    at_boundary = DataPosition(2, 0, 8, sampler_epoch=2)
    message = dataset_change_message(32, 40, at_boundary, at_boundary, 5)
    assert message.startswith("this run's dataset has 40 samples, the checkpoint's run had 32")
    assert "the resume starts epoch 2 from its first sample, as saved" in message and "skips" not in message


# -- the skip ends with the resumed epoch, whichever sampler set_epoch is called on ----------------------------

@pytest.mark.parametrize("on_inner", [True, False])
def test_set_epoch_on_either_sampler_ends_the_skip(on_inner):
    data = TokenDataset(n=16, seq_len=4)
    inner = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=inner)
    resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=3, global_batch_size=2))
    sizes = []
    for epoch in range(3):
        (inner if on_inner else resumed.sampler).set_epoch(epoch)
        sizes.append((len(resumed), len(list(resumed))))
    assert sizes == [(5, 5), (8, 8), (8, 8)]


def test_a_shuffled_loop_without_set_epoch_resumes_in_its_own_order(tmp_path):
    """Shuffled, 4 batches an epoch, set_epoch never called: every pass is epoch 0's order. Saved at step 6 (2
    batches into the second pass), the resume follows that order too; the position's epoch (1) once re-seeded
    the sampler with epoch 1, another order."""
    key = _sample_index()
    run = _build(0, batch=8, shuffle=True)
    uninterrupted = [[key[t] for t in _rows(b)] for _ in range(3) for b in run.dataloader]   # never set_epoch
    run = _build(0, batch=8, shuffle=True)
    stream = (b for _ in range(3) for b in run.dataloader)
    for _ in range(6):
        train_step(run, next(stream))
    save_checkpoint(run, str(tmp_path / "step_6"), step=6)
    resumed = _build(1, batch=8, shuffle=True)
    state = load_checkpoint(resumed, str(tmp_path / "step_6"))
    assert (state.data_position.epoch, state.data_position.batches_in_epoch, state.data_position.sampler_epoch) \
        == (1, 2, 0)
    rest = [[key[t] for t in _rows(b)] for _ in range(2) for b in resumed.dataloader]
    assert rest == uninterrupted[6:]


@pytest.mark.parametrize("sets_epochs", [True, False])
def test_a_save_after_an_epochs_last_batch_resumes_in_the_next_epochs_order(tmp_path, sets_epochs):
    """Shuffled, 4 batches an epoch, saved at step 4 (right after epoch 0's last batch, before the loop's
    set_epoch(1)): the sampler still said epoch 0, so a loop that sets the epoch resumed epoch 1 in epoch 0's
    order (an outside probe: the resumed steps replayed steps 0-3). A loop that never sets it keeps epoch 0's."""
    key = _sample_index()

    def passes(run, epochs, first=0):
        out = []
        for epoch in range(first, first + epochs):
            if sets_epochs:
                run.sampler.set_epoch(epoch)
            out += [[key[t] for t in _rows(b)] for b in run.dataloader]
        return out

    uninterrupted = passes(_build(0, batch=8, shuffle=True), 3)
    run = _build(0, batch=8, shuffle=True)
    if sets_epochs:
        run.sampler.set_epoch(0)
    for b in run.dataloader:
        train_step(run, b)
    save_checkpoint(run, str(tmp_path / "step_4"), step=4)
    resumed = _build(1, batch=8, shuffle=True)
    state = load_checkpoint(resumed, str(tmp_path / "step_4"))
    assert (state.data_position.epoch, state.data_position.sampler_epoch) == (1, 1 if sets_epochs else 0)
    rest = [[key[t] for t in _rows(b)] for b in resumed.dataloader] + passes(resumed, 1, first=2)
    assert rest == uninterrupted[4:]
    assert uninterrupted[4:8] != uninterrupted[:4] or not sets_epochs     # epoch 1's order is another


@pytest.mark.parametrize("sampler", ["sequential", "distributed without set_epoch"])
def test_a_loop_that_never_calls_set_epoch_gets_whole_passes_after_the_resumed_one(sampler):
    data = TokenDataset(n=16, seq_len=4)
    inner = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False) if sampler != "sequential" else None
    loader = DataLoader(data, batch_size=2, sampler=inner)
    resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=3, global_batch_size=2))
    passes = []
    for _ in range(3):
        passes.append((len(resumed), [row for batch in resumed for row in _rows(batch)]))
    whole = [row for batch in loader for row in _rows(batch)]
    # The skipped samples are skipped once: the resumed pass is the rest of the epoch, later passes whole.
    assert passes == [(5, whole[6:]), (8, whole), (8, whole)]
    # A pass abandoned halfway does not end the skip: the next pass is still the resumed one.
    again = resume_dataloader(loader, DataPosition(epoch=0, batches_in_epoch=3, global_batch_size=2))
    next(iter(again))
    assert [row for batch in again for row in _rows(batch)] == whole[6:]


# -- tensor parallelism's dropout streams are saved per rank -------------------------------------------------

def _build_with_streams(seed: int):
    """A result whose attention dropout draws from a randomizer stream, as tensor parallelism arranges it."""
    result = _build(seed, dropout=0.3)
    result.randomizer = MultiDimParallelRandomizer(base_seed=11, coords={})
    for layer in result.model.model.layers:
        fork_module_rng(layer.self_attn, result.randomizer, group="tensor")
    return result


def test_resume_restores_the_tensor_parallel_dropout_streams(tmp_path, caplog):
    straight_run = _build_with_streams(0)
    straight = [float(train_step(straight_run, b)) for _, b in zip(range(4), straight_run.dataloader)]

    first_run = _build_with_streams(0)
    batches = iter(first_run.dataloader)
    first = [float(train_step(first_run, next(batches))) for _ in range(2)]
    save_checkpoint(first_run, str(tmp_path / "step_2"), step=2)
    resumed_run = _build_with_streams(5)
    state = load_checkpoint(resumed_run, str(tmp_path / "step_2"))
    rest = [float(train_step(resumed_run, b)) for b in state.dataloader]
    assert first + rest == straight

    # A checkpoint without streams (no tensor parallelism when saved) loads, with a warning.
    first_run.randomizer = None
    save_checkpoint(first_run, str(tmp_path / "plain"), step=2)
    with caplog.at_level(logging.WARNING, logger="atorch.checkpoint.save_load"):
        assert load_checkpoint(_build_with_streams(5), str(tmp_path / "plain")).rng_restored
    assert "no tensor-parallel dropout streams" in caplog.text
