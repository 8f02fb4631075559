"""DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16 weights and fp32 gradient accumulation) across a checkpoint.

One process, a world of one (as `auto_accelerate` starts it): `save_checkpoint` failed with
"'BF16_Optimizer' object has no attribute 'bit16_groups'", and at ZeRO stage 0 (DeepSpeed 3D's pipeline
engine in bf16, tests/distributed/test_checkpoint_pipeline.py) the same optimizer was saved without its
state and silently. Its fp32 master partitions and moments are now saved per parameter like a ZeRO-1
optimizer's: the checkpoint holds the fp32 master weights, and the resume continues exactly.
"""

from typing import List

import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param

from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset, global_batches

LR, BATCH, STEPS, SAVE_AT = 1e-2, 4, 4, 2
BF16_ZERO1 = [("amp_native", {"dtype": torch.bfloat16}),
              ("zero1", {"use_ds_zero": True, "ds_config": {"data_types": {"grad_accum_dtype": "fp32"}}})]


def _dataset() -> TokenDataset:
    return TokenDataset(n=BATCH * STEPS, seq_len=8)


def _build(seed: int):
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), torch.optim.AdamW, _dataset(), optim_args={"lr": LR},
        dataloader_args={"batch_size": BATCH, "shuffle": False}, load_strategy=BF16_ZERO1)
    assert status
    assert type(result.engine.optimizer).__name__ == "BF16_Optimizer", type(result.engine.optimizer)
    return result


def _train(result, batches) -> List[float]:
    return [float(train_step(result, batch)) for batch in batches]


def _release(result) -> None:
    result.engine.destroy()


def test_bf16_optimizer_resumes_exactly_and_merges_to_its_fp32_master_weights(tmp_path):
    batches = global_batches(_dataset(), BATCH, STEPS)
    run = _build(0)
    straight = _train(run, batches)
    _release(run)

    run = _build(0)
    first = _train(run, batches[:SAVE_AT])
    path = save_checkpoint(run, str(tmp_path / f"step_{SAVE_AT}"), step=SAVE_AT)
    # DeepSpeed's own view of one parameter's fp32 master weights (the module holds their bf16 rounding).
    master = safe_get_full_fp32_param(run.engine.module.model.layers[0].mlp.up_proj.weight).clone()
    _release(run)

    run = _build(1)     # other initial weights: everything must come from the checkpoint
    state = load_checkpoint(run, path)
    assert state.optimizer_restored
    rest = _train(run, batches[SAVE_AT:])
    _release(run)
    assert first + rest == straight   # exact: the same bf16 arithmetic on the same fp32 state

    # The merged model is the fp32 master weights, not their bf16 rounding.
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merge_checkpoint(path, str(tmp_path / "hf")))
    weights = merged.state_dict()
    assert all(v.dtype == torch.float32 for v in weights.values())
    saved = weights["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(saved, master)
    assert not torch.equal(saved, saved.to(torch.bfloat16).float())


def test_an_optimizer_no_handler_reads_is_refused_on_save_and_load_not_dropped(tmp_path, monkeypatch):
    """fp16 without ZeRO: DeepSpeed's FP16_UnfusedOptimizer, whose state was dropped silently like
    BF16_Optimizer's. Refused unless the user asks for the weights alone."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import atorch

    # DeepSpeed's CPU accelerator accepts fp16 only where oneDNN has fp16 kernels (not on every x86 CPU CI
    # lands on); nothing here computes in fp16, the test is about what a checkpoint does with the optimizer.
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    atorch.init_distributed("gloo")     # a world of one, as auto_accelerate starts it
    model = tiny_llama(seed=0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config={"train_batch_size": 1, "fp16": {"enabled": True}})
    name = type(engine.optimizer).__name__
    assert name.startswith("FP16_"), name
    path = str(tmp_path / "step_0")
    with pytest.raises(ValueError, match=f"save_checkpoint: the DeepSpeed engine's optimizer is {name}, "
                                         ".* pass save_optimizer=False"):
        save_checkpoint(engine, path)
    save_checkpoint(engine, path, save_optimizer=False)
    with pytest.raises(ValueError, match=f"load_checkpoint: .*{name}.* pass load_optimizer=False"):
        load_checkpoint(engine, path)
    assert not load_checkpoint(engine, path, load_optimizer=False).optimizer_restored
    engine.destroy()
