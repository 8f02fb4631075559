"""Resume with dropout on 2 gloo ranks: the resumed losses equal the uninterrupted run's exactly.

DDP: each rank's restored torch RNG must not be advanced by the resumed DataLoader's first
iterator (it draws a base seed, which the uninterrupted run drew at the start of the epoch,
before the checkpoint). Tensor parallel 2: the randomizer's dropout streams must be saved and
restored per rank too. Two ranks sum in a single order, so exact equality is required. One
spawn per layout runs all three parts (straight, first half + save, fresh objects + load + rest).
DDP then loads the checkpoint on a dataset of another length: rank 0 warns once, rank 1 not at all.
"""

import logging
from typing import List

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import load_checkpoint, save_checkpoint
from atorch.testing import run_distributed, tiny_gpt2, tiny_llama
from atorch.testing.parity import TokenDataset

pytestmark = pytest.mark.heavy

STEPS, SAVE_AT = 4, 2


def _build(layout: str, seed: int, n: int = 32):
    if layout == "ddp":
        model, strategy = tiny_llama(seed=seed, attention_dropout=0.3), ["parallel_mode"]
    else:  # tensor parallel 2: GPT-2's residual, embedding and attention dropouts draw from the randomizer
        model = tiny_gpt2(seed=seed, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        strategy = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]
    status, result, _ = auto_accelerate(
        model, torch.optim.AdamW, TokenDataset(n=n, seq_len=8), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 8}, load_strategy=strategy)
    assert status
    return result


def _mean_loss(result, batch) -> float:
    loss = train_step(result, batch).detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


class _Collected(logging.Handler):
    """The warnings atorch's checkpoint modules log in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _straight_and_resumed(layout: str, path: str) -> list:
    run = _build(layout, 0)
    straight = [_mean_loss(run, b) for _, b in zip(range(STEPS), run.dataloader)]
    del run

    run = _build(layout, 0)
    batches = iter(run.dataloader)
    first = [_mean_loss(run, next(batches)) for _ in range(SAVE_AT)]
    save_checkpoint(run, path, step=SAVE_AT)
    del run, batches

    run = _build(layout, 7)
    torch.manual_seed(1234 + dist.get_rank())
    state = load_checkpoint(run, path)
    assert state.rng_restored
    rest = [_mean_loss(run, b) for _, b in zip(range(STEPS - SAVE_AT), state.dataloader)]
    del run

    collected = _Collected()
    if layout == "ddp":     # the checkpoint (32 samples) loaded on 40 samples
        logging.getLogger("atorch.checkpoint").addHandler(collected)
        try:
            load_checkpoint(_build(layout, 3, n=40), path)
        finally:
            logging.getLogger("atorch.checkpoint").removeHandler(collected)
    dist.barrier()
    return [straight, first + rest, collected.messages]


@pytest.mark.parametrize("layout", ["ddp", "tp"])
def test_resume_with_dropout_is_exact(tmp_path, layout):
    results = run_distributed(_straight_and_resumed, 2, layout, str(tmp_path / "step_2"), timeout=240)
    straight, resumed, warned = results[0]
    assert resumed == straight
    if layout == "ddp":     # the dataset's length differs from the saved one: one warning, on rank 0 only
        assert len(warned) == 1 and results[1][2] == [], (warned, results[1][2])
        assert warned[0].startswith("this run's dataset has 40 samples, the checkpoint's run had 32"), warned
