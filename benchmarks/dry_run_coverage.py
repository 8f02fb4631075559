r"""How often a dry run's 95% interval holds the true mean step time, and how many steps it costs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dry_run_coverage.py [--runs 3000] [--seed 0]

Simulated step times, timed as `dry_runner.time_steps` times them (at least `profile_steps`
samples, at most 40, stop when `step_timing.is_precise_enough` says so at a 3% target) and
summarized by `step_timing.summarize`, against the rule used before Stein's (stop the first time
the t interval over all the samples so far is <= 3%, with at least 5 samples; outliers above
median + 4 robust sd out), which this script re-implements as it was.

Step-time models (the truth is the mean of the spike-free steps):
- lognormal jitter of sd `sigma` per step (1-12%);
- the same with load spikes: a step is x U(2, 3) with probability 0.1 (the dry runner's mean is
  meant to leave them out);
- heavy tails: jitter from a Student t with 4 degrees of freedom scaled to sd `sigma`;
- drift: AR(1) jitter with correlation 0.5 between consecutive steps (a load that changes
  slowly). No interval computed from one run's own steps as if they were independent can hold
  this; it is here to show by how much it fails, not as a target.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, List, Tuple

import numpy as np

from atorch.auto import step_timing
from atorch.auto.step_timing import is_precise_enough, summarize

TARGET, BUDGET = 0.03, 40
SIGMAS = (0.01, 0.02, 0.03, 0.05, 0.08, 0.12)


def old_rule_interval(times: List[float]) -> Tuple[float, float]:
    """(mean, half-width) of the rule before: a t interval over all kept samples, 4-sd outliers."""
    median = float(np.median(times))
    scale = max(1.4826 * float(np.median(np.abs(np.asarray(times) - median))), 0.01 * median)
    order = sorted((i for i, t in enumerate(times) if t > median + 4.0 * scale), key=lambda i: -times[i])
    dropped = set(order[:int(0.2 * len(times))])
    kept = np.asarray([t for i, t in enumerate(times) if i not in dropped])
    n = kept.size
    if n < 3:
        return float(kept.mean()), math.inf
    return float(kept.mean()), step_timing.t_quantile(n - 1) * float(kept.std(ddof=1)) / math.sqrt(n)


def run_once(draw: Callable[[], float], rule: str) -> Tuple[List[float], float, float]:
    times: List[float] = []
    while len(times) < BUDGET:
        times.append(draw())
        if rule == "stein" and is_precise_enough(times, TARGET, step_timing.PILOT_SAMPLES):
            break
        if rule == "old" and len(times) >= 5:
            mean, half = old_rule_interval(times)
            if half / mean <= TARGET:
                break
    if rule == "stein":
        s = summarize(times)
        return times, s.mean_s, s.half_width_s
    mean, half = old_rule_interval(times)
    return times, mean, half


def model(kind: str, sigma: float, rng: np.random.Generator) -> Tuple[Callable[[], float], float]:
    """A step-time generator (fresh state per run) and its true mean."""
    if kind == "lognormal":
        return (lambda: float(math.exp(rng.normal(0, sigma)))), math.exp(sigma ** 2 / 2)
    if kind == "spikes":
        def spiky() -> float:
            t = math.exp(rng.normal(0, sigma))
            return float(t * rng.uniform(2, 3)) if rng.random() < 0.1 else float(t)
        return spiky, math.exp(sigma ** 2 / 2)
    if kind == "heavy":
        scale = sigma / math.sqrt(4 / 2)            # a t(4) has variance 2
        # Clipped at 0.2 (a step time is positive): beyond 9 sd, which moves the mean by < 1e-4.
        return (lambda: float(max(0.2, 1.0 + scale * rng.standard_t(4)))), 1.0
    if kind == "drift":
        state = {"x": rng.normal(0, sigma)}

        def drifting() -> float:
            state["x"] = 0.5 * state["x"] + math.sqrt(1 - 0.25) * rng.normal(0, sigma)
            return float(max(0.2, 1.0 + state["x"]))
        return drifting, 1.0
    raise ValueError(kind)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3000, help="simulated dry runs per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="*", default=["lognormal", "spikes", "heavy", "drift"])
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    se = math.sqrt(0.95 * 0.05 / args.runs)
    print(f"{args.runs} simulated dry runs per cell; coverage's standard error at 0.95: {se:.4f}\n")
    print("| step times | sd per step | coverage before | steps before | coverage now | steps now |")
    print("|---|---|---|---|---|---|")
    for kind in args.models:
        for sigma in SIGMAS:
            cells = []
            for rule in ("old", "stein"):
                hits, steps = 0, 0
                for _ in range(args.runs):
                    draw, truth = model(kind, sigma, rng)
                    times, mean, half = run_once(draw, rule)
                    hits += mean - half <= truth <= mean + half
                    steps += len(times)
                cells.append(f"{hits / args.runs:.3f} | {steps / args.runs:.1f}")
            print(f"| {kind} | {sigma:.2f} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
