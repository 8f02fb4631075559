"""The cost model's per-rank memory against what each backend really holds, on 2 gloo ranks.

One spawn builds every backend through `auto_accelerate` (DDP, half, torch ZeRO-1, FSDP2
with and without resharding, FSDP2 mixed precision, FSDP2 CPU offload, DeepSpeed ZeRO 1/2/3
in bf16, DeepSpeed's optimizer offload (ZeRO-2) and optimizer + parameter offload (ZeRO-3)
with its CPU Adam, LoRA (with and without a head trained whole), tensor parallel, the native
pipeline) and measures, right after the second backward pass (optimizer state allocated,
gradients present, activations freed), the bytes a rank holds with the storage accounting of
`PeakMemoryTracker.live_bytes` (a TorchDispatchMode
over torch's tensor storages): every tensor storage created since before the model was built
and still alive (storages FSDP2 frees by resizing them to 0 count as freed) -- parameters,
gradients, optimizer state, DeepSpeed's flat buffers and master partitions, DDP's buckets (which
no Python object exposes).

That is compared with `cost_model.resident_bytes` of the prediction for that strategy. And
for every backend, the parameters and optimizer state reachable from the model and optimizer
(local shards, ZeRO-3 partitions, DeepSpeed's fp32 master partitions) are compared with the
predicted parameters + master weights + optimizer state: DeepSpeed's buffers would otherwise
hide its model states (its reduce buffer was 1 GB before atorch sized it from the model). Tolerance 10% (the issue's bound); what is left over is
the tokens of the dataset and small bookkeeping tensors (about 20 KB against 0.4-4 MB).
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from atorch.auto import auto_accelerate
from atorch.auto.cost_model import estimate, resident_bytes
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.models import TINY_VOCAB_SIZE
from atorch.testing.live_memory import backward_only, optimizer_step, settled_live_bytes
from atorch.testing.parity import TokenDataset
from atorch.utils.memory import memory_breakdown
from atorch.utils.peak_memory import PeakMemoryTracker

WORLD, BATCH, SEQ = 2, 8, 32
TOLERANCE = 0.10
PEAK_TOLERANCE = 0.15   # the bound for the peak (model states: 10%)
TP2 = ("parallel_mode", ([("tensor", 2), ("data", 1)], None))
PP2 = ("parallel_mode", ([("data", 1), ("pipeline", 2)], None))
BACKENDS: Dict[str, List[Any]] = {
    "ddp": ["parallel_mode"],
    "ddp+half": ["parallel_mode", "half"],
    "zero1 (torch)": ["parallel_mode", "zero1"],
    "zero2 (fsdp2)": ["parallel_mode", "zero2"],
    "fsdp2+amp": ["parallel_mode", "amp_native", "fsdp"],
    "fsdp2 cpu_offload": ["parallel_mode", ("fsdp", {"cpu_offload": True})],
    # Activations decide: a training forward fills the KV cache (use_cache), whose k/v copies free
    # GPT-NeoX's fused query_key_value output instead of adding to it as on GPT-2 (1.18x measured
    # when GPT-2's cost was counted for it). Measured before any DeepSpeed ZeRO-3 engine: after one
    # in the same process this step holds 1.05 MB more (deepspeed zero3 bf16 then this case: 9,626,152
    # B; alone or after the other backends: 8,577,576 B): F.linear stays DeepSpeed's zero3_linear_wrap.
    "lora+fsdp2, GPT-NeoX, 4 x 128 tokens": ["parallel_mode", "lora", "fsdp"],
    "deepspeed zero1 bf16": ["amp_native", ("zero1", {"use_ds_zero": True})],
    "deepspeed zero2 bf16": ["amp_native", ("zero2", {"use_ds_zero": True})],
    "deepspeed zero3 bf16": ["amp_native", ("fsdp", {"use_ds_zero": True})],
    # Nothing persists whole (DeepSpeed's default threshold keeps every tensor of this tiny model whole).
    "deepspeed zero3 bf16 persistence 0": ["amp_native", ("fsdp", {"use_ds_zero": True, "ds_config": {
        "zero_optimization": {"stage3_param_persistence_threshold": 0}}})],
    "deepspeed zero2 bf16 offload_optimizer": ["amp_native", ("zero2", {"use_ds_zero": True, "ds_config": {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}})],
    "deepspeed zero3 bf16 offload_optimizer+param": ["amp_native", ("fsdp", {"use_ds_zero": True, "ds_config": {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}})],
    "lora+ddp": ["parallel_mode", "lora"],
    "lora+fsdp2": ["parallel_mode", "lora", "fsdp"],
    # modules_to_save: peft trains a copy of the LM head whole (gradients, Adam state) beside the frozen one.
    "lora+ddp, lm_head saved": ["parallel_mode", ("lora", {"modules_to_save": ["lm_head"]})],
    "lora+fsdp2, lm_head saved": ["parallel_mode", ("lora", {"modules_to_save": ["lm_head"]}), "fsdp"],
    "lora+deepspeed zero2 bf16, lm_head saved": ["amp_native", ("lora", {"modules_to_save": ["lm_head"]}),
                                                 ("zero2", {"use_ds_zero": True})],
    # Wider blocks and few tokens, so the parameters decide the peak: backward reduces only the
    # adapters' gradients, and the last block's all-gather in forward is the largest moment.
    "lora+fsdp2, hidden 256, 2 x 8 tokens": ["parallel_mode", "lora", "fsdp"],
    # Model states decide the peak, at the last blocks' backward: only the blocks already reduced
    # hold gradient shards (the root reduces last), and without resharding every block is
    # resharded by its own backward (predicted 1.19-1.22x measured when every shard and, under
    # zero2, every gathered block were counted there).
    "zero2+amp+ckpt, hidden 256, 4 layers, 2 x 8 tokens": ["parallel_mode", "amp_native", "zero2", "checkpoint"],
    "fsdp2+ckpt, hidden 256, 2 x 8 tokens": ["parallel_mode", "fsdp", "checkpoint"],
    "tensor parallel": [TP2, "tensor_parallel"],
    "pipeline": [PP2, "pipeline_parallel"],
}
# (global batch, sequence length, tiny_llama overrides) of the backends measured on another shape.
SIZES: Dict[str, Tuple[int, int, Dict[str, int]]] = {
    "lora+fsdp2, hidden 256, 2 x 8 tokens": (2, 8, {"hidden_size": 256, "intermediate_size": 512}),
    "zero2+amp+ckpt, hidden 256, 4 layers, 2 x 8 tokens": (2, 8, {"hidden_size": 256, "intermediate_size": 512,
                                                                 "num_hidden_layers": 4}),
    "fsdp2+ckpt, hidden 256, 2 x 8 tokens": (2, 8, {"hidden_size": 256, "intermediate_size": 512}),
    "lora+fsdp2, GPT-NeoX, 4 x 128 tokens": (4, 128, {})}


def tiny_gpt_neox() -> nn.Module:
    """A GPT-NeoX (fused query_key_value, partial rotary embeddings, use_cache on by default)."""
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0))


# Backends measured on another model than tiny_llama.
MODELS: Dict[str, Callable[[], nn.Module]] = {"lora+fsdp2, GPT-NeoX, 4 x 128 tokens": tiny_gpt_neox}


def _optim_func(strategy: List[Any]) -> Any:
    """DeepSpeed's CPU Adam where ds_config offloads the optimizer (DeepSpeed requires it), else AdamW."""
    if "offload_optimizer" in repr(strategy):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam
    return torch.optim.AdamW


