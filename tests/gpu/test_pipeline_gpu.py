"""GPU paths of pipeline parallelism (skipped without CUDA by tests/conftest.py).

One GPU: patched pieces run on CUDA like the HF model, and `deepspeed_3d_parallel` in the
(1, 1, 1) layout drives DeepSpeed's CUDA pipeline engine through auto_accelerate. Two GPUs
(nccl): DeepSpeed (1, 1, 2) and native `pipeline_parallel` over 2 stages match a one-GPU run.
References run on the same GPU kind, so the tolerance is that of the CPU tests (rel 1e-4),
with TF32 off (the default for fp32 matmuls in torch).
"""

import pytest
import torch
import torch.distributed as dist

from atorch.testing import run_distributed, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, MICRO, GAS, LAYERS, SEED, LR = 3, 2, 2, 4, 1234, 1e-3
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA_ENV = {"DS_ACCELERATOR": "cuda"}


def test_pieces_on_cuda_equal_hf_forward():
    from atorch.modules.pipeline import PatchedLayer, expand_patcher, get_custom_patcher
    from atorch.modules.pipeline.batches import hf_inputs

    model = tiny_llama(seed=0, num_hidden_layers=2).cuda().eval()
    ids = torch.randint(4, 1024, (2, 16), device="cuda")
    layers = [PatchedLayer(model.get_submodule(p.path), p.patch, p.path)
              for p in expand_patcher(model, get_custom_patcher(model))]
    with torch.no_grad():
        x = hf_inputs({"input_ids": ids})
        for layer in layers:
            x = layer(x)
        torch.testing.assert_close(x, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def _meta_llama():
    from transformers import LlamaForCausalLM

    from atorch.utils.meta_model_utils import record_module_init

    with record_module_init():
        return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=LAYERS))


def _cuda_reference(data_size):
    batches = [{k: v.cuda() for k, v in b.items()}
               for b in global_batches(TokenDataset(), MICRO * GAS * data_size, STEPS)]
    return reference_losses(tiny_llama(seed=SEED, num_hidden_layers=LAYERS).cuda(), batches, lr=LR)


def _ds3d(dims):
    from atorch.auto import auto_accelerate
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig

    cfg = DeepSpeed3DParallelConfig(ds_config={"train_micro_batch_size_per_gpu": MICRO,
                                               "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 9})
    status, result, _ = auto_accelerate(_meta_llama(), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                        dataset=TokenDataset(),
                                        load_strategy=[("parallel_mode", (dims, None)), ("deepspeed_3d_parallel", cfg)])
    assert status
    assert next(result.model.module.parameters()).is_cuda
    it = iter(result.dataloader)
    losses = [result.model.train_batch(it).item() for _ in range(STEPS)]
    del result
    dist.barrier()
    return losses, _cuda_reference(dict(dims).get("data", 1)) if dist.get_rank() == 0 else None


def _native(dims):
    from atorch import distributed as adist
    from atorch.auto import auto_accelerate, train_step

    status, result, _ = auto_accelerate(_meta_llama(), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                        dataset=TokenDataset(), dataloader_args={"batch_size": MICRO * GAS},
                                        load_strategy=[("parallel_mode", (dims, None)),
                                                       ("pipeline_parallel", {"chunks": GAS})])
    assert status
    assert next(result.model.parameters()).is_cuda
    losses = [train_step(result, batch).item() for _, batch in zip(range(STEPS), result.dataloader)]
    assert adist.parallel_group_size("pipeline") == 2
    del result
    dist.barrier()
    return losses, _cuda_reference(1) if dist.get_rank() == 0 else None


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_ds3d_single_gpu_matches_reference():
    (losses, expected), = run_distributed(_ds3d, 1, [("tensor", 1), ("data", 1), ("pipeline", 1)],
                                          backend="nccl", env=CUDA_ENV, timeout=600)
    assert_close_losses(losses, expected, rel=1e-4, what="ds3d (1,1,1) cuda")


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_two_gpu_pipelines_match_reference():
    results = run_distributed(_ds3d, 2, [("tensor", 1), ("data", 1), ("pipeline", 2)], backend="nccl",
                              env=CUDA_ENV, timeout=600)
    for losses, _ in results:
        assert_close_losses(losses, results[0][1], rel=1e-4, what="ds3d (1,1,2) nccl")
    results = run_distributed(_native, 2, [("pipeline", 2)], backend="nccl", env=CUDA_ENV, timeout=600)
    for losses, _ in results:
        assert_close_losses(losses, results[0][1], rel=1e-4, what="native pipeline 2 stages nccl")
