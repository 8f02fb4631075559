r"""How often the search's final comparison calls two identical candidates apart, and how often it
separates truly different ones, when runs of one candidate disagree (per-run jitter, slow drift, a
cold first dry run of the process).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search_compare_noise.py [--searches 2000] [--seed 0]

Each simulated search ends the way `search_strategy` does (the `TrialLog` the search keeps, its
`challenge` and `compare`): the process's first dry run is A's (or B's, or that of C, a slower
candidate), then the slower candidates C and D, then the other of A and B; then up to `rounds`
rounds of A, B re-measured interleaved, ending early when `TrialLog.challenge` finds the leader
separated, and the reported comparison is `compare` of the top two. A dry run: 8 step times (the
dry runner's pilot) with a relative spread `cv` around the run's rate, which is the candidate's
true rate times exp(walk + jitter + cold): `walk` a random walk over trials (slow load drift, sd
`drift` per trial), `jitter` independent per run (sd `jitter`), `cold` on the process's first dry
run only (`cold_on` says whose).
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, Optional, Tuple

import numpy as np

from atorch.auto.search import DryRunResult, SearchSpace
from atorch.auto.search.space import Candidate
from atorch.auto.search.trials import TrialLog

BATCH = 32.0
STEPS = 8


class _Labelled:
    """A candidate whose label is computed once (`Candidate.label` costs more than the statistics here)."""

    def __init__(self, candidate: Candidate) -> None:
        self.strategy, self.choices, self._label = candidate.strategy, candidate.choices, candidate.label()

    def label(self) -> str:
        return self._label


def _space_candidates() -> list:
    space = SearchSpace({"zero": [None, "zero1", "zero2", "fsdp"]}, world_size=2)
    return [_Labelled(c) for c in space.candidates()]


def one_search(rng: np.random.Generator, ratio: float = 1.0, jitter: float = 0.0, drift: float = 0.0,
               cold: float = 0.0, cold_on: str = "A", cv: float = 0.025, rounds: int = 3,
               candidates: Optional[list] = None) -> Tuple[bool, Optional[bool]]:
    """(declared separated, A declared the winner) of one simulated search's comparison."""
    candidates = candidates or _space_candidates()
    true = {0: math.log(ratio), 1: 0.0, 2: math.log(0.8), 3: math.log(0.7)}     # A, B, C, D
    log = TrialLog(candidates, [None] * len(candidates), None)
    walk = np.cumsum(rng.normal(0.0, drift, size=4 + 2 * rounds)) if drift else np.zeros(4 + 2 * rounds)

    def run(index: int, source: str) -> None:
        t = log.count
        rate = math.exp(true[index] + walk[t] + (rng.normal(0.0, jitter) if jitter else 0.0)
                        + (math.log1p(cold) if t == 0 else 0.0)) * 100.0
        steps = tuple(float(BATCH / rate * (1.0 + cv * z)) for z in rng.normal(0.0, 1.0, size=STEPS))
        log.add(index, DryRunResult(BATCH * STEPS / sum(steps), 1000, step_times_s=steps), 1.0, math.nan, source)

    order = {"A": (0, 2, 3, 1), "B": (1, 2, 3, 0), "C": (2, 0, 3, 1)}[cold_on]
    for index in order:
        run(index, "random")
    for k in range(rounds):
        run(0, "remeasure")
        run(1, "remeasure")
        if k < rounds - 1 and log.challenge() is None:
            break
    top = log.ranked()[:2]
    cmp_ = log.compare(top[0], top[1])
    assert cmp_ is not None
    return cmp_.separated, cmp_.winner == candidates[0].strategy if cmp_.separated else None


def rates(searches: int, seed: int, **scenario) -> Dict[str, float]:
    """Fraction of `searches` that declared A and B apart, and that declared A the faster."""
    rng = np.random.default_rng(seed)
    candidates = _space_candidates()
    separated = a_wins = 0
    for _ in range(searches):
        sep, a_won = one_search(rng, candidates=candidates, **scenario)
        separated += sep
        a_wins += bool(a_won)
    return {"separated": separated / searches, "a_faster": a_wins / searches}


SCENARIOS = {
    "identical, steps only": {},
    "identical, jitter 1%/run": {"jitter": 0.01},
    "identical, jitter 2%/run": {"jitter": 0.02},
    "identical, jitter 5%/run": {"jitter": 0.05},
    "identical, drift 2%/trial": {"drift": 0.02},
    "identical, A's first run cold (-25%)": {"cold": -0.25},
    "identical, B's first run cold (-25%), jitter 2%": {"cold": -0.25, "cold_on": "B", "jitter": 0.02},
    "A 1.05x, steps only": {"ratio": 1.05},
    "A 1.10x, jitter 2%/run": {"ratio": 1.10, "jitter": 0.02},
    "A 1.10x, jitter 5%/run": {"ratio": 1.10, "jitter": 0.05},
    "A 1.05x, steps only, C ran first": {"ratio": 1.05, "cold_on": "C"},
    "A 1.10x, jitter 2%/run, C ran first": {"ratio": 1.10, "jitter": 0.02, "cold_on": "C"},
    "demo: A 1.26x, A's first run cold (-22%)": {"ratio": 1.26, "cold": -0.22},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--searches", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.searches} simulated searches per cell; cv 2.5% per step, {STEPS} steps per dry run")
    print(f"{'scenario':50s} | {'rounds':>6s} | separated | A declared faster")
    for name, scenario in SCENARIOS.items():
        for rounds in (1, 3):
            r = rates(args.searches, args.seed, rounds=rounds, **scenario)
            print(f"{name:50s} | {rounds:6d} | {r['separated']:9.3f} | {r['a_faster']:.3f}", flush=True)


if __name__ == "__main__":
    main()