def _measure(strategy: List[Any], batch_size: int = BATCH, seq: int = SEQ,
             model_overrides: Optional[Dict[str, int]] = None,
             build: Optional[Callable[[], nn.Module]] = None) -> Dict[str, float]:
    """Bytes this rank holds after the second backward pass, and what the cost model predicts."""
    optim_func = _optim_func(strategy)
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        model = build() if build is not None else tiny_llama(seed=0, **(model_overrides or {}))
        predicted = estimate(model, strategy, batch_size, seq, WORLD, "cpu")
        status, result, _ = auto_accelerate(
            model, optim_func=optim_func, dataset=TokenDataset(seq_len=seq), optim_args={"lr": 1e-3},
            model_input_format="unpack_dict", dataloader_args={"batch_size": batch_size}, load_strategy=strategy)
        del model
        assert status
        engine, pipeline = result.args.get("engine"), result.args.get("pipeline")
        batches = iter(result.dataloader)
        for _ in range(2):
            batch = next(batches)
            backward_only(result, batch)
            live = settled_live_bytes(tracker)
            module = engine.module if engine is not None else result.model
            reachable = memory_breakdown(module, engine.optimizer if engine is not None else result.optim)
            optimizer_step(result)
        if engine is not None:
            engine.destroy()
        del result, engine, pipeline, batches, batch
    dist.barrier()
    breakdown = {k[len("mem_"):]: v for k, v in predicted.breakdown.items() if k.startswith("mem_")}
    return {"measured": live, "peak": tracker.peak_bytes, "predicted_peak": predicted.peak_memory_bytes,
            "predicted": resident_bytes(breakdown), "reachable": reachable.as_dict(),
            "measured_params_and_optimizer": reachable.param_bytes + reachable.optim_state_bytes,
            "predicted_params_and_optimizer": sum(breakdown.get(k, 0.0) for k in ("params", "master", "optimizer"))}


