"""The sharding and precision optimizations on CUDA (nccl), against single-GPU training on the same
global batches. Skipped without CUDA (tests/conftest.py); uses 2 GPUs when there are, else 1.

What differs from the CPU tests: fp16 GradScaler on CUDA, FSDP2 moving CPU-built models onto
the GPU, CPU offload with pinned memory, DeepSpeed's CUDA accelerator (bf16, and fp16 with its
own dynamic loss scaler). Tolerances as on CPU: fp32 rel 1e-5 (TF32 stays off for matmuls by
default), half precision rel 2e-2.
"""

from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches

pytestmark = pytest.mark.gpu

STEPS, GLOBAL_BATCH, LR = 5, 8, 1e-3
FP32_REL, HALF_REL = 1e-5, 2e-2
# The learnable dataset of tests/distributed/test_opt_parity.py: the loss falls ~6% in 5 steps.
LEARNABLE_VOCAB = 20
BF16, FP16 = torch.bfloat16, torch.float16
# name -> (strategy, reference autocast dtype)
STRATEGIES: Dict[str, Any] = {
    "fsdp": (["fsdp"], None),
    "zero1": (["zero1"], None),
    "zero2": (["zero2"], None),
    "amp_native(fp16)": ([("amp_native", FP16)], FP16),
    "amp_native(bf16)+fsdp": ([("amp_native", BF16), "fsdp"], BF16),
    "amp_native(fp16)+fsdp cpu_offload": ([("amp_native", FP16), ("fsdp", {"cpu_offload": True})], FP16),
    "amp_native(bf16)+zero1(ds)": ([("amp_native", BF16), ("zero1", {"use_ds_zero": True})], BF16),
    "amp_native(bf16)+zero2(ds)": ([("amp_native", BF16), ("zero2", {"use_ds_zero": True})], BF16),
    "amp_native(bf16)+fsdp(ds)": ([("amp_native", BF16), ("fsdp", {"use_ds_zero": True})], BF16),
}
# DeepSpeed fp16 may skip early steps while its dynamic loss scale settles, so it is checked for
# training (finite, falling loss), not step-by-step parity.
DS_FP16 = [("amp_native", FP16), ("zero2", {"use_ds_zero": True})]


def _world() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def _dataset() -> TokenDataset:
    return TokenDataset(vocab_size=LEARNABLE_VOCAB)


def _reference(autocast_dtype: Optional[torch.dtype]) -> List[float]:
    model = tiny_llama(seed=0).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(_dataset(), GLOBAL_BATCH, STEPS):
        batch = {k: v.cuda() for k, v in batch.items()}
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _train(strategy) -> Dict[str, Any]:
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=_dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, strategy
    losses, devices = [], set()
    for _, batch in zip(range(STEPS), result.dataloader):
        loss = train_step(result, batch).float().clone()
        devices.add(loss.device.type)  # where the forward ran (with cpu_offload the shards rest on CPU)
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    out = {"losses": losses, "device": sorted(devices)}
    engine = result.args["engine"]
    if engine is not None:
        engine.destroy()
    del result, engine
    dist.barrier()
    return out


def _train_all() -> Dict[str, Any]:
    out = {name: _train(strategy) for name, (strategy, _) in STRATEGIES.items()}
    out["ds_fp16"] = _train(DS_FP16)
    return out


@pytest.fixture(scope="module")
def gpu_runs():
    # The spawn helper defaults DeepSpeed to its CPU accelerator; here it must use CUDA.
    return run_distributed(_train_all, _world(), backend="nccl", env={"DS_ACCELERATOR": "cuda"}, timeout=600)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_gpu_parity(name, gpu_runs):
    autocast_dtype = STRATEGIES[name][1]
    expected = _reference(autocast_dtype)
    rel = FP32_REL if autocast_dtype is None else HALF_REL
    for rank, runs in enumerate(gpu_runs):
        assert runs[name]["device"] == ["cuda"], runs[name]
        assert_close_losses(runs[name]["losses"], expected, rel=rel, what=f"{name} (rank {rank})")


def test_deepspeed_fp16_trains(gpu_runs):
    for runs in gpu_runs:
        losses = runs["ds_fp16"]["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[-1] < losses[0], losses
