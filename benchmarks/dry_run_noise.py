"""How much a dry run's throughput varies between repeats: fixed 3 timed steps vs timing to a 3% interval.

    nice -n 5 python benchmarks/dry_run_noise.py [--rounds 4]

The tiny Llama (2 layers, hidden 64), global batch 8 x 64 tokens, AdamW, on 2 gloo CPU ranks.
Three candidates (data-parallel + amp, data-parallel, amp + fsdp: issue 12's examples) are each
dry-run `rounds` times, interleaved with each other and with the two measurements:
- fixed: 2 warm-up and exactly 3 timed steps (the old dry runner; with 3 samples no outlier is
  dropped, so this is its mean step time);
- adaptive: the dry runner's default: timed until the 95% CI half-width is <= 3% of the mean
  step time, or 40 steps / 60 s.
Reported per candidate and measurement: the median throughput, the spread max/min over the
rounds, and (adaptive) the number of timed samples and whether the interval reached 3%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

CANDIDATES = {"ddp+amp": ["parallel_mode", "amp_native"], "ddp": ["parallel_mode"],
              "amp+fsdp": ["parallel_mode", "amp_native", "fsdp"]}


def _rank(rounds: int) -> list:
    from atorch import distributed as adist
    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.step_timing import summarize
    from atorch.auto.strategy import Strategy
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=256, seq_len=64), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 8})
    modes = {"fixed": DryRunConfig(warmup_steps=2, profile_steps=3, max_profile_steps=3, target_relative_ci=0.0),
             "adaptive": DryRunConfig()}
    rows = []
    for round_ in range(rounds):
        for name, strategy in CANDIDATES.items():
            for mode, config in modes.items():
                r = dry_run(ctx, Strategy(strategy), config)
                rel = summarize(r.step_times_s).relative_half_width if r.ok else float("nan")
                rows.append({"round": round_, "candidate": name, "mode": mode, "throughput": r.throughput,
                             "samples": len(r.step_times_s), "relative_half_width": rel,
                             "load_average": os.getloadavg()[0], "error": r.error})
                if adist.rank() == 0:
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from atorch.testing import run_distributed

    rows = run_distributed(_rank, 2, args.rounds, timeout=3600)[0]
    print("| candidate | measurement | median samples/s | max/min over rounds | timed samples | reached 3% |")
    print("|---|---|---|---|---|---|")
    for name in CANDIDATES:
        for mode in ("fixed", "adaptive"):
            sel = [r for r in rows if r["candidate"] == name and r["mode"] == mode and r["error"] is None]
            tp = [r["throughput"] for r in sel]
            reached = sum(r["relative_half_width"] <= 0.03 for r in sel)
            print(f"| {name} | {mode} | {statistics.median(tp):.0f} | {max(tp) / min(tp):.2f} | "
                  f"{', '.join(str(r['samples']) for r in sel)} | {reached}/{len(sel)} |")


if __name__ == "__main__":
    main()
