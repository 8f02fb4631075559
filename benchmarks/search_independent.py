"""Independent landscape families: search_strategy vs random search at the same budget.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search_independent.py --space 64 --budget 14 \
        --seeds 20 --families additive needle onedim memslow threeway [--out FILE]

Written in session 13 by a helper session that had not seen the search's tuning, as a check on
landscapes the search was not developed on; figures in benchmarks/RESULTS.md.

Each landscape is built from its own random numbers (nothing from benchmarks/search.py but the
space builder). Every dry run: 5 step times, each x exp(N(0, noise*sqrt(5))) (the run's mean
off by about `noise`), peak memory x exp(N(0, 0.01)); a candidate over the limit returns "oom"
with its peak. Ratio = true throughput of the declared winner / true best runnable.
"""
import argparse
import importlib.util
import itertools
import json
import logging
import math
import os
import sys
import time

import numpy as np

from atorch.auto.search import DryRunResult, search_strategy

logging.getLogger("atorch").setLevel(logging.ERROR)

spec = importlib.util.spec_from_file_location("bench_search", os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "search.py"))
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_search"] = bench
spec.loader.exec_module(bench)

RANDOM_ORDERS = 30
TARGET = 0.98
STEPS = 5
BATCH = 32.0


SAVING_DIMS = ("zero", "checkpoint", "parallel")


def monotone_log_memory(rng, names, sizes, ch, saving=SAVING_DIMS):
    """Per-candidate log memory, monotone in the memory-saving dimensions (each further option of one saves
    U(0.1, 0.5) in log), +-5% for the others; and the saving dimensions' cumulative steps, by dimension index.
    Draws from `rng` in dimension order (the landscapes depend on that order)."""
    logmem = np.zeros(ch.shape[0])
    save_steps = {}
    for d, name in enumerate(names):
        if name in saving:
            steps = rng.uniform(0.1, 0.5, size=sizes[d] - 1)
            save_steps[d] = np.concatenate([[0.0], np.cumsum(steps)])
            logmem -= save_steps[d][ch[:, d]]
        else:
            logmem += rng.uniform(-0.05, 0.05, size=sizes[d])[ch[:, d]]
    return logmem, save_steps


class Land:
    def __init__(self, space, family, seed):
        self.rng = np.random.default_rng([seed, 4242])
        rng = self.rng
        cands = space.candidates()
        labels = space.labels()
        self.names = list(labels)
        self.sizes = [len(v) for v in labels.values()]
        self.cands = cands
        self.strategies = [c.strategy for c in cands]
        ch = np.array([c.choices for c in cands])
        n, D = ch.shape
        self.noise = 0.03
        logmem, save_steps = monotone_log_memory(rng, self.names, self.sizes, ch)
        oom_frac = 0.0
        if family == "additive":
            self.noise = 0.10
            logtp = sum(rng.normal(0, 0.2, size=k)[ch[:, d]] for d, k in enumerate(self.sizes))
            oom_frac = rng.uniform(0, 0.3)
        elif family == "needle":
            self.noise = 0.02
            logtp = np.log(rng.uniform(0.95, 1.0, size=n))
            needle = int(rng.integers(n))
            logtp[needle] = np.log(1.3)
            oom_frac = 0.0
        elif family == "onedim":
            self.noise = 0.03
            widest = [d for d in range(D) if self.sizes[d] == max(self.sizes)]
            d0 = widest[int(rng.integers(len(widest)))]
            eff = rng.normal(0, 0.2, size=self.sizes[d0])
            logtp = eff[ch[:, d0]]
            oom_frac = 0.0
        elif family in ("memslow", "flakyoom"):
            # memslow: the memory-saving options are slower, 40% of the candidates run out of memory.
            # flakyoom: the same, and a candidate within 8% under the limit runs out of memory on half its
            # dry runs (fragmentation, allocator variance): one flaky OOM rules out, by dominance, every
            # candidate needing at least its memory
            self.noise = 0.03
            logtp = np.zeros(n)
            for d, name in enumerate(self.names):
                if d in save_steps:
                    cost = np.concatenate([[0.0], np.cumsum(rng.uniform(0.05, 0.2, size=self.sizes[d] - 1))])
                    logtp -= cost[ch[:, d]]
                else:
                    logtp += rng.normal(0, 0.1, size=self.sizes[d])[ch[:, d]]
            oom_frac = 0.4
        elif family == "threeway":
            self.noise = 0.03
            logtp = sum(rng.normal(0, 0.05, size=k)[ch[:, d]] for d, k in enumerate(self.sizes))
            triples = list(itertools.combinations(range(D), 3))
            pick = rng.choice(len(triples), size=min(3, len(triples)), replace=False)
            for t in pick:
                a, b, c = triples[t]
                tab = rng.normal(0, 0.2, size=(self.sizes[a], self.sizes[b], self.sizes[c]))
                logtp = logtp + tab[ch[:, a], ch[:, b], ch[:, c]]
            oom_frac = rng.uniform(0, 0.3)
        elif family == "nonmono":
            # memory NOT monotone in the "saving" options: tensor parallel and checkpoint cost memory
            # for some configurations (e.g. communication buffers), violating the dominance assumption
            self.noise = 0.03
            logtp = sum(rng.normal(0, 0.2, size=k)[ch[:, d]] for d, k in enumerate(self.sizes))
            logmem = sum(rng.normal(0, 0.3, size=k)[ch[:, d]] for d, k in enumerate(self.sizes))
            oom_frac = 0.3
        else:
            raise ValueError(family)
        self.logtp = np.asarray(logtp, dtype=float) + math.log(100.0)
        self.mem = 40e9 * np.exp(logmem)
        srt = np.sort(self.mem)
        if oom_frac * n >= 1:
            self.limit = int(srt[int(math.floor((1 - oom_frac) * n)) - 1] * 1.0000001) if oom_frac < 1 else 1
        else:
            self.limit = int(srt[-1] * 1.01)
        self.ok = self.mem <= self.limit
        self.flaky = (self.mem > 0.92 * self.limit) & self.ok if family == "flakyoom" else np.zeros(n, bool)
        self.best = float(np.exp(self.logtp[self.ok].max()))
        self.index = {s: i for i, s in enumerate(self.strategies)}
        self.noise_rng = np.random.default_rng([seed, 777])

    def evaluate(self, s):
        i = self.index[s]
        m = int(self.mem[i] * math.exp(self.noise_rng.normal(0, 0.01)))
        if not self.ok[i] or (self.flaky[i] and self.noise_rng.random() < 0.5):
            return DryRunResult(0.0, m, "oom: synthetic")
        step = BATCH / math.exp(self.logtp[i])
        sig = self.noise * math.sqrt(STEPS)
        t = tuple(float(step * math.exp(self.noise_rng.normal(0, sig))) for _ in range(STEPS))
        mean = float(np.mean(t))
        return DryRunResult(BATCH / mean, m, None, mean, t)

    def ratio(self, s):
        return 0.0 if s is None else float(math.exp(self.logtp[self.index[s]])) / self.best


