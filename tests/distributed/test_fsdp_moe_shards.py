"""FSDP2 over more data ranks than a mixture of experts has experts (2 gloo ranks, one expert).

FSDP2 splits a parameter along dim 0. A fused expert tensor [experts, ...] and the router
[experts, hidden] padded along dim 0 to the data size put a whole expert on a rank and all-gather
a buffer ranks/experts times the tensor; atorch shards them along their widest even dimension
(`_sharding.least_padded_placement`). Checked: each rank holds half of every expert tensor;
3 AdamW steps give the losses of plain single-process training (fp32, rel 1e-5, as
test_opt_parity.py); the checkpoint of step 2 merges to the trained weights (bit-equal) and a
resume from it trains step 3 with the same loss.
"""

import os

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, BATCH, LR, REL, WORLD = 3, 4, 1e-3, 1e-5, 2


def _mixtral() -> torch.nn.Module:
    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=128, num_local_experts=1,
                                  num_experts_per_tok=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _accelerate(dataset: TokenDataset) -> Any:
    _, result, _ = auto_accelerate(_mixtral(), optim_func=torch.optim.AdamW, dataset=dataset,
                                   optim_args={"lr": LR}, dataloader_args={"batch_size": BATCH},
                                   load_strategy=["parallel_mode", "fsdp"], ignore_dryrun_on_load_strategy=True)
    return result


def _global_loss(result: Any, batch: Dict[str, torch.Tensor]) -> float:
    loss = train_step(result, batch).detach().clone()
    dist.all_reduce(loss)                                 # the global batch's mean: the ranks' mean
    return loss.item() / WORLD


def _job(root: str) -> Dict[str, Any]:
    from safetensors.torch import load_file

    from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint

    dataset = TokenDataset(n=STEPS * BATCH, vocab_size=128)
    result = _accelerate(dataset)
    shards = {name: (p.to_local().numel(), p.numel(), str(p.placements[0]))
              for name, p in result.model.named_parameters() if "experts" in name or "mlp.gate" in name}
    losses: List[float] = []
    batches = list(zip(range(STEPS), result.dataloader))   # this rank's half of each global batch
    for step, batch in batches:
        if step == STEPS - 1:
            path = save_checkpoint(result, os.path.join(root, "ckpt"), step=step)
            trained = {k: v.full_tensor().clone() for k, v in result.model.state_dict().items()}
        losses.append(_global_loss(result, batch))
    resumed = _accelerate(dataset)
    load_checkpoint(resumed, path)
    resumed_loss = _global_loss(resumed, batches[-1][1])
    differ: List[str] = []
    if dist.get_rank() == 0:
        merged = load_file(os.path.join(merge_checkpoint(path, os.path.join(root, "hf")), "model.safetensors"))
        differ = sorted(k for k, v in trained.items() if k not in merged or not torch.equal(merged[k], v))
    dist.barrier()
    return {"shards": shards, "losses": losses, "resumed": resumed_loss, "differ": differ}


def test_experts_fewer_than_data_ranks_shard_evenly_and_train_like_one_process(tmp_path):
    expected = reference_losses(_mixtral(), global_batches(TokenDataset(n=STEPS * BATCH, vocab_size=128), BATCH,
                                                           STEPS), lr=LR)
    for rank, out in enumerate(run_distributed(_job, WORLD, str(tmp_path), timeout=240)):
        assert out["shards"], out
        for name, (local, whole, placement) in out["shards"].items():
            # one expert: half of [1, 192, 64] on each rank, split along a width (dim 0 would put it whole on rank 0)
            assert placement != "S(0)" and local * WORLD == whole, (rank, name, local, whole, placement)
        assert_close_losses(out["losses"], expected, REL, f"rank {rank}")
        assert_close_losses([out["resumed"]], expected[-1:], REL, f"rank {rank} resumed")
        assert out["differ"] == [], out["differ"]
