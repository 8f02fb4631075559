"""The search when almost nothing fits in memory and there is no cost model (issue 12, item 1).

A landscape written by a helper session acting as an outside grader (session 17), not from the
cost model or `benchmarks/search.py`: 64 candidates (amp x zero1/zero2/fsdp x checkpoint x
module_replace x {data 4, tensor 2 x data 2}, world 4); throughput a product of per-option
factors exp(N(0, 0.25)) with an amp x fsdp interaction; memory 40 GB times fixed savings per
option (zero1 0.8, zero2 0.6, fsdp 0.4, checkpoint 0.7, tensor parallel 0.6, amp 1.05); the limit
set so that only the leanest 1/16 of the candidates fit; 3% noise on 8 step times a run. Out of
memory reports its peak, or (`none`) no peak at all.

    python benchmarks/search_tight_memory.py [--landscapes 8] [--fit 0.0625]

Prints, per way of reporting out of memory: searches that found a strategy, the mean ratio of
its true throughput to the best that fits (0 when none was found), and searches that stopped
before spending their 14 dry runs.
"""

import argparse
import logging
import math

import numpy as np
from transformers import LlamaConfig

from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.strategy import Strategy

CONFIG = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=16)
SPEED_OPTIONS = ["amp_native", "zero1", "zero2", "fsdp", "checkpoint", "module_replace", "tensor_parallel"]
MEMORY_FACTORS = {"zero1": 0.8, "zero2": 0.6, "fsdp": 0.4, "checkpoint": 0.7, "tensor_parallel": 0.6}


def make_space() -> SearchSpace:
    parallel = [("parallel_mode", ([("data", 4)], None)),
                [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel"]]
    dims = {"amp": [None, "amp_native"], "zero": [None, "zero1", "zero2", "fsdp"],
            "checkpoint": [None, "checkpoint"], "module_replace": [None, "module_replace"], "parallel": parallel}
    return SearchSpace(dims, world_size=4, model_config=CONFIG, device_type="cuda", merge_idle=False)


class Landscape:
    def __init__(self, seed: int, noise: float = 0.03, report_peak: bool = True):
        self.rng = np.random.default_rng(seed)
        shape = np.random.default_rng(seed + 1)
        self.factor = {k: math.exp(shape.normal(0, 0.25)) for k in SPEED_OPTIONS}
        self.interaction = math.exp(shape.normal(0, 0.2))
        self.noise, self.report_peak = noise, report_peak
        self.limit = float("inf")

    def throughput(self, s: Strategy) -> float:
        names = {i.name for i in s}
        value = 100.0 * math.prod(f for k, f in self.factor.items() if k in names)
        return value * (self.interaction if {"amp_native", "fsdp"} <= names else 1.0)

    def memory(self, s: Strategy) -> float:
        names = {i.name for i in s}
        value = 40e9 * math.prod(f for k, f in MEMORY_FACTORS.items() if k in names)
        return value * (1.05 if "amp_native" in names else 1.0)

    def __call__(self, s: Strategy) -> DryRunResult:
        if self.memory(s) > self.limit:
            return DryRunResult(0.0, int(self.memory(s)) if self.report_peak else None, "oom: synthetic")
        step = 32 / self.throughput(s)
        steps = tuple(step * math.exp(self.rng.normal(0, self.noise)) for _ in range(8))
        mean = float(np.mean(steps))
        return DryRunResult(32 / mean, int(self.memory(s)), None, mean, steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--landscapes", type=int, default=8)
    parser.add_argument("--fit", type=float, default=1 / 16, help="share of the candidates that fit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    space = make_space()
    candidates = space.candidates()
    for report_peak in (True, False):
        found, ratios, early = 0, [], 0
        for seed in range(args.landscapes):
            land = Landscape(200 + seed, report_peak=report_peak)
            peaks = sorted(land.memory(c.strategy) for c in candidates)
            land.limit = peaks[max(0, int(round(args.fit * len(peaks))) - 1)] * 1.001
            fitting = [c.strategy for c in candidates if land.memory(c.strategy) <= land.limit]
            result = search_strategy(space, land, max_trials=14, patience=14, seed=seed,
                                     memory_limit_bytes=int(land.limit))
            found += result.best is not None
            best = max(land.throughput(s) for s in fitting)
            ratios.append(land.throughput(result.best) / best if result.best is not None else 0.0)
            early += len(result.trials) < 14
        how = "with its peak" if report_peak else "without a peak"
        print(f"out of memory reported {how}: found a strategy {found}/{args.landscapes}, mean ratio "
              f"{np.mean(ratios):.3f}, stopped before 14 dry runs {early}/{args.landscapes}", flush=True)


if __name__ == "__main__":
    main()