def land_best_label(land):
    i = int(np.argmax(np.where(land.ok, land.logtp, -np.inf)))
    return land.cands[i].label()


def random_search(land, budget, seed):
    rng = np.random.default_rng([seed, 99])
    out = []
    for _ in range(RANDOM_ORDERS):
        order = rng.permutation(len(land.strategies))[:budget]
        best, btp = None, -1
        for i in order:
            r = land.evaluate(land.strategies[i])
            if r.ok and r.throughput > btp:
                best, btp = land.strategies[i], r.throughput
        out.append(land.ratio(best))
    return out


def summarize(r):
    r = np.asarray(r)
    return f"{np.mean(r >= TARGET) * 100:5.1f}% | {r.mean():.3f} | {r.min():.3f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--space", type=int, default=64)
    ap.add_argument("--budget", type=int, default=14)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--families", nargs="*", default=["additive", "needle", "onedim", "memslow", "threeway"])
    ap.add_argument("--out")
    a = ap.parse_args()
    space = bench.make_space(a.space)
    out = open(a.out, "a") if a.out else None
    rows = []
    t0 = time.time()
    for fam in a.families:
        ours, rnd, planner = [], [], []
        for k in range(a.seeds):
            seed = 10_000 + 100 * a.space + k + a.seed0
            land = Land(space, fam, seed)
            rnd.extend(random_search(land, a.budget, seed))
            res = search_strategy(space, lambda s: land.evaluate(s), max_trials=a.budget, patience=a.budget, seed=seed,
                                  memory_limit_bytes=land.limit)
            ratio = land.ratio(res.best)
            ours.append(ratio)
            planner.extend(res.planner_seconds)
            rec = {"space": a.space, "budget": a.budget, "family": fam, "seed": seed, "ratio": ratio,
                   "random_mean": float(np.mean(rnd[-RANDOM_ORDERS:])), "runs": len(res.trials),
                   "oom_runs": int((res.trials["status"] == "oom").sum()), "oom_share": float(1 - land.ok.mean()),
                   "reason": res.reason, "best_pruned": bool(land_best_label(land) in set(res.pruned["strategy"])),
                   "best_tried": bool(land_best_label(land) in set(res.trials["strategy"])), "planner_max": max(res.planner_seconds, default=0.0)}
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            print(f"{fam} #{k} ({time.time() - t0:.0f}s) ours={ratio:.3f} random(mean)={rec['random_mean']:.3f} "
                  f"oom_runs={rec['oom_runs']} best_pruned={rec['best_pruned']} planner_max={rec['planner_max']:.2f}", flush=True)
        rows.append(f"| {a.space}/{a.budget} | {fam} | search | {len(ours)} | {summarize(ours)} |")
        rows.append(f"| {a.space}/{a.budget} | {fam} | random x{RANDOM_ORDERS} | {a.seeds} | {summarize(rnd)} |")
        if planner:
            print(f"  planner s/suggestion median {np.median(planner):.3f} max {max(planner):.3f}")
    print("| space/budget | family | method | landscapes | P(>=0.98) | mean | worst |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
