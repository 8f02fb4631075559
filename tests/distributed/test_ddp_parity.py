"""parallel_mode alone (DDP over 2 gloo ranks) trains exactly like one process on the same global batches."""

import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, GLOBAL_BATCH = 5, 8


def _train(strategy):
    status, result, chosen = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, "auto_accelerate failed"
    losses = []
    for step, batch in zip(range(STEPS), result.dataloader):
        loss = train_step(result, batch)
        # Per-rank losses are means over the local half-batch; the global loss is their mean.
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    names = chosen.names()
    del result
    dist.barrier()
    return losses, names


def test_ddp_matches_single_process():
    expected = reference_losses(tiny_llama(seed=0), global_batches(TokenDataset(), GLOBAL_BATCH, STEPS))
    results = run_distributed(_train, 2, ["parallel_mode"])
    for losses, names in results:
        assert names == ["parallel_mode", "ddp"]   # DDP is added for the two data ranks (resolve_strategy)
        # fp32, same math up to the all-reduce summation order.
        assert_close_losses(losses, expected, rel=1e-5, what="ddp")
