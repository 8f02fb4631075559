"""2-D parallelism: tensor 2 x data 2 (FSDP2) with amp bf16 and activation checkpointing, on 4 gloo ranks.

- Training: 3 AdamW steps of `parallel_mode(tensor 2, data 2) + tensor_parallel + amp_native(bf16)
  + checkpoint + fsdp` against plain single-process training under `torch.autocast(bfloat16)`,
  rel 2e-2 (the bound of the other bf16 parity tests: FSDP computes with bf16-cast weights,
  autocast op by op, so bf16 rounding differs; observed ~1e-3). The returned logits are full.
- Checkpoint: the 2-D run saves (sharded, DCP); a second layout (FSDP2 over all 4 ranks, no
  tensor parallelism) loads it, and its full weights equal the 2-D model's gathered weights
  bit for bit (a load copies bits), and the optimizer continues: the next loss matches the
  2-D run's next loss within the same bf16 tolerance.

Two spawns (save, load), both on 4 ranks.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

pytestmark = pytest.mark.heavy

STEPS, GLOBAL_BATCH, LR, BF16_REL = 3, 8, 1e-3, 2e-2
TWO_D = [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel",
         ("amp_native", {"dtype": torch.bfloat16}), "checkpoint", "fsdp"]
FSDP_4 = ["parallel_mode", ("amp_native", {"dtype": torch.bfloat16}), "fsdp"]


def _build(strategy: list, seed: int) -> Any:
    from atorch.auto import auto_accelerate

    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, strategy
    return result


def _steps(result: Any, batches: List[Dict[str, torch.Tensor]]) -> List[float]:
    from atorch import distributed as adist
    from atorch.auto import train_step

    losses = []
    data = adist.parallel_group("data")
    dp, rank = adist.parallel_group_size("data"), adist.parallel_rank("data")
    for batch in batches:
        local = {k: v[rank::dp] for k, v in batch.items()}  # what DistributedSampler gives this data rank
        loss = train_step(result, local)
        dist.all_reduce(loss, group=data)
        losses.append(loss.item() / dp)
    return losses


def _save(path: str) -> Dict[str, Any]:
    from atorch.checkpoint import save_checkpoint
    from atorch.tensor_parallel import gather_tp_state_dict

    result = _build(TWO_D, seed=0)
    batches = global_batches(TokenDataset(), GLOBAL_BATCH, STEPS + 1)
    probe = batches[0]["input_ids"][:2]
    with torch.no_grad():
        logits_shape = tuple(result.model(input_ids=probe).logits.shape)
    losses = _steps(result, batches[:STEPS])
    save_checkpoint(result, path, step=STEPS)
    weights = gather_tp_state_dict(result.model)
    next_loss = _steps(result, batches[STEPS:])[0]
    out = {"losses": losses, "next_loss": next_loss, "logits_shape": logits_shape}
    if dist.get_rank() == 0:
        out["weights"] = {k: v.float().numpy() for k, v in weights.items()}
    del result
    dist.barrier()
    return out


def _load(path: str) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from atorch.checkpoint import load_checkpoint

    result = _build(FSDP_4, seed=1)  # other initial weights: everything must come from the checkpoint
    load_checkpoint(result, path)
    state = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))
    weights = {k: v.detach().float().cpu().numpy() for k, v in state.items()}
    batches = global_batches(TokenDataset(), GLOBAL_BATCH, STEPS + 1)
    next_loss = _steps(result, batches[STEPS:])[0]
    del result
    dist.barrier()
    return {"weights": weights if dist.get_rank() == 0 else None, "next_loss": next_loss}


def test_tensor_x_fsdp_amp_checkpoint_trains_like_one_process_and_reloads_at_another_layout(tmp_path):
    path = os.path.join(tmp_path, "ckpt")
    saved = run_distributed(_save, 4, path, timeout=600)
    expected = reference_losses(tiny_llama(seed=0), global_batches(TokenDataset(), GLOBAL_BATCH, STEPS),
                                lr=LR, autocast_dtype=torch.bfloat16)
    vocab = tiny_llama(seed=0).config.vocab_size
    for rank, r in enumerate(saved):
        assert_close_losses(r["losses"], expected, rel=BF16_REL, what=f"2-D rank {rank}")
        assert r["logits_shape"] == (2, 16, vocab), r["logits_shape"]

    loaded = run_distributed(_load, 4, path, timeout=600)
    saved_weights, loaded_weights = saved[0]["weights"], loaded[0]["weights"]
    assert sorted(saved_weights) == sorted(loaded_weights)
    for key, value in saved_weights.items():
        assert (loaded_weights[key] == value).all(), key
    for rank, r in enumerate(loaded):
        assert abs(r["next_loss"] - saved[0]["next_loss"]) <= BF16_REL * abs(saved[0]["next_loss"]), (rank, r)
