"""The cost model's per-rank memory against torch's own accounting, at scales this machine cannot run.

Ground truth for one rank of an N-rank job, in one process and without memory:

- the real Hugging Face Llama built under `FakeTensorMode` (shapes and dtypes, no storage);
- the real atorch optimizations (`auto_accelerate` with the strategy) over torch's fake process
  group (`atorch.testing.fake_distributed`), so FSDP2 shards, gathers and reduce-scatters as
  it would on rank 0 of N;
- `torch.distributed._tools` memory trackers over two training steps (forward, backward,
  AdamW step; the second step is the one reported, with the optimizer state allocated):
  `FSDPMemTracker` for FSDP2 (sharded/unsharded parameters and gradients, optimizer state,
  activations, temporaries, all-gather/reduce-scatter buffers), `MemTracker` otherwise.

Reported per configuration: model states (parameters, gradients and optimizer state held right
after the second backward pass) and the forward/backward peak (the optimizer step is left out:
see `_step_outside_peak`), measured and predicted
(`atorch.auto.cost_model.estimate`), and their ratio model/measured.

    python benchmarks/memory_model.py                      # the table of benchmarks/RESULTS.md
    python benchmarks/memory_model.py --models 1b --worlds 8 --strategies fsdp+amp
    python benchmarks/memory_model.py --models 1b --worlds 8 \
        --strategies "fsdp+amp+checkpoint+accumulate2,fsdp+amp+checkpoint+accumulate2 sync once"
    python benchmarks/memory_model.py --save m.json; python benchmarks/memory_model.py --load m.json  # re-predict
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import (AutoModelForCausalLM, BloomConfig, DeepseekV3Config, FalconConfig, Gemma2Config,
                          Gemma3TextConfig, GPT2Config, GPTJConfig, GPTNeoXConfig, LlamaConfig, MixtralConfig,
                          Olmo2Config, OlmoeConfig, OPTConfig, Phi3Config, PretrainedConfig, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Starcoder2Config)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from atorch.auto import auto_accelerate
from atorch.auto.cost_model import PHASES, estimate, peak_bytes
from atorch.testing.fake_distributed import fake_process_group

GIB = 2 ** 30
VOCAB = 32000

# Public Llama-family shapes: TinyLlama-1.1B, OpenLLaMA-3B, Llama-2-7B (vocabulary 32000, untied
# head); and other architectures: GPT-2 XL (LayerNorm, GELU MLP, learned positions, tied head,
# vocabulary 50257), Qwen2-1.5B (GQA with 2 KV heads, q/k/v biases, tied head, vocabulary 151936)
# and Mistral-7B (GQA with 8 KV heads, vocabulary 32000). Non-Llama layouts the cost model reads
# off the model class (`ModelShape.from_config`): Pythia-1.4B (GPT-NeoX: fused qkv with biases,
# LayerNorm, two-matrix GELU MLP, parallel residual, untied head, vocabulary 50304), Qwen3-0.6B
# (16 heads of 128 on a width of 1024, q/k norms, tied head, vocabulary 151936) and a small
# Mixtral-style mixture of experts (8 experts of width 2816, top-2; 1.2B parameters, 0.4B active); a Qwen3-MoE
# (32 experts of width 768, top-4; 1.0B parameters) for LoRA on the fused expert weights.
OTHER_MODELS: Dict[str, Any] = {
    "gpt2-xl": lambda: GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "qwen2-1.5b": lambda: Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                      num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                      tie_word_embeddings=True),
    "mistral-7b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=VOCAB,
                                      tie_word_embeddings=False),
    "pythia-1.4b": lambda: GPTNeoXConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                         num_attention_heads=16, vocab_size=50304, rotary_pct=0.25,
                                         max_position_embeddings=2048, tie_word_embeddings=False,
                                         hidden_dropout=0.0, attention_dropout=0.0),
    "qwen3-0.6b": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      vocab_size=151936, tie_word_embeddings=True),
    "moe-1.2b": lambda: MixtralConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                      num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                      num_experts_per_tok=2, vocab_size=VOCAB, tie_word_embeddings=False),
    # Session 29: architectures the model was not developed on, public layouts scaled to 0.8-2B.
    # Gemma-2-2B shape, 18 of 26 layers: head_dim 256, 8 q / 4 kv heads, softcapping, alternating window, tied 256000.
    "gemma2-2b": lambda: Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=18,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                      sliding_window=512, tie_word_embeddings=True),
    # Gemma-3-1B text as published (26 layers, 1 kv head, 5:1 local/global, window 512, vocab 262144, tied).
    "gemma3-1b": lambda: Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                          vocab_size=262144, sliding_window=512, tie_word_embeddings=True),
    # Phi-3-mini shape, 14 of 32 layers (fused qkv_proj, gate_up_proj; vocab 32064, untied).
    "phi3-mini-14l": lambda: Phi3Config(hidden_size=3072, intermediate_size=8192, num_hidden_layers=14,
                                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attention_dropout=0.0, pad_token_id=0),
    # Falcon-7B layout (multi-query, parallel attention, one LayerNorm) at width 2048, 24 layers, vocab 65024.
    "falcon-mq-1.2b": lambda: FalconConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                                           multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                           vocab_size=65024, hidden_dropout=0.0, attention_dropout=0.0, alibi=False,
                                           bias=False),
    # Falcon-40B/180B layout (new_decoder_architecture: 8 kv groups, two LayerNorms) at width 2048, 24 layers.
    "falcon-new-1.2b": lambda: FalconConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                                            num_kv_heads=8, new_decoder_architecture=True, parallel_attn=True,
                                            vocab_size=65024, hidden_dropout=0.0, attention_dropout=0.0, alibi=False,
                                            bias=False),
    # OPT-1.3B as published (pre-LN, ReLU, learned positions, tied 50272).
    "opt-1.3b": lambda: OPTConfig(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                                  vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048,
                                  do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0),
    # OPT-350m layout (post-LN, 512-wide embeddings projected in/out) scaled to width 2048 (0.9B).
    "opt-postln-0.9b": lambda: OPTConfig(hidden_size=2048, ffn_dim=8192, num_hidden_layers=16, num_attention_heads=32,
                                         vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=512,
                                         do_layer_norm_before=False, dropout=0.0, attention_dropout=0.0),
    # BLOOM-1b1 as published (ALiBi, embedding LayerNorm, tied 250880).
    "bloom-1b1": lambda: BloomConfig(hidden_size=1536, n_layer=24, n_head=16, vocab_size=250880,
                                     hidden_dropout=0.0, attention_dropout=0.0),
    # StarCoder2-3B shape, 16 of 30 layers (GQA 2 kv, biases, GELU c_fc/c_proj MLP, LayerNorm, tied 49152).
    "starcoder2-16l": lambda: Starcoder2Config(hidden_size=3072, intermediate_size=12288, num_hidden_layers=16,
                                               num_attention_heads=24, num_key_value_heads=2, vocab_size=49152,
                                               sliding_window=4096, tie_word_embeddings=True, residual_dropout=0.0,
                                               embedding_dropout=0.0, attention_dropout=0.0),
    # OLMo-2-1B as published (post-norms on attention/MLP outputs, q/k norms over all heads, vocab 100352, untied).
    "olmo2-1b": lambda: Olmo2Config(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                                    tie_word_embeddings=False),
    # Qwen1.5-MoE-A2.7B layout (60 experts top-4 + gated shared expert) at width 1024, 12 layers.
    "qwen2-moe-1.6b": lambda: Qwen2MoeConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                                             num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                                             num_experts_per_tok=4, moe_intermediate_size=512,
                                             shared_expert_intermediate_size=2816, vocab_size=151936,
                                             tie_word_embeddings=False, mlp_only_layers=[], decoder_sparse_step=1),
    # OLMoE-1B-7B layout (64 experts top-8, q/k norms) at width 1024, 12 layers.
    "olmoe-1.3b": lambda: OlmoeConfig(hidden_size=1024, intermediate_size=512, num_hidden_layers=12,
                                      num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                      num_experts_per_tok=8, vocab_size=50304, tie_word_embeddings=False),
    # DeepSeek-V3 layout (MLA, 1 dense layer then shared + routed experts, sigmoid group routing), width 1536, 11 layers
    "deepseek-v3-1.2b": lambda: DeepseekV3Config(hidden_size=1536, intermediate_size=4096, moe_intermediate_size=768,
                                                 num_hidden_layers=11, first_k_dense_replace=1,
                                                 num_attention_heads=16, num_key_value_heads=16, n_routed_experts=32,
                                                 n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                                                 q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=32,
                                                 qk_nope_head_dim=64, v_head_dim=64, vocab_size=32000,
                                                 tie_word_embeddings=False,
                                                 rope_scaling=None),
    # GPT-J-6B layout (parallel attn+MLP, partial rotary, gelu_new, biased head) at width 2048, 20 layers.
    "gptj-1.2b": lambda: GPTJConfig(n_embd=2048, n_layer=20, n_head=16, rotary_dim=64, n_positions=2048,
                                    vocab_size=50400, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    tie_word_embeddings=False),
    # Llama-3.2-1B as published: the input embedding tied to the LM head, 128256 tokens (the tied embedding's
    # backward holds three vocab x hidden gradients: `memory._sums_tied_head`).
    "llama3.2-1b": lambda: LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                       tie_word_embeddings=True),
    # transformers 5 fuses each layer's experts into 3-D weights, which peft's LoRA adapts whole.
    "qwen3-moe-1b": lambda: Qwen3MoeConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                                           num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                                           num_experts_per_tok=4, moe_intermediate_size=768, vocab_size=VOCAB,
                                           mlp_only_layers=[], tie_word_embeddings=False),
}
MODELS: Dict[str, Dict[str, int]] = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=32),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
}
# module_replace: the model runs sdpa attention (what Hugging Face picks by default), and the
# cost model is told so (no b x heads x s^2 attention matrix).
STRATEGIES: Dict[str, List[Any]] = {
    "fsdp+amp": ["parallel_mode", "module_replace", "amp_native", "fsdp"],
    "zero2+amp": ["parallel_mode", "module_replace", "amp_native", "zero2"],
    "fsdp fp32": ["parallel_mode", "module_replace", "fsdp"],
    "fsdp+amp+checkpoint": ["parallel_mode", "module_replace", "amp_native", "fsdp", "checkpoint"],
    "fsdp fp32+checkpoint": ["parallel_mode", "module_replace", "fsdp", "checkpoint"],
    "zero2+amp+checkpoint": ["parallel_mode", "module_replace", "amp_native", "zero2", "checkpoint"],
    # Two micro-batches per step: FSDP2 reduce-scatters in each (the default), or once a step, keeping
    # every unit's unsharded fp32 gradient through the second micro-step.
    "fsdp+amp+checkpoint+accumulate2": ["parallel_mode", "module_replace", "amp_native", "fsdp", "checkpoint",
                                        ("gradient_accumulation", 2)],
    "fsdp+amp+checkpoint+accumulate2 sync once": [
        "parallel_mode", "module_replace", "amp_native", "fsdp", "checkpoint",
        ("gradient_accumulation", {"steps": 2, "sync_each_micro_step": False})],
    # LoRA on the attention and on every expert projection (peft moves gate/up/down onto the fused expert weights).
    "lora experts+fsdp+amp": ["parallel_mode", "module_replace", "amp_native", "fsdp",
                              ("lora", {"r": 16, "target_modules": ("q_proj", "v_proj", "gate_proj", "up_proj",
                                                                    "down_proj")})],
    "lora experts+fsdp+amp+checkpoint": ["parallel_mode", "module_replace", "amp_native", "fsdp", "checkpoint",
                                         ("lora", {"r": 16, "target_modules": ("q_proj", "v_proj", "gate_proj",
                                                                               "up_proj", "down_proj")})],
}
# Strategies run by default (the accumulation rows are asked for by name: --strategies).
DEFAULT_STRATEGIES = ("fsdp+amp", "zero2+amp", "fsdp fp32", "fsdp+amp+checkpoint")


@dataclass
class Row:
    model: str
    params_b: float
    world: int
    strategy: str
    measured_states: float
    predicted_states: float
    measured_peak: float
    predicted_peak: float
    seconds: float
    predicted_step_peak: float = 0.0    # the model's peak with the optimizer step (not measured here)


def llama_config(name: str) -> PretrainedConfig:
    """The config of `name` (a key of MODELS or OTHER_MODELS), with sdpa attention where its model class has it
    (BLOOM and Gemma 2 have eager attention only in transformers 5)."""
    if name in OTHER_MODELS:
        config = OTHER_MODELS[name]()
    else:
        config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **MODELS[name])
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    return config


def _tracker(model: torch.nn.Module, optim: torch.optim.Optimizer, fsdp: bool) -> Any:
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optim)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optim)
    return tracker


def _states(snapshot: Dict[Any, Dict[Any, int]]) -> int:
    """Parameters, gradients and optimizer state in a tracker snapshot (sharded or not)."""
    kinds = ("Sharded Param", "Unsharded Param", "Sharded Grad", "Unsharded Grad", "Parameter", "Gradient",
             "OptState")
    return sum(v for stats in snapshot.values() for k, v in stats.items()
               if getattr(k, "value", k) in kinds)


def _step_outside_peak(tracker: Any, optim: torch.optim.Optimizer) -> None:
    """`optim.step()` with the tracker's peak left as it was before the step.

    Under FakeTensorMode the trackers count an AdamW step on FSDP2's DTensor shards as 25 live
    copies of the largest local shard (measured: one sharded Linear, world 8), where the same step
    on real tensors holds 3 copies of every shard + 2 of the largest (torch's per-tensor AdamW, the
    CPU default) or 1 of every shard (foreach, the CUDA default). On the checkpointed rows that
    phantom was the measured peak (Qwen2-1.5B: 2.7 GiB of it). So the peak reported is the
    forward/backward peak; the optimizer step's transient is checked on real tensors
    (tests/unit/test_cost_model_moments.py) instead.
    """
    peak, peak_snap = dict(tracker._peak_mem), dict(tracker._peak_mem_snap)
    optim.step()
    tracker._peak_mem, tracker._peak_mem_snap = peak, peak_snap


def _accumulation_steps(strategy: List[Any]) -> int:
    """Micro-steps per step of `strategy`, as its `gradient_accumulation` config parses (1 without one)."""
    from atorch.auto.opt_lib.base import get_optimization
    from atorch.auto.strategy import Strategy

    accumulation = get_optimization("gradient_accumulation")
    configs = [accumulation.parse_config(item.config) for item in Strategy.from_any(strategy)
               if item.name == accumulation.name]
    return configs[0].steps if configs else 1


# The device type the cost model is asked about (--predict-device). The tracker's fake tensors are CPU tensors,
# so the attention kernels torch picks are the CPU's: "cpu" compares like with like where that matters (sdpa's
# math-path fallback, `ModelShape.sdpa_quadratic_bytes`); "cuda" (the default) is what the tables above used.
PREDICT_DEVICE = "cuda"


def predict(row: Row, micro_batch: int, seq: int) -> Row:
    """`row` with the cost model's current predictions (`micro_batch` rows per micro-step and rank)."""
    config, strategy = llama_config(row.model), STRATEGIES[row.strategy]
    global_batch = micro_batch * _accumulation_steps(strategy) * row.world
    predicted = estimate(config, strategy, global_batch, seq, row.world, PREDICT_DEVICE)
    bd = predicted.breakdown
    states = sum(bd.get(f"mem_{k}", 0.0) for k in ("params", "grads", "master", "optimizer"))
    memory = {k[len("mem_"):]: v for k, v in bd.items() if k.startswith("mem_")}
    # The measured peak is forward and backward (see _step_outside_peak): compare like with like.
    return dataclasses.replace(row, predicted_states=states, predicted_peak=peak_bytes(memory, PHASES[:-1]),
                               predicted_step_peak=predicted.peak_memory_bytes)


