"""The cost model against measured bytes for what the user brings, on 2 gloo ranks.

`test_memory_model.py` checks every backend with AdamW on the whole tiny Llama. These cases
change what the user hands over instead: another optimizer (SGD keeps no state, AdamW with
amsgrad three moments), parameters the user froze, gradient accumulation (the gradients of
earlier micro-steps live through the later ones), and a tied embedding on pipeline stages
(each end stage holds the shared matrix whole), LoRA's adapters on the model's own linears and on the
fused expert weights of a mixture of experts.
Before the cost model read them, the predictions were off by 0.65x-1.95x (benchmarks/RESULTS.md,
"(g) What the user brings").

Measured as in `test_memory_model.py`: live storage bytes right after the second backward pass, settled
(model states, DDP's buckets) against `resident_bytes`, and the peak over the build and two
training steps (`train_step`, so accumulation runs its micro-steps) against the predicted peak.
"""

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate, train_step
from atorch.auto.cost_model import estimate, optimizer_states, resident_bytes
from atorch.testing import run_distributed, tiny_gpt2, tiny_llama
from atorch.testing.live_memory import backward_only, optimizer_step, settled_live_bytes
from atorch.testing.parity import TokenDataset
from atorch.utils.peak_memory import PeakMemoryTracker

WORLD, BATCH, SEQ = 2, 8, 32
TOLERANCE = 0.10
PEAK_TOLERANCE = 0.15
PP2 = ("parallel_mode", ([("data", 1), ("pipeline", 2)], None))
TP2 = ("parallel_mode", ([("tensor", 2), ("data", 1)], None))
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAMW: Tuple[Any, Dict[str, Any]] = (torch.optim.AdamW, {"lr": 1e-3})


