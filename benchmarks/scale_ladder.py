"""The scale ladder: Llama at ~125M / ~350M (real, 2 CPU ranks) and ~1.3B (fake tensors) with fsdp+amp+checkpoint.

Real rungs (`--sizes 125m,350m`), 2 gloo ranks, strategy parallel_mode + amp_native(bf16) + fsdp +
checkpoint through `auto_accelerate`, AdamW, a global batch of `--batch` x `--seq` tokens:

- set-up: seconds in `auto_accelerate` (the model is built before, timed apart);
- memory per rank against `cost_model.estimate(...).peak_memory_bytes`, two ways:
  tensor bytes (`PeakMemoryTracker`, exact storage accounting, as the dry runner measures:
  model construction, `auto_accelerate` and two training steps inside it) and the process's
  peak RSS (VmHWM, reset right before the model is built, read after the timed steps; it also
  holds the Python/torch runtime, allocator caching and gloo buffers);
- step time: `--steps` timed `train_step`s after the two tracked ones (median, min-max), wall and
  the process's CPU seconds (all its threads; less disturbed by other jobs than wall time);
- `atorch.checkpoint.save_checkpoint` / `load_checkpoint` seconds (model + AdamW state, both ranks,
  barrier to barrier, sha256 manifest included).

The 1.3B rung (`--fake 1.3b`): 2 x 1.3B with AdamW is ~21 GB of fp32 state, more than this shared
machine may use. Its memory is measured on rank 0 of 2 fake ranks under `FakeTensorMode` with
torch's `FSDPMemTracker` (benchmarks/memory_model.py's harness: the real atorch optimizations, no
storage); no step or checkpoint time is measured for it.

    flock /tmp/atorch-bench.lock flock /tmp/atorch-bigmem.lock nice -n 0 python benchmarks/scale_ladder.py
    python benchmarks/scale_ladder.py --sizes 125m --steps 2                     # one rung
    python benchmarks/scale_ladder.py --sizes "" --fake 1.3b                    # the fake-tensor rung only

Memory: the 350M rung peaks near 4 GB RSS per rank (8 GB for both); a watchdog stops the run if
the ranks together pass `--max-rss-gib` (default 11).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import torch
from transformers import LlamaConfig, LlamaForCausalLM

GIB = 2 ** 30
VOCAB = 32000
STRATEGY: List[Any] = ["parallel_mode", ("amp_native", torch.bfloat16), "fsdp", "checkpoint"]
# GPT-3 small / medium / XL widths and depths with Llama blocks (SwiGLU at ~8/3 h, untied head).
SIZES: Dict[str, Dict[str, int]] = {
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16),
    "1.3b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16),
}


def llama_config(size: str) -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, use_cache=False,
                         num_key_value_heads=SIZES[size]["num_attention_heads"], max_position_embeddings=2048,
                         **SIZES[size])
    config._attn_implementation = "sdpa"
    return config


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _barrier_timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(size: str, batch: int, seq: int, steps: int, ckpt_root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from atorch.auto import auto_accelerate, train_step
    from atorch.checkpoint import load_checkpoint, save_checkpoint
    from atorch.testing.parity import TokenDataset
    from atorch.utils.peak_memory import PeakMemoryTracker

    out: Dict[str, Any] = {"rss_start": _status_kb("VmRSS") * 1024}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                      # VmHWM := current RSS
    tracker = PeakMemoryTracker(torch.device("cpu"))
    with tracker:
        start = time.perf_counter()
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(size))
        out["build_s"] = time.perf_counter() - start
        out["params"] = sum(p.numel() for p in model.parameters())
        dataset = TokenDataset(n=batch * (steps + 4), seq_len=seq, vocab_size=VOCAB)
        dist.barrier()
        start = time.perf_counter()
        ok, result, _ = auto_accelerate(model, torch.optim.AdamW, dataset, optim_args={"lr": 1e-4},
                                        dataloader_args={"batch_size": batch}, load_strategy=STRATEGY)
        out["setup_s"] = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"auto_accelerate failed for {STRATEGY}")
        del model
        batches = iter(result.dataloader)
        for _ in range(2):                                # the second step has the optimizer state
            float(train_step(result, next(batches)))
    out["tensor_peak"] = tracker.peak_bytes
    times, cpu_times = [], []
    for _ in range(steps):
        b = next(batches)
        start, cpu = time.perf_counter(), time.process_time()
        float(train_step(result, b))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    out["step_s"], out["step_cpu_s"] = times, cpu_times
    out["rss_peak"] = _status_kb("VmHWM") * 1024

    ckpt = os.path.join(ckpt_root, size)
    out["save_s"] = _barrier_timed(lambda: save_checkpoint(result, ckpt, step=2))
    out["ckpt_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    out["load_s"] = _barrier_timed(lambda: load_checkpoint(result, ckpt))
    float(train_step(result, next(batches)))              # trains on after the load
    del result
    dist.barrier()
    return out


def predict(size: str, batch: int, seq: int) -> Any:
    from atorch.auto.cost_model import estimate

    return estimate(llama_config(size), STRATEGY, batch, seq, 2, "cpu")


def _watch_rss(limit_bytes: int, stop: threading.Event) -> None:
    """Kill this process group's children if together they pass `limit_bytes` RSS (shared machine)."""
    import psutil

    me = psutil.Process()
    while not stop.wait(0.5):
        children = me.children(recursive=True)
        total = 0
        for c in children:
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        if total > limit_bytes:
            print(f"watchdog: ranks hold {total / GIB:.1f} GiB > {limit_bytes / GIB:.1f} GiB; stopping", flush=True)
            for c in children:
                try:
                    c.kill()
                except psutil.Error:
                    pass
            return