def measure(model_name: str, world: int, strategy_name: str, micro_batch: int, seq: int) -> Row:
    """One rank (rank 0) of `world` fake ranks: model states after backward, and the peak, in bytes."""
    from atorch.auto.train_step import _no_sync

    config, strategy = llama_config(model_name), STRATEGIES[strategy_name]
    micro_steps = _accumulation_steps(strategy)
    start = time.monotonic()
    with fake_process_group(0, world):
        # LoRA adds its adapters as real tensors (auto_accelerate runs outside the fake mode): the step takes them in.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = AutoModelForCausalLM.from_config(config)
            ids = torch.randint(0, config.vocab_size, (micro_batch, seq))
        num_params = sum(p.numel() for p in model.parameters())
        # auto_accelerate runs outside the fake mode: its device mesh needs real tensors; the
        # model's parameters stay fake, so every op on them is faked anyway.
        ok, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-4},
                                        load_strategy=strategy)
        if not ok:
            raise RuntimeError(f"auto_accelerate failed for {strategy_name}")
        tracker = _tracker(result.model, result.optim, fsdp="fsdp" in strategy or "zero2" in strategy)
        if hasattr(tracker, "track_inputs"):
            tracker.track_inputs((ids,))
        with mode, tracker:
            for step in range(2):
                for micro in range(micro_steps):    # train_step's gradient sync, on a micro-batch of `ids`
                    if micro:
                        tracker.reset_mod_stats()   # FSDPMemTracker: one forward per module between resets
                    with _no_sync(result.model, micro == micro_steps - 1, result.sync_each_micro_step):
                        loss = result.model(input_ids=ids, labels=ids).loss
                        loss.backward()
                if step == 1:
                    states = _states(tracker.get_tracker_snapshot())
                _step_outside_peak(tracker, result.optim)
                result.optim.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        peak = max(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())
    row = Row(model_name, num_params / 1e9, world, strategy_name, states, 0.0, peak, 0.0, time.monotonic() - start)
    return predict(row, micro_batch, seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1b,3b,7b")
    parser.add_argument("--worlds", default="8,64")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--save", help="write the measured rows to this JSON file")
    parser.add_argument("--load", help="measure nothing: re-predict the rows of this JSON file")
    parser.add_argument("--predict-device", default="cuda", choices=("cuda", "cpu"),
                        help="the device type the cost model is asked about (see PREDICT_DEVICE)")
    args = parser.parse_args()
    global PREDICT_DEVICE
    PREDICT_DEVICE = args.predict_device
    print(f"micro-batch {args.micro_batch} x seq {args.seq} per rank, AdamW, torch {torch.__version__}\n")
    print("| model | params (B) | ranks | strategy | states measured GiB | model | ratio | peak measured GiB | model | "
          "ratio | model with step GiB | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases: List[Tuple[str, int, str]] = [(m, int(w), s) for m in args.models.split(",")
                                         for w in args.worlds.split(",") for s in args.strategies.split(",")]
    if args.load:
        with open(args.load) as f:
            rows = (predict(Row(**raw), args.micro_batch, args.seq) for raw in json.load(f))
    else:
        rows = (measure(m, w, s, args.micro_batch, args.seq) for m, w, s in cases)
    done = []
    for r in rows:
        done.append(dataclasses.asdict(r))
        print(f"| {r.model} | {r.params_b:.2f} | {r.world} | {r.strategy} | {r.measured_states / GIB:.2f} | "
              f"{r.predicted_states / GIB:.2f} | {r.predicted_states / r.measured_states:.3f} | "
              f"{r.measured_peak / GIB:.2f} | {r.predicted_peak / GIB:.2f} | "
              f"{r.predicted_peak / r.measured_peak:.3f} | {r.predicted_step_peak / GIB:.2f} | {r.seconds:.0f} |",
              flush=True)
        if args.save:
            with open(args.save, "w") as f:
                json.dump(done, f, indent=1)


if __name__ == "__main__":
    main()