def qwen3_moe(hidden: int = 64, experts: int = 8, expert_width: int = 64) -> torch.nn.Module:
    """Every layer (2) a mixture of `experts` experts, fused by transformers into one 3-D weight per projection."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                            num_experts_per_tok=2, moe_intermediate_size=expert_width, mlp_only_layers=[],
                            tie_word_embeddings=False, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def qwen3_moe_large_experts() -> torch.nn.Module:
    """16 experts of 128 x 256 in each of 2 layers: the expert weights (25 MB in fp32) outweigh the activations."""
    return qwen3_moe(hidden=128, experts=16, expert_width=256)


MODELS = {"llama": lambda: tiny_llama(seed=0), "tied llama": lambda: tiny_llama(seed=0, tie_word_embeddings=True),
          "gpt2": lambda: tiny_gpt2(seed=0), "qwen3 moe": qwen3_moe,
          "qwen3 moe, large experts": qwen3_moe_large_experts}
EXPERT_TARGETS = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")

# name -> (strategy, optimizer, parameter names containing these are frozen, model, what is compared)
CASES: Dict[str, Tuple[List[Any], Tuple[Any, Dict[str, Any]], Tuple[str, ...], str, str]] = {
    "sgd (no state)": (["parallel_mode"], (torch.optim.SGD, {"lr": 1e-3}), (), "llama", "resident"),
    "adamw amsgrad (three moments)": (["parallel_mode"], (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}), (),
                                      "llama", "resident"),
    "sgd momentum + torch zero1": (["parallel_mode", "zero1"], (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}), (),
                                   "llama", "resident"),
    "frozen embeddings + ddp": (["parallel_mode"], ADAMW, ("embed_tokens", "lm_head"), "llama", "resident"),
    "frozen embeddings + fsdp2": (["parallel_mode", "fsdp"], ADAMW, ("embed_tokens", "lm_head"), "llama", "resident"),
    "frozen embeddings + deepspeed zero2": (["amp_native", ("zero2", {"use_ds_zero": True})], ADAMW,
                                            ("embed_tokens", "lm_head"), "llama", "resident"),
    "accumulation + ddp": (["parallel_mode", ("gradient_accumulation", 2)], ADAMW, (), "llama", "peak"),
    "accumulation + fsdp2": (["parallel_mode", "fsdp", ("gradient_accumulation", 2)], ADAMW, (), "llama", "peak"),
    # One reduce-scatter per step: the unsharded gradients live through the later micro-steps.
    "accumulation + fsdp2, sync once": (["parallel_mode", "fsdp",
                                         ("gradient_accumulation", {"steps": 2, "sync_each_micro_step": False})],
                                        ADAMW, (), "llama", "peak"),
    "accumulation + deepspeed zero1": (["amp_native", ("zero1", {"use_ds_zero": True}),
                                        ("gradient_accumulation", 2)], ADAMW, (), "llama", "peak"),
    # atorch's accumulation runs the pipeline's schedule once per micro-step: a quarter of the rows per chunk.
    "accumulation + pipeline": ([PP2, ("gradient_accumulation", 4), "pipeline_parallel"], ADAMW, (), "llama", "peak"),
    "tied embedding on pipeline stages": ([PP2, "pipeline_parallel"], ADAMW, (), "tied llama", "resident"),
    # LoRA on every linear (the MLP's are hidden x intermediate), and its adapters under tensor
    # and pipeline parallelism (a pipeline stage also keeps a buffer per micro-batch).
    "lora on every linear": (["parallel_mode", ("lora", {"target_modules": ALL_LINEARS})], ADAMW, (), "llama",
                             "resident"),
    "lora + tensor parallel": ([TP2, "tensor_parallel", ("lora", {"target_modules": ALL_LINEARS})], ADAMW, (),
                               "llama", "resident"),
    "lora + pipeline": ([PP2, "pipeline_parallel", "lora"], ADAMW, (), "llama", "resident"),
    # peft adapts the fused expert weights for the expert projection names (A: rank x experts by d2, twice the
    # rank for gate_up_proj): predicted 0.53x measured while only the linears were counted.
    "lora on fused experts + ddp": (["parallel_mode", ("lora", {"target_modules": EXPERT_TARGETS})], ADAMW, (),
                                    "qwen3 moe", "resident"),
    "lora on fused experts + fsdp2": (["parallel_mode", ("lora", {"target_modules": EXPERT_TARGETS}), "fsdp"], ADAMW,
                                      (), "qwen3 moe", "resident"),
    # peft builds each adapted expert weight whole (W + B @ A) at every forward and the experts' matmuls save it:
    # a copy of every expert weight until backward (one block's when checkpointed); autocast saves half slices.
    "lora on fused experts + ddp, peak": (["parallel_mode", ("lora", {"target_modules": EXPERT_TARGETS})], ADAMW,
                                          (), "qwen3 moe, large experts", "peak"),
    "lora on fused experts + ddp + checkpoint, peak": (["parallel_mode", ("lora", {"target_modules": EXPERT_TARGETS}),
                                                        "checkpoint"], ADAMW, (), "qwen3 moe, large experts", "peak"),
    "lora on fused experts + ddp + autocast, peak": (["parallel_mode", ("lora", {"target_modules": EXPERT_TARGETS}),
                                                      "amp_native"], ADAMW, (), "qwen3 moe, large experts", "peak"),
    # GPT-2's learned position embedding, norms and row-parallel biases stay whole on every tensor rank.
    "gpt2 + tensor parallel": ([TP2, "tensor_parallel"], ADAMW, (), "gpt2", "resident"),
}


def _freeze(model: torch.nn.Module, frozen: Tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        if any(part in name for part in frozen):
            param.requires_grad_(False)


def _measure(strategy: List[Any], optimizer: Tuple[Any, Dict[str, Any]], frozen: Tuple[str, ...], model_name: str,
             what: str) -> Dict[str, float]:
    optim_func, optim_args = optimizer
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        model = MODELS[model_name]()
        _freeze(model, frozen)      # in a function: a loop variable here would keep the last parameter alive
        predicted = estimate(model, strategy, BATCH, SEQ, WORLD, "cpu", optimizer=optimizer_states(optim_func,
                                                                                                   optim_args))
        status, result, _ = auto_accelerate(
            model, optim_func=optim_func, dataset=TokenDataset(seq_len=SEQ), optim_args=optim_args,
            model_input_format="unpack_dict", dataloader_args={"batch_size": BATCH}, load_strategy=strategy)
        del model
        assert status
        engine, pipeline = result.args.get("engine"), result.args.get("pipeline")
        batches = iter(result.dataloader)
        live = 0
        for _ in range(2):
            batch = next(batches)
            if what == "peak":
                train_step(result, batch)
                continue
            backward_only(result, batch)
            live = settled_live_bytes(tracker)
            optimizer_step(result)
        if engine is not None:
            engine.destroy()
        del result, engine, pipeline, batches, batch
    dist.barrier()
    breakdown = {k[len("mem_"):]: v for k, v in predicted.breakdown.items() if k.startswith("mem_")}
    return {"measured": live, "predicted": resident_bytes(breakdown), "peak": tracker.peak_bytes,
            "predicted_peak": predicted.peak_memory_bytes}


def _measure_all() -> Dict[str, Dict[str, float]]:
    return {name: _measure(*case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def per_rank() -> List[Dict[str, Dict[str, float]]]:
    return run_distributed(_measure_all, WORLD, timeout=600)


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_prediction_within_tolerance_of_measured(case, per_rank):
    if CASES[case][4] == "peak":
        measured = max(results[case]["peak"] for results in per_rank)
        predicted = per_rank[0][case]["predicted_peak"]
        tolerance = PEAK_TOLERANCE
    else:
        measured = max(results[case]["measured"] for results in per_rank)
        predicted = per_rank[0][case]["predicted"]
        tolerance = TOLERANCE
    print(f"| {case} | {CASES[case][4]} | {measured:.0f} | {predicted:.0f} | {predicted / measured:.3f} |")  # -s
    assert abs(predicted / measured - 1) <= tolerance, (case, predicted, measured, predicted / measured)


@pytest.mark.heavy
def test_fsdp2_accumulation_costs_the_unsharded_gradients_only_when_synced_once(per_rank):
    """The two FSDP2 accumulation settings differ by what the first micro-step's gradients leave alive:
    their shards (the default) or the whole unsharded gradients (sync once); the predicted difference is
    the measured one (a smaller margin than the cases' own 15%, which alone would not tell them apart)."""
    once, each = "accumulation + fsdp2, sync once", "accumulation + fsdp2"
    measured = max(r[once]["peak"] for r in per_rank) - max(r[each]["peak"] for r in per_rank)
    predicted = per_rank[0][once]["predicted_peak"] - per_rank[0][each]["predicted_peak"]
    assert predicted > 0 and measured > 0, (predicted, measured)
    assert abs(predicted / measured - 1) <= 0.2, (predicted, measured)