def _measure_all() -> Dict[str, Dict[str, float]]:
    return {name: _measure(strategy, *SIZES.get(name, (BATCH, SEQ, {})), build=MODELS.get(name))
            for name, strategy in BACKENDS.items()}


@pytest.fixture(scope="module")
def per_rank() -> List[Dict[str, Dict[str, float]]]:
    return run_distributed(_measure_all, WORLD, timeout=900)


@pytest.mark.heavy
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_resident_memory_within_10_percent_of_measured(backend, per_rank):
    for rank, results in enumerate(per_rank):
        r = results[backend]
        ratio = r["predicted"] / r["measured"]
        print(f"| {backend} | {rank} | {r['measured']:.0f} | {r['predicted']:.0f} | {ratio:.3f} |")   # pytest -s
        assert abs(ratio - 1) <= TOLERANCE, (f"{backend} rank {rank}: predicted {r['predicted']:.0f} B, measured "
                                             f"{r['measured']:.0f} B (ratio {ratio:.3f}); reachable {r['reachable']}")


@pytest.mark.heavy
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_parameters_and_optimizer_state_within_10_percent(backend, per_rank):
    for rank, results in enumerate(per_rank):
        r = results[backend]
        measured, predicted = r["measured_params_and_optimizer"], r["predicted_params_and_optimizer"]
        assert abs(predicted / measured - 1) <= TOLERANCE, (backend, rank, predicted, measured, r["reachable"])


@pytest.mark.heavy
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_peak_within_15_percent_of_measured(backend, per_rank):
    # The heaviest rank (a pipeline's last stage holds the loss), over the build and two training
    # steps shaped like train_step (the output is dropped before backward).
    measured = max(results[backend]["peak"] for results in per_rank)
    predicted = per_rank[0][backend]["predicted_peak"]
    print(f"| {backend} | peak | {measured:.0f} | {predicted:.0f} | {predicted / measured:.3f} |")   # pytest -s
    assert abs(predicted / measured - 1) <= PEAK_TOLERANCE, (backend, predicted, measured, predicted / measured)


@pytest.mark.heavy
def test_deepspeed_stage1_holds_only_its_gradient_partition(per_rank):
    # DeepSpeed's stage-1 optimizer copies each reduced bucket's slice into one partition buffer,
    # so after backward it holds what stage 2 holds (the model's assumption; the ZeRO paper's
    # P_os column assumes whole gradients).
    for results in per_rank:
        stage1, stage2 = results["deepspeed zero1 bf16"]["measured"], results["deepspeed zero2 bf16"]["measured"]
        assert abs(stage1 - stage2) <= 0.01 * stage2, (stage1, stage2)
