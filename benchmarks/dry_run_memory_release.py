r"""Memory a sequence of dry runs leaves behind: live tensor bytes and RSS after each candidate.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python benchmarks/dry_run_memory_release.py \
        [--model qwen2_moe] [--first 0] [--last 12]

The combination classes `scripts/sweep_space.py` dry-runs (one candidate each, in its order), for a
family of `atorch.testing.tp_families` on 2 gloo ranks, one after another in one process per rank as
a search runs them. After each: a gc, the process RSS, RSS after `malloc_trim(0)` (what glibc still
holds but could return), and the bytes of every tensor storage Python can reach. A candidate that
leaves its model or optimizer state alive shows as a step up in the last column.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
from typing import Any, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _live_tensor_gb() -> float:
    from atorch.testing.live_memory import live_tensor_bytes

    return live_tensor_bytes() / 1e9


def _rank(classes: List[Tuple[str, str]], kind: str) -> List[Tuple[Any, ...]]:
    import sweep_space

    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=sweep_space._model(kind), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=64, seq_len=64, vocab_size=sweep_space._vocab(kind)),
                       model_input_format="unpack_dict", dataloader_args={"batch_size": 16})
    config = DryRunConfig(warmup_steps=1, profile_steps=1, max_profile_steps=1, timeout_s=150)
    rows: List[Tuple[Any, ...]] = [("(before)", None, round(_rss_gb(), 3), None, round(_live_tensor_gb(), 3))]
    for name, text in classes:
        result = dry_run(ctx, Strategy.from_json(text), config)
        gc.collect()
        rss = _rss_gb()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rows.append((name, result.ok, round(rss, 3), round(_rss_gb(), 3), round(_live_tensor_gb(), 3)))
    return rows


def main() -> None:
    import sweep_space

    from atorch.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_moe", choices=sweep_space.MODELS)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--last", type=int, default=12)
    args = parser.parse_args()
    classes = list(sweep_space.representatives(args.model, 2, 16).items())[args.first:args.last]
    print("| candidate | ok | RSS GB | RSS after malloc_trim | live tensors GB |")
    print("|---|---|---|---|---|")
    for row in run_distributed(_rank, 2, classes, args.model, timeout=1800)[0]:
        print("| " + " | ".join("" if v is None else str(v) for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
