"""Strategy search vs random and exhaustive search on synthetic landscapes built from the cost model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py [--landscapes 24] [--hebo-default]

Each landscape is a 128-combination space (amp x {none, zero1, zero2, fsdp} x checkpoint x
module_replace x {data 8, tensor 2/4/8}) on 8 simulated 80 GB GPUs, for a Llama 1.3B/7B/13B
config and a global batch. The "true" throughput and memory of a candidate come from the cost
model with perturbed physics (see `Landscape`: device rates off by ~30%, each optimization's
effect off by ~15%, 5% noise); a candidate whose true memory exceeds 80 GB is an OOM trial.
Our search gets the unperturbed cost model as its predictor, and is also run without one. Random search tries candidates in a random order, exhaustive
search in enumeration order. Reported: evaluations until a trial reaches >= 0.98 of the best
feasible throughput (median and worst over landscapes), the share of landscapes solved within
a budget, OOM trials spent, and planner seconds per suggestion. `--hebo-default` also times
one HEBO `suggest()` with its default settings on the same all-categorical space.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from transformers import LlamaConfig

from atorch.auto.cost_model import Estimate, estimate
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.strategy import Strategy

WORLD, MEMORY_LIMIT, SEQ = 8, 80 * 10**9, 2048
TARGET = 0.98
BUDGETS = (5, 10, 15, 20)
MODELS = {
    "llama-1.3b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
}
BATCHES = (32, 128)


def make_space(config: LlamaConfig) -> SearchSpace:
    splits = [("parallel_mode", ([("data", WORLD)], None))]
    splits += [[("parallel_mode", ([("tensor", t), ("data", WORLD // t)], None)), "tensor_parallel"] for t in (2, 4, 8)]
    return SearchSpace({"amp": [None, "amp_native"], "zero": [None, "zero1", "zero2", "fsdp"],
                        "checkpoint": [None, "checkpoint"], "module_replace": [None, "module_replace"],
                        "parallel": splits}, world_size=WORLD, model_config=config, device_type="cuda")


class Landscape:
    """Truth = the cost model with perturbed physics, plus a little noise; the predictor = the cost model.

    What a real cost model gets wrong is mostly systematic: the device's rates (compute per
    dtype, bandwidth, latency, framework overhead) and what each optimization really costs or
    saves. So the truth re-runs the cost model with every device rate scaled by a log-normal
    factor (sigma 0.3), multiplies each optimization's effect by its own factor (sigma 0.15 on
    time, 0.1 on memory) and adds 5% independent noise per candidate (3% on memory).
    """

    def __init__(self, config: LlamaConfig, batch: int, seed: int, space: SearchSpace) -> None:
        from atorch.auto.cost_model import DEVICE_PROFILES

        rng = np.random.default_rng(seed)
        self.batch = batch
        profile = {k: v * math.exp(rng.normal(0, 0.3)) for k, v in DEVICE_PROFILES["cuda"].items()}
        names = sorted({n for c in space.candidates() for n in c.strategy.names()})
        time_effect = {n: math.exp(rng.normal(0, 0.15)) for n in names}
        mem_effect = {n: math.exp(rng.normal(0, 0.10)) for n in names}
        self.predicted: Dict[Strategy, Estimate] = {}
        self.truth: Dict[Strategy, Tuple[float, int]] = {}
        for cand in space.candidates():
            s = cand.strategy
            self.predicted[s] = estimate(config, s, batch, SEQ, WORLD, "cuda")
            true = estimate(config, s, batch, SEQ, WORLD, "cuda", profile=profile)
            step = true.step_time_s * math.prod(time_effect[n] for n in s.names()) * math.exp(rng.normal(0, 0.05))
            mem = true.peak_memory_bytes * math.prod(mem_effect[n] for n in s.names()) * math.exp(rng.normal(0, 0.03))
            self.truth[s] = (batch / step, int(mem))
        feasible = [tp for tp, mem in self.truth.values() if mem <= MEMORY_LIMIT]
        self.best = max(feasible) if feasible else 0.0

    def evaluate(self, strategy: Strategy) -> DryRunResult:
        tp, mem = self.truth[strategy]
        if mem > MEMORY_LIMIT:
            return DryRunResult(0.0, mem, "oom")
        return DryRunResult(tp, mem)

    def reached(self, result: DryRunResult) -> bool:
        return result.ok and result.throughput >= TARGET * self.best


def evaluations_to_target(order: List[Strategy], land: Landscape) -> Tuple[int, int]:
    """(evaluations until the target is reached, OOM trials among them) for a fixed order."""
    ooms = 0
    for n, s in enumerate(order, 1):
        r = land.evaluate(s)
        ooms += r.status == "oom"
        if land.reached(r):
            return n, ooms
    return len(order) + 1, ooms


def random_search(order: List[Strategy], land: Landscape, rng: np.random.Generator,
                  repeats: int = 200) -> Tuple[float, float]:
    """Median evaluations (and mean OOM trials) of random search over `repeats` random orders."""
    runs = [evaluations_to_target([order[i] for i in rng.permutation(len(order))], land) for _ in range(repeats)]
    return float(np.median([n for n, _ in runs])), float(np.mean([o for _, o in runs]))


def run_ours(space: SearchSpace, land: Landscape, seed: int, with_predictor: bool) -> Tuple[int, int, List[float]]:
    """Our search, stopped as soon as a trial reaches the target (via its clock, which then jumps)."""
    calls: List[DryRunResult] = []
    done = [False]

    def evaluator(strategy: Strategy) -> DryRunResult:
        r = land.evaluate(strategy)
        calls.append(r)
        done[0] = done[0] or land.reached(r)
        return r

    clock: Callable[[], float] = lambda: 1e18 if done[0] else time.monotonic()  # noqa: E731
    result = search_strategy(space, evaluator, max_trials=len(land.truth), patience=len(land.truth), seed=seed,
                             predictor=(lambda s: land.predicted[s]) if with_predictor else None,
                             memory_limit_bytes=MEMORY_LIMIT if with_predictor else None,
                             time_limit_s=1e17, clock=clock)
    n = next((i for i, r in enumerate(calls, 1) if land.reached(r)), len(land.truth) + 1)
    ooms = sum(r.status == "oom" for r in calls[:n])
    return n, ooms, result.planner_seconds


def hebo_default_seconds(space: SearchSpace, seed: int = 0) -> float:
    from atorch.auto.search.bo import hebo_default_suggest_seconds

    labels = list(space.labels().values())
    cands = space.candidates()
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(cands), size=10, replace=False)
    return hebo_default_suggest_seconds(labels, [cands[i].choices for i in picks],
                                        [float(rng.uniform(1, 2)) for _ in picks], seed=seed)


def summarize(name: str, evals: List[float], ooms: List[float], total: int) -> str:
    solved = " | ".join(f"{np.mean([e <= b for e in evals]) * 100:5.0f}%" for b in BUDGETS)
    worst = max(evals)
    worst_text = f"{worst}" if worst <= total else f">{total}"
    return (f"| {name:28s} | {np.median(evals):6.1f} | {worst_text:>5s} | {solved} | "
            f"{np.mean(ooms):5.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--landscapes", type=int, default=24, help="models x batches x noise seeds (multiple of 6)")
    parser.add_argument("--hebo-default", action="store_true", help="also time one default HEBO suggest() (~minutes)")
    args = parser.parse_args()
    seeds = max(1, args.landscapes // (len(MODELS) * len(BATCHES)))
    results: Dict[str, Tuple[List[int], List[int]]] = {k: ([], []) for k in
                                                       ("ours (HEBO + cost model)", "ours (HEBO, no predictor)",
                                                        "random search", "exhaustive (enumeration order)")}
    planner: List[float] = []
    n_candidates = 0
    best_pruned = 0   # landscapes whose true best the (uncorrected) cost model puts over the memory limit
    for (model_name, kw), batch, seed in itertools.product(MODELS.items(), BATCHES, range(seeds)):
        config = LlamaConfig(vocab_size=32000, num_key_value_heads=kw["num_attention_heads"], **kw)
        space = make_space(config)
        land = Landscape(config, batch, 1000 * seed + batch, space)
        order = [c.strategy for c in space.candidates()]
        best = max((st for st in order if land.truth[st][1] <= MEMORY_LIMIT), key=lambda st: land.truth[st][0])
        best_pruned += land.predicted[best].peak_memory_bytes > MEMORY_LIMIT
        n_candidates = len(order)
        rng = np.random.default_rng(1000 * seed + batch)
        for key, (n, ooms, secs) in (
                ("ours (HEBO + cost model)", run_ours(space, land, seed, True)),
                ("ours (HEBO, no predictor)", run_ours(space, land, seed, False)),
                ("random search", (*random_search(order, land, rng), [])),
                ("exhaustive (enumeration order)", (*evaluations_to_target(order, land), []))):
            results[key][0].append(n)
            results[key][1].append(ooms)
            planner.extend(secs)
        print(f"{model_name} batch {batch} seed {seed}: evaluations to target: " +
              ", ".join(f"{k}={v[0][-1]}" for k, v in results.items()), flush=True)

    print(f"\n{len(results['random search'][0])} landscapes, {n_candidates} valid candidates each, "
          f"target >= {TARGET} of the best feasible throughput\n")
    print("| method | median evals | worst | " + " | ".join(f"<= {b}" for b in BUDGETS) + " | OOM trials (mean) |")
    print("|---|---|---|" + "---|" * len(BUDGETS) + "---|")
    for key, (evals, ooms) in results.items():
        print(summarize(key, evals, ooms, n_candidates))
    print(f"\nlandscapes whose true best the cost model predicts over {MEMORY_LIMIT / 1e9:.0f} GB (pruning can "
          f"then only find it if the measured/predicted correction brings it back): {best_pruned}")
    p = np.array(planner)
    print(f"\nour planner, seconds per suggestion over {len(p)} suggestions: median {np.median(p):.3f}, "
          f"p90 {np.percentile(p, 90):.3f}, max {p.max():.3f}")
    if args.hebo_default:
        config = LlamaConfig(vocab_size=32000, num_key_value_heads=32, **MODELS["llama-7b"])
        seconds = hebo_default_seconds(make_space(config))
        print(f"HEBO default suggest() (NSGA-II, pop 100 x 100 gens) on the same 128-combination "
              f"all-categorical space after 10 observations: {seconds:.1f} s for one suggestion")


if __name__ == "__main__":
    main()
