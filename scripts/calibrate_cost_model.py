"""Fit the cost model's constants (atorch/auto/cost_model/) to measured runs on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/calibrate_cost_model.py [--quick]
    OMP_NUM_THREADS=1 .venv/bin/python scripts/calibrate_cost_model.py --check   # predicted vs measured, 2 ranks

Memory: per-rank peak tensor bytes (atorch.utils.peak_memory, exact on CPU) of plain training
steps of tiny Llama / GPT-2 variants (batch, sequence, layers, width, vocabulary varied), in
fp32 and under bf16 autocast, with and without activation checkpointing of every block. The
exactly known part (parameters + gradients + Adam state) is subtracted and the rest is fitted
by non-negative least squares on the activation features of the cost model. The training loop
is shaped like `atorch.auto.train_step` (the model output stays referenced through backward).
Time: the fastest of 5 steps of a second grid (tiny to hidden 512) fitted to
FLOPs / rate + layers * overhead + constant; gloo all-reduce times on 2 processes fitted to
latency + bytes / bandwidth. Prints the two dicts to paste into
atorch/auto/cost_model/step_time.py, and the relative error of the fitted memory model on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Dict, List, Tuple

import numpy as np
import torch
from scipy.optimize import nnls

from atorch.auto.cost_model import ModelShape
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.parity import TokenDataset, global_batches
from atorch.utils.peak_memory import PeakMemoryTracker

STEPS = 3
MEMORY_FEATURES = {"plain": ["layer_bsh", "layer_bsf", "layer_bas2", "bsv", "bsh"],
                   "checkpoint": ["bsh", "bsf", "bas2", "bsv"]}
# Known exactly, not fitted: a checkpointed block keeps only its input, the fp32 residual stream
# (4 bytes per element, under autocast too).
FIXED = {"checkpoint": {"layer_bsh": 4.0}}


def build(kind: str, layers: int, hidden: int, ffn: int, vocab: int, heads: int) -> torch.nn.Module:
    if kind == "llama":
        return tiny_llama(seed=0, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
                          vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=heads)
    return tiny_gpt2(seed=0, n_layer=layers, n_embd=hidden, n_inner=ffn, vocab_size=vocab, n_head=heads)


def run(kind: str, b: int, s: int, layers: int, hidden: int, ffn: int, vocab: int, heads: int, checkpoint: bool,
        amp: bool, steps: int = STEPS, track: bool = True) -> Tuple[int, float, ModelShape]:
    """(peak bytes over `steps` steps, fastest step's seconds, shape) of plain AdamW training."""
    model0 = build(kind, layers, hidden, ffn, vocab, heads)
    if checkpoint:
        model0.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = ModelShape.from_module(model0)
    batches = global_batches(TokenDataset(n=b * steps, seq_len=s, vocab_size=vocab), b, steps)
    times = []
    with PeakMemoryTracker(torch.device("cpu")) if track else contextlib.nullcontext() as tracker:
        model = copy.deepcopy(model0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in batches:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                # Like atorch.auto.train_step: the model output (logits) stays referenced through backward.
                output = model(**batch)
            loss = output.loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            del output, loss
            times.append(time.perf_counter() - start)
    # The fastest step after the first: the least disturbed by other processes on a shared machine.
    return (tracker.peak_bytes if track else 0), min(times[1:]), shape


def features(shape: ModelShape, b: int, s: int, checkpoint: bool) -> Dict[str, float]:
    L, h, f, a, v = shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.vocab_size
    if checkpoint:
        return {"layer_bsh": L * b * s * h, "bsh": b * s * h, "bsf": b * s * f, "bas2": b * a * s * s,
                "bsv": b * s * v}
    return {"layer_bsh": L * b * s * h, "layer_bsf": L * b * s * f, "layer_bas2": L * b * a * s * s,
            "bsv": b * s * v, "bsh": b * s * h}


CHECK_STRATEGIES = [
    ["parallel_mode"], ["parallel_mode", "amp_native"], ["parallel_mode", "checkpoint"],
    ["parallel_mode", "module_replace"], ["parallel_mode", "zero1"], ["parallel_mode", "zero2"],
    ["parallel_mode", "fsdp"], ["parallel_mode", "amp_native", "fsdp", "checkpoint"],
    [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"],
]


def _check_on_two_ranks(global_batch: int, seq: int) -> List[tuple]:
    import torch.distributed as dist

    from atorch.auto.cost_model import estimate
    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy

    ctx = ModelContext(model=tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=64, seq_len=seq), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": global_batch})
    rows = []
    for s in CHECK_STRATEGIES:
        strategy = Strategy(s)
        r = dry_run(ctx, strategy, DryRunConfig(warmup_steps=2, profile_steps=3))
        e = estimate(ctx.model, strategy, global_batch, seq, dist.get_world_size(), "cpu")
        rows.append((strategy.describe(), r.peak_memory_bytes, e.peak_memory_bytes, r.throughput,
                     e.throughput(global_batch), r.error))
    return rows


def check() -> None:
    """The fitted model against real strategies on 2 gloo ranks (the numbers in benchmarks/RESULTS.md)."""
    from atorch.testing import run_distributed

    print("| strategy (tiny Llama, global batch 8 x 64 tokens, 2 ranks) | measured MB | predicted MB | "
          "error | measured samples/s | predicted samples/s |")
    print("|---|---|---|---|---|---|")
    for name, measured, predicted, tp, ptp, error in run_distributed(_check_on_two_ranks, 2, 8, 64, timeout=900)[0]:
        if error:
            print(f"| {name} | failed: {error} | | | | |")
            continue
        print(f"| {name} | {measured / 1e6:.2f} | {predicted / 1e6:.2f} | {(predicted - measured) / measured:+.1%} | "
              f"{tp:.0f} | {ptp:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--check", action="store_true",
                        help="only compare the current constants with dry runs of real strategies on 2 ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.check:
        check()
        return
    # (kind, batch, seq, layers, hidden, ffn, vocab, heads): each feature varies on its own somewhere.
    grid = [("llama", 8, 64, 2, 64, 128, 1024, 4), ("llama", 2, 64, 2, 64, 128, 1024, 4),
            ("llama", 8, 128, 2, 64, 128, 1024, 4), ("llama", 8, 64, 4, 64, 128, 1024, 4),
            ("llama", 8, 64, 2, 128, 256, 1024, 4), ("llama", 8, 64, 2, 64, 128, 4096, 4),
            ("llama", 8, 64, 2, 64, 512, 1024, 4), ("llama", 8, 64, 2, 64, 128, 1024, 16),
            ("llama", 4, 256, 1, 64, 128, 512, 2), ("llama", 16, 32, 6, 32, 64, 256, 2),
            ("llama", 4, 32, 3, 96, 384, 2048, 4), ("gpt2", 8, 64, 2, 64, 128, 1024, 4),
            ("gpt2", 4, 128, 3, 64, 256, 1024, 8), ("gpt2", 8, 32, 4, 128, 128, 512, 4)]
    if args.quick:
        grid = grid[:8]
    rows: List[dict] = []
    for cfg in grid:
        for checkpoint in (False, True):
            for amp in (False, True):
                peak, seconds, shape = run(*cfg, checkpoint=checkpoint, amp=amp)
                rows.append({"cfg": cfg, "checkpoint": checkpoint, "amp": amp, "peak": peak, "seconds": seconds,
                             "shape": shape})
                print(f"{cfg} checkpoint={checkpoint} amp={amp}: peak {peak} B, step {seconds * 1e3:.1f} ms",
                      flush=True)

    coefficients: Dict[str, Dict[str, float]] = {}
    for amp in (False, True):
        for checkpoint in (False, True):
            key = ("bf16" if amp else "fp32") + ("_checkpoint" if checkpoint else "")
            names = MEMORY_FEATURES["checkpoint" if checkpoint else "plain"] + (["matmul_params"] if amp else [])
            sel = [r for r in rows if r["amp"] == amp and r["checkpoint"] == checkpoint]
            X, y = [], []
            for r in sel:
                shape, (_, b, s, *_rest) = r["shape"], r["cfg"]
                feats = features(shape, b, s, checkpoint)
                feats["matmul_params"] = shape.num_params - shape.embedding_params / 2
                fixed = FIXED.get("checkpoint" if checkpoint else "plain", {})
                X.append([feats[n] for n in names])
                # The peak is the activation phase (atorch.auto.cost_model.peak_bytes): params + Adam state
                # (12 bytes a parameter; gradients are None after zero_grad) + the LM head's gradient,
                # made first in backward (4 bytes an element) + activations. The fixed terms are exact.
                held = 12 * shape.num_params + 4 * shape.embedding_params / 2
                y.append(r["peak"] - held - sum(v * feats[n] for n, v in fixed.items()))
            coef, _ = nnls(np.array(X, dtype=float), np.array(y, dtype=float))
            coefficients[key] = {**fixed, **{n: round(float(c), 3) for n, c in zip(names, coef)}}
            pred = np.array(X) @ coef + np.array([r["peak"] for r in sel]) - np.array(y)
            errs = [(p - r["peak"]) / r["peak"] for p, r in zip(pred, sel)]
            worst = int(np.argmax(np.abs(errs)))
            print(f"{key}: max |relative error| {abs(errs[worst]):.3f} over {len(sel)} runs (worst: {sel[worst]['cfg']})")

    # Step time: seconds = flops / rate + layers * overhead + constant, per dtype, on a grid
    # from overhead-dominated (the tiny models) to compute-dominated (hidden 512).
    time_grid = [("llama", 8, 64, 1, 64, 128, 1024, 4), ("llama", 8, 64, 2, 64, 128, 1024, 4),
                 ("llama", 8, 64, 4, 64, 128, 1024, 4), ("llama", 8, 128, 2, 256, 512, 1024, 4),
                 ("llama", 4, 128, 2, 512, 1024, 1024, 8), ("llama", 8, 128, 4, 256, 1024, 2048, 4)]
    times: Dict[str, float] = {}
    for amp in (False, True):
        X, y = [], []
        for cfg in time_grid:
            _, seconds, shape = run(*cfg, checkpoint=False, amp=amp, steps=6, track=False)
            b, s = cfg[1], cfg[2]
            matmul = shape.num_params - shape.embedding_params / 2
            flops = b * s * (6 * matmul + 12 * shape.num_layers * s * shape.hidden_size)
            X.append([flops, shape.num_layers, 1.0])
            y.append(seconds)
            print(f"time {cfg} amp={amp}: {seconds * 1e3:.1f} ms, {flops / seconds / 1e9:.2f} GFLOP/s", flush=True)
        coef, _ = nnls(np.array(X), np.array(y))
        times["flops_bf16" if amp else "flops_fp32"] = float(1.0 / coef[0]) if coef[0] > 0 else float("inf")
        if not amp:
            times["layer_overhead_s"], times["step_overhead_s"] = float(coef[1]), float(coef[2])
    times.update(measure_allreduce())
    print("\nACTIVATION_COEFFICIENTS =", coefficients)
    print("DEVICE_PROFILES['cpu'] =", {k: float(f"{v:.3g}") for k, v in times.items()})


def _allreduce_probe() -> List[Tuple[int, float]]:
    import torch.distributed as dist

    out = []
    for numel in (256, 16384, 262144, 1048576):
        t = torch.ones(numel)
        dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(t)
        out.append((numel * 4, (time.perf_counter() - start) / 5))
    return out


def measure_allreduce() -> Dict[str, float]:
    """gloo all-reduce on 2 local processes: latency + bytes / bandwidth (ring volume 2(n-1)/n = 1)."""
    from atorch.testing import run_distributed

    samples = run_distributed(_allreduce_probe, 2)[0]
    X = np.array([[1.0, nbytes] for nbytes, _ in samples])
    y = np.array([s for _, s in samples])
    coef, _ = nnls(X, y)
    return {"comm_latency_s": float(coef[0]), "comm_bytes_per_s": float(1.0 / coef[1]) if coef[1] > 0 else 1e12}


if __name__ == "__main__":
    main()
