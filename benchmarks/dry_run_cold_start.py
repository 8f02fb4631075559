"""Is a process's first dry run slower than the next ones? (The search leaves it out once re-measured.)

    python benchmarks/dry_run_cold_start.py [--processes 10]

Each round starts 2 fresh gloo CPU ranks and dry-runs the same candidate (data parallel + amp on the tiny
Llama, 2 layers, hidden 64, global batch 8 x 64 tokens, the dry runner's defaults but a 20-step budget)
three times in a row; printed per round: the three throughputs and the first over the mean of the other two.
Rounds run one after another, so a load change on the machine moves one round, not the ratio's sign in all.
"""

from __future__ import annotations

import argparse
import statistics

import torch

CANDIDATE = ["parallel_mode", "amp_native"]


def _rank() -> list:
    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=256, seq_len=64), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 8})
    config = DryRunConfig(max_profile_steps=20)
    return [dry_run(ctx, Strategy(CANDIDATE), config).throughput for _ in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10, help="rounds, each with fresh processes")
    args = parser.parse_args()
    from atorch.testing import run_distributed

    ratios = []
    for round_ in range(args.processes):
        first, second, third = run_distributed(_rank, 2, timeout=600)[0]
        ratios.append(first / statistics.mean([second, third]))
        print(f"round {round_}: {first:.1f} {second:.1f} {third:.1f} samples/s, first / later {ratios[-1]:.3f}",
              flush=True)
    below = sum(r < 1 for r in ratios)
    print(f"first / later: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
          f"below 1 in {below} of {len(ratios)} rounds")


if __name__ == "__main__":
    main()
