"""GPU paths of tensor parallelism (skipped without CUDA by tests/conftest.py).

On one GPU: the randomizer forks the CUDA generator (dropout on CUDA tensors replays exactly
and leaves the caller's CUDA stream alone), the layers and the vocabulary-parallel loss run
on CUDA, and a meta model materializes to the CPU seeded construction, then moves. With two
GPUs: TP=2 over nccl through auto_accelerate matches the unsharded model's logits and losses.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atorch.modules.distributed_modules.cross_entropy import vocab_parallel_cross_entropy
from atorch.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from atorch.modules.distributed_modules.randomizer import MultiDimParallelRandomizer, fork_module_rng
from atorch.testing import run_distributed, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

DEVICE = torch.device("cuda")


def test_randomizer_forks_the_cuda_generator():
    torch.cuda.init()
    drop = nn.Dropout(0.5)
    fork_module_rng(drop, MultiDimParallelRandomizer(5, {"tensor": 1}), "tensor", replicated=False)
    torch.cuda.manual_seed(0)
    outside = torch.cuda.get_rng_state()
    first = drop(torch.ones(4096, device=DEVICE))
    assert torch.equal(torch.cuda.get_rng_state(), outside), "the caller's CUDA stream must be untouched"
    with MultiDimParallelRandomizer(5, {"tensor": 1}).fork("tensor"):
        replay = nn.Dropout(0.5)(torch.ones(4096, device=DEVICE))
    assert torch.equal(first, replay)
    with MultiDimParallelRandomizer(5, {"tensor": 0}).fork("tensor"):
        other_rank = nn.Dropout(0.5)(torch.ones(4096, device=DEVICE))
    assert not torch.equal(first, other_rank)


def test_layers_and_vocab_parallel_loss_on_cuda():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(DEVICE)
    x = torch.randn(4, 64, device=DEVICE)
    assert torch.allclose(ColumnParallelLinear.from_full(lin, None, stride=3)(x), lin(x), atol=1e-5)
    assert torch.allclose(RowParallelLinear.from_full(lin, None)(x), lin(x), atol=1e-5)
    logits = torch.randn(8, 1000, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (8,), device=DEVICE)
    expected = F.cross_entropy(logits.float(), target)
    assert torch.allclose(vocab_parallel_cross_entropy(logits, target, reduction="mean"), expected, atol=1e-5)


def test_meta_materialization_then_cuda_equals_seeded_cpu_construction():
    from transformers import LlamaForCausalLM

    from atorch.utils.manual_tp_utils import materialize_tp_module, tp_manual_shard_custom_fn
    from atorch.utils.meta_model_utils import record_module_init
    from atorch.utils.tp_presets import tpinfo_for_model

    with record_module_init():
        meta = LlamaForCausalLM(tiny_llama_config())
    tp_manual_shard_custom_fn(meta, tpinfo_for_model(meta))
    model = materialize_tp_module(meta, base_seed=3, device=DEVICE)
    reference = tiny_llama(seed=3).to(DEVICE)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def _nccl_tp2():
    from atorch.auto import auto_accelerate, train_step
    from atorch.utils.manual_tp_utils import gather_tp_logits

    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 8},
        load_strategy=[("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"])
    assert status
    probe = global_batches(TokenDataset(), 8, 1)[0]["input_ids"].to(DEVICE)
    result.model.eval()
    with torch.no_grad():
        logits = gather_tp_logits(result.model, result.model(input_ids=probe).logits).cpu().numpy()
    result.model.train()
    losses = [train_step(result, batch).item() for _, batch in zip(range(5), result.dataloader)]
    del result
    dist.barrier()
    return logits, losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for nccl tensor parallelism")
def test_nccl_tp2_matches_single_gpu():
    results = run_distributed(_nccl_tp2, 2, backend="nccl")
    reference = tiny_llama(seed=0)
    with torch.no_grad():
        expected_logits = reference(input_ids=global_batches(TokenDataset(), 8, 1)[0]["input_ids"]).logits
    expected = reference_losses(reference, global_batches(TokenDataset(), 8, 5))
    for logits, losses in results:
        got = torch.from_numpy(logits)
        assert ((got - expected_logits).norm() / expected_logits.norm()).item() <= 1e-4  # TF32/cuBLAS vs CPU
        assert_close_losses(losses, expected, rel=1e-3, what="nccl tp2")
