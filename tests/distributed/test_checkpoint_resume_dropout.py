"""Resume with dropout on 2 gloo ranks: the resumed losses equal the uninterrupted run's exactly.

DDP: each rank's restored torch RNG must not be advanced by the resumed DataLoader's first
iterator (it draws a base seed, which the uninterrupted run drew at the start of the epoch,
before the checkpoint). Tensor parallel 2: the randomizer's dropout streams must be saved and
restored per rank too. Two ranks sum in a single order, so exact equality is required. One
spawn per layout runs all three parts (straight, first half + save, fresh objects + load + rest).
"""

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


def _build(layout: str, seed: int):
    if layout == "ddp":
        model, strategy = tiny_llama(seed=seed, attention_dropout=0.3), ["parallel_mode"]
    else:  # tensor parallel 2: GPT-2's residual, embedding and attention dropouts draw from the randomizer
        model = tiny_gpt2(seed=seed, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        strategy = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]
    status, result, _ = auto_accelerate(
        model, torch.optim.AdamW, TokenDataset(n=32, seq_len=8), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 8}, load_strategy=strategy)
    assert status
    return result


def _mean_loss(result, batch) -> float:
    loss = train_step(result, batch).detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _straight_and_resumed(layout: str, path: str) -> List[List[float]]:
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
    dist.barrier()
    return [straight, first + rest]


@pytest.mark.parametrize("layout", ["ddp", "tp"])
def test_resume_with_dropout_is_exact(tmp_path, layout):
    straight, resumed = run_distributed(_straight_and_resumed, 2, layout, str(tmp_path / "step_2"), timeout=240)[0]
    assert resumed == straight