def run_real(sizes: List[str], batch: int, seq: int, steps: int, max_rss_gib: float) -> None:
    from atorch.testing import run_distributed

    print("| model | params | set-up s (build s) | peak tensor GiB/rank (r0, r1) | predicted GiB | predicted/"
          "measured | peak RSS GiB/rank | predicted/RSS | step s (median, min-max over ranks x steps) | "
          "CPU s/step (all threads) | predicted step s | checkpoint GB | save s | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_rss, args=(int(max_rss_gib * GIB), stop), daemon=True)
        watcher.start()
        ckpt_root = tempfile.mkdtemp(prefix="atorch-ladder-", dir=os.environ.get("ATORCH_LADDER_DIR"))
        try:
            ranks = run_distributed(_rank, 2, size, batch, seq, steps, ckpt_root, timeout=1800,
                                    env={"OMP_NUM_THREADS": "1"})
        finally:
            stop.set()
            shutil.rmtree(ckpt_root, ignore_errors=True)
        est = predict(size, batch, seq)
        tensor = [r["tensor_peak"] for r in ranks]
        rss = [r["rss_peak"] for r in ranks]
        all_steps = [t for r in ranks for t in r["step_s"]]
        cpu_steps = [t for r in ranks for t in r["step_cpu_s"]]
        print(f"| {size} | {ranks[0]['params'] / 1e6:.0f}M | {max(r['setup_s'] for r in ranks):.1f} "
              f"({max(r['build_s'] for r in ranks):.1f}) | {max(tensor) / GIB:.2f} ({tensor[0] / GIB:.2f}, "
              f"{tensor[1] / GIB:.2f}) | {est.peak_memory_bytes / GIB:.2f} | "
              f"{est.peak_memory_bytes / max(tensor):.3f} | "
              f"{max(rss) / GIB:.2f} | {est.peak_memory_bytes / max(rss):.3f} | {statistics.median(all_steps):.2f} "
              f"({min(all_steps):.2f}-{max(all_steps):.2f}) | {statistics.median(cpu_steps):.2f} "
              f"({min(cpu_steps):.2f}-{max(cpu_steps):.2f}) | {est.step_time_s:.2f} | "
              f"{sum(r['ckpt_bytes'] for r in ranks[:1]) / 1e9:.2f} | {max(r['save_s'] for r in ranks):.1f} | "
              f"{max(r['load_s'] for r in ranks):.1f} |", flush=True)
        breakdown = {k[4:]: round(v / GIB, 3) for k, v in est.breakdown.items() if k.startswith("mem_")}
        print(f"  predicted breakdown GiB/rank: {breakdown}; rss at start {ranks[0]['rss_start'] / GIB:.2f} GiB",
              flush=True)


def run_fake(sizes: List[str], batch: int, seq: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import memory_model   # the FakeTensorMode + FSDPMemTracker harness

    strategy = "fsdp+amp+checkpoint"
    for size in sizes:
        memory_model.MODELS[size] = dict(SIZES[size], num_key_value_heads=SIZES[size]["num_attention_heads"])
        row = memory_model.measure(size, 2, strategy, batch, seq)
        print(f"fake {size} ({row.params_b:.2f}B), rank 0 of 2, {memory_model.STRATEGIES[strategy]}, micro-batch "
              f"{batch} x {seq}: model states measured {row.measured_states / GIB:.2f} GiB, predicted "
              f"{row.predicted_states / GIB:.2f} GiB; peak measured {row.measured_peak / GIB:.2f} GiB, predicted "
              f"{row.predicted_peak / GIB:.2f} GiB (ratio {row.predicted_peak / row.measured_peak:.3f}); "
              f"{row.seconds:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="125m,350m", help="real rungs, comma-separated (of %s)" % list(SIZES))
    parser.add_argument("--fake", default="1.3b", help="fake-tensor rungs (memory only)")
    parser.add_argument("--batch", type=int, default=2, help="global batch (1 row per rank)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-rss-gib", type=float, default=11.0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, load {os.getloadavg()}, global batch {args.batch} x seq {args.seq}, "
          f"strategy {STRATEGY}")
    sizes = [s for s in args.sizes.split(",") if s]
    if sizes:
        run_real(sizes, args.batch, args.seq, args.steps, args.max_rss_gib)
    fake = [s for s in args.fake.split(",") if s]
    if fake:
        run_fake(fake, args.batch // 2, args.seq)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
