"""Throughput and MFU of the three Llama 2 example entry scripts, and the cost of exact CPU memory tracking.

    .venv/bin/python benchmarks/llama2_examples.py                  # both parts
    .venv/bin/python benchmarks/llama2_examples.py --part tracker   # only the tracker overhead

Part "examples": each entry script with its tiny offline defaults except the flags below, on CPU
processes (gloo); the last metrics line (the mean of the final LOG_STEPS window) is reported.
Part "tracker": a tiny Llama training step (bf16 autocast, AdamW) in one process, plain and under
`atorch.utils.peak_memory.PeakMemoryTracker`, which is why the examples report the RSS high-water
mark on CPU instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "llama2"
RUNS = {
    "fsdp (fsdp+amp bf16+checkpoint), 2 procs": ("fsdp_llama2_entry.sh", {"NPROC_PER_NODE": 2}),
    "ds_3d (tensor 1 x pipeline 2 x data 2), 4 procs": ("ds_3d_llama2_entry.sh",
                                                        {"NPROC_PER_NODE": 4, "MICRO_BATCH_SIZE": 2,
                                                         "ACCU_STEPS": 2}),
    "bayes search (3 trials) then winner, 2 procs": ("bayes_opt_sg_llama2_entry.sh",
                                                     {"NPROC_PER_NODE": 2, "BO_SG_MAX_IETR": 3,
                                                      "RANDOM_SAMPLE": 2}),
}


def run_examples(steps: int, block_size: int) -> List[Dict[str, str]]:
    from atorch.testing.spawn import QUIET_ENV
    from atorch.utils.metrics import parse_metrics_line

    rows = []
    for name, (entry, extra) in RUNS.items():
        with tempfile.TemporaryDirectory() as out_dir:
            env = dict(os.environ, **QUIET_ENV, PYTHON=sys.executable, OUTPUT_DIR=out_dir, MAX_STEPS=str(steps),
                       LOG_STEPS=str(steps // 2), SAVE_STEPS="0", BLOCK_SIZE=str(block_size),
                       **{k: str(v) for k, v in extra.items()})
            start = time.perf_counter()
            out = subprocess.run(["bash", str(EXAMPLES / entry)], env=env, capture_output=True, text=True,
                                 cwd=REPO)
            wall = time.perf_counter() - start
        if out.returncode != 0:
            raise SystemExit(f"{entry} failed:\n{out.stderr[-3000:]}")
        metrics = [m for m in map(parse_metrics_line, out.stdout.splitlines()) if m]
        peak = next(line for line in out.stdout.splitlines() if line.startswith("metrics:"))
        rows.append({"run": name, "wall_s": f"{wall:.0f}", **{k: f"{v:.4g}" for k, v in metrics[-1].items()},
                     "peak": peak.split("; peak ")[1].split(";")[0]})
    return rows


def tracker_overhead(repeats: int = 20) -> Dict[str, float]:
    import torch

    from atorch.testing import tiny_llama
    from atorch.utils.peak_memory import PeakMemoryTracker

    torch.set_num_threads(1)
    model = tiny_llama()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 1024, (4, 64))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optim.step()
        optim.zero_grad()

    def timed() -> float:
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
        return statistics.median(times) * 1000

    for _ in range(3):
        step()
    plain = timed()
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        tracked = timed()
    return {"plain_ms": plain, "tracked_ms": tracked, "ratio": tracked / plain,
            "tracked_peak_mib": tracker.peak_bytes / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("examples", "tracker", "all"), default="all")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    if args.part in ("tracker", "all"):
        r = tracker_overhead()
        print(f"tiny Llama step, 1 thread, batch 4 x 64, bf16 autocast: plain {r['plain_ms']:.1f} ms, under "
              f"PeakMemoryTracker {r['tracked_ms']:.1f} ms ({r['ratio']:.2f}x); tracked peak "
              f"{r['tracked_peak_mib']:.1f} MiB")
    if args.part in ("examples", "all"):
        rows = run_examples(args.steps, args.block_size)
        keys = ["run", "wall_s", "step_s", "samples_s", "tokens_s_per_device", "tflops_model", "tflops_hw", "mfu",
                "hfu", "peak_mem_mb", "peak"]
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for row in rows:
            print("| " + " | ".join(row[k] for k in keys) + " |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
