"""LoRA on a native pipeline stage trains exactly like single-process LoRA (2 gloo ranks, 2 stages).

A stage is a part of the model without its config: peft's default targets come from the user's
model's config (`ModelContext.model_config`). Reference: the same model with the same adapters
(`add_lora_adapters`, same seed) trained in one process on the same global batches. fp32, losses
rel 1e-5 (micro-batch gradient sums change the summation order only).
"""

import pytest
import torch

from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, LR = 4, 4, 1e-2


def _train() -> dict:
    from atorch.auto import auto_accelerate, train_step

    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), torch.optim.AdamW, TokenDataset(n=16, seq_len=16), optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
        load_strategy=[("parallel_mode", ([("pipeline", 2)], None)), "pipeline_parallel", "lora"])
    assert status
    losses = [float(train_step(result, batch)) for _, batch in zip(range(STEPS), result.dataloader)]
    return {"losses": losses, "targets": result.summaries["lora"]["target_modules"]}


def test_lora_on_pipeline_stages_matches_single_process_lora():
    from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters

    runs = run_distributed(_train, 2, timeout=300)
    model = add_lora_adapters(tiny_llama(seed=0), LoraConfig())
    expected = reference_losses(model, global_batches(TokenDataset(n=16, seq_len=16), GLOBAL_BATCH, STEPS), lr=LR)
    for rank, run in enumerate(runs):
        assert run["targets"] == ["q_proj", "v_proj"]
        assert_close_losses(run["losses"], expected, rel=1e-5, what=f"pipeline + lora (rank {rank})")
    assert expected[-1] < expected[0]      # the adapters learn: the comparison is not of a constant
