"""New landscape families for atorch's search_strategy vs random search at an equal budget.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search_more_landscapes.py --space 64 --budget 14 --seeds 60 \
        --families spiky drift ... [--out FILE.jsonl]

Written in session 14 by a helper session independently of the search's tuning (only the public
API and docstrings of atorch.auto.search were read); copied here unchanged but for paths.
Figures in benchmarks/RESULTS.md ("Session 14").
Each landscape is built from its own random numbers; the space comes from benchmarks/search.py
(make_space(64|256)); 512 is built here (the 256 space + one more two-way benchmark knob).
Ratio = TRUE throughput of the declared winner / TRUE best runnable candidate (0 if the winner
is not runnable, or no winner). Random = `budget` distinct uniform candidates, declare the best
measured one (30 orders per landscape), same evaluator (same noise, drift, spikes, failures).
"""
import argparse
import itertools
import json
import logging
import math
import os
import sys
import time
import warnings

import numpy as np

from atorch.auto.search import DryRunResult, SearchSpace, search_strategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from search_independent import bench, monotone_log_memory  # noqa: E402 - search.py loaded once

RANDOM_ORDERS = 30
TARGET = 0.98
STEPS = 5
BATCH = 32.0
SAVING = {"zero", "checkpoint", "parallel"}


def pair_masks(ch, sizes, lo, hi, keep=lambda a, x, b, y: True):
    """Masks of the candidates holding option x of dimension a and y of b, for every pair of dimensions,
    that cover a share of the space in [lo, hi] (and that `keep` accepts), in a fixed order."""
    out = []
    for a, b in itertools.combinations(range(ch.shape[1]), 2):
        for x in range(sizes[a]):
            for y in range(sizes[b]):
                m = (ch[:, a] == x) & (ch[:, b] == y)
                if lo <= m.mean() <= hi and keep(a, x, b, y):
                    out.append(m)
    return out


class WarnCounter(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage()[:200])


WARN = WarnCounter()
logging.getLogger("atorch").addHandler(WARN)
logging.getLogger("atorch").setLevel(logging.WARNING)
logging.getLogger("atorch").propagate = False


def make_space(size):
    if size in (64, 256):
        return bench.make_space(size)
    assert size == 512
    from transformers import LlamaConfig
    from atorch.auto.opt_lib import registered_names
    from atorch.auto.opt_lib.base import Optimization, register
    bench.make_space(256)   # registers bench_knob
    if "bench_knob2" not in registered_names():
        register(type("BenchKnob2", (Optimization,), {"name": "bench_knob2", "order": 51}))
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=16)
    world, tensors = 8, (2, 4, 8)
    parallel = [("parallel_mode", ([("data", world)], None))]
    parallel += [[("parallel_mode", ([("tensor", t), ("data", world // t)], None)), "tensor_parallel"] for t in tensors]
    dims = {"amp": [None, "amp_native"], "zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
            "module_replace": [None, "module_replace"], "knob": [None, "bench_knob"], "knob2": [None, "bench_knob2"],
            "parallel": parallel}
    space = SearchSpace(dims, world_size=world, model_config=cfg, device_type="cuda", merge_idle=False)
    assert len(space.candidates()) == 512, len(space.candidates())
    return space


class Land:
    """A landscape: true log-throughput, true memory, runnable set, and an evaluator factory."""

    def __init__(self, space, family, seed, budget):
        self.family, self.seed, self.budget = family, seed, budget
        self.rng = rng = np.random.default_rng([seed, 5151])
        cands = space.candidates()
        labels = space.labels()
        self.names = list(labels)
        self.sizes = [len(v) for v in labels.values()]
        self.strategies = [c.strategy for c in cands]
        self.labels_ = [c.label() for c in cands]
        ch = self.ch = np.array([c.choices for c in cands])
        n, D = ch.shape
        self.n = n
        # ---- memory: monotone in the saving dims, +-5% for the rest
        logmem, save_steps = monotone_log_memory(rng, self.names, self.sizes, ch, SAVING)
        # ---- base throughput: main effects + two interacting pairs
        def additive(sig_main=0.15, sig_pair=0.1, npairs=2):
            lt = sum(rng.normal(0, sig_main, size=k)[ch[:, d]] for d, k in enumerate(self.sizes))
            pairs = list(itertools.combinations(range(D), 2))
            for p in rng.choice(len(pairs), size=npairs, replace=False):
                a, b = pairs[p]
                lt = lt + rng.normal(0, sig_pair, size=(self.sizes[a], self.sizes[b]))[ch[:, a], ch[:, b]]
            return lt

        def memslow():
            lt = np.zeros(n)
            for d in range(D):
                if d in save_steps:
                    cost = np.concatenate([[0.0], np.cumsum(rng.uniform(0.05, 0.2, size=self.sizes[d] - 1))])
                    lt -= cost[ch[:, d]]
                else:
                    lt += rng.normal(0, 0.1, size=self.sizes[d])[ch[:, d]]
            return lt

        self.noise = np.full(n, 0.03)       # relative error of one run's mean, per candidate
        self.bias = np.zeros(n)             # persistent log bias of every measurement of a candidate
        self.spike_p, self.spike_lo, self.spike_hi = 0.0, 1.0, 1.0
        self.drift = None                   # None | ("walk", sd, clip) | ("jump",)
        self.raises = np.zeros(n, bool)     # deterministic exception
        self.hangs = np.zeros(n, bool)      # deterministic timeout
        self.transient_timeout = 0.0
        self.oom_as_exception = 0.0         # share of OOMs reported as a non-OOM exception text, no peak
        oom_frac = rng.uniform(0, 0.3)
        limit_override = None
        self.robust_report = False
        if family in ("spiky", "spikyrobust"):   # one step in ~12 is 3-10x slower (GC pause, another job)
            # spiky: throughput = batch / plain mean of the steps (DryRunResult's documented definition);
            # spikyrobust: throughput = batch / step_timing.summarize(steps).mean_s (the dry runner's statistic)
            logtp = additive()
            self.robust_report = family == "spikyrobust"
            self.spike_p, self.spike_lo, self.spike_hi = 0.08, 3.0, 10.0
        elif family == "drift":             # machine load: random walk over dry runs, +-20%
            logtp = additive()
            self.drift = ("walk", 0.06, 0.2)
        elif family == "loadjump":          # another job starts (or ends) once during the search
            logtp = additive()
            self.drift = ("jump",)
        elif family in ("raises", "raisesbest"):
            # an option pair (two dims) raises wherever it appears: 5-20% of the candidates;
            # raisesbest: the pair is one of the unconstrained-fastest candidate's own pairs
            logtp = additive()
            top = int(np.argmax(logtp))
            opts = pair_masks(ch, self.sizes, 0.05, 0.20,
                              lambda a, x, b, y: family == "raises" or (ch[top, a] == x and ch[top, b] == y))
            if not opts:     # fall back to single options in the size band
                for a in range(D):
                    for x in range(self.sizes[a]):
                        m = ch[:, a] == x
                        if 0.05 <= m.mean() <= 0.25 and (family == "raises" or ch[top, a] == x):
                            opts.append(m)
            pick = np.random.default_rng([seed, 31, len(family)])
            self.raises = opts[int(pick.integers(len(opts)))].copy()
            # plus 2% isolated raisers
            self.raises |= pick.random(n) < 0.02
        elif family == "edge":
            # memory strongly correlated with throughput (less saving = faster); the best runnable
            # candidate's peak is exactly at the limit (+0.05%)
            z = (logmem - logmem.mean()) / logmem.std()
            logtp = 0.15 * z + rng.normal(0, 0.02, size=n)
            oom_frac = rng.uniform(0.2, 0.5)
            srt = np.sort(np.exp(logmem))
            lim0 = srt[int(math.floor((1 - oom_frac) * n)) - 1] * 1.0000001
            ok0 = np.exp(logmem) <= lim0
            b = int(np.argmax(np.where(ok0, logtp, -np.inf)))
            limit_override = float(40e9 * math.exp(logmem[b]) * 1.0005)
        elif family == "mostoom":           # 60-80% of the space runs out of memory
            logtp = memslow() if rng.random() < 0.5 else additive()
            oom_frac = rng.uniform(0.6, 0.8)
        elif family == "bias":              # persistent per-candidate measurement bias +-5%
            logtp = additive(0.1, 0.05)
            self.bias = rng.uniform(-0.05, 0.05, size=n)
            self.noise[:] = 0.02
        elif family == "flat":              # all within 2%: differences below the measurement noise
            logtp = additive(0.003, 0.002) + rng.normal(0, 0.002, size=n)
            logtp = np.clip(logtp, logtp.max() - 0.0198, None)
            self.noise[:] = 0.03
        elif family == "timeouts":
            # a hanging option pair (NCCL deadlock with one combination: 5-15%) + any run times out w.p. 8%
            logtp = additive()
            opts = pair_masks(ch, self.sizes, 0.05, 0.15)
            self.hangs = opts[int(rng.integers(len(opts)))].copy()
            self.transient_timeout = 0.08
        elif family == "hetnoise":
            # noise differs per candidate: tensor-parallel (communication) runs are 4-6x noisier
            logtp = additive()
            pd_ = self.names.index("parallel")
            tp = ch[:, pd_] > 0
            self.noise = np.where(tp, rng.uniform(0.10, 0.15), rng.uniform(0.01, 0.025))
        elif family == "oomexc":
            # memslow, 40% OOM, but 70% of the OOMs come back as a CUDA/NCCL exception with no peak
            logtp = memslow()
            oom_frac = 0.4
            self.oom_as_exception = 0.7
        elif family == "base":
            logtp = additive()
        else:
            raise ValueError(family)
        self.logtp = np.asarray(logtp, float) + math.log(100.0)
        self.mem = 40e9 * np.exp(logmem)
        if limit_override is not None:
            self.limit = int(limit_override)
        else:
            srt = np.sort(self.mem)
            self.limit = int(srt[int(math.floor((1 - oom_frac) * n)) - 1] * 1.0000001)
        self.fits = self.mem <= self.limit
        self.runnable = self.fits & ~self.raises & ~self.hangs
        self.best_i = int(np.argmax(np.where(self.runnable, self.logtp, -np.inf)))
        self.best = float(np.exp(self.logtp[self.best_i]))
        self.index = {s: i for i, s in enumerate(self.strategies)}
        self.noise_rng = np.random.default_rng([seed, 778])

    # ---- one evaluator per search / random order (its own drift path)
    def evaluator(self, log=None):
        rng = self.noise_rng
        state = {"k": 0, "lf": 0.0, "jump_at": None, "jump": 0.0}
        if self.drift and self.drift[0] == "jump":
            state["jump_at"] = int(rng.integers(2, max(3, self.budget - 2)))
            f = rng.uniform(0.7, 0.85)
            state["jump"] = math.log(f) if rng.random() < 0.5 else -math.log(f)

        def evaluate(s):
            i = self.index[s]
            k = state["k"]
            state["k"] += 1
            load = 0.0
            if self.drift:
                if self.drift[0] == "walk":
                    if k > 0:
                        state["lf"] = float(np.clip(state["lf"] + rng.normal(0, self.drift[1]), -self.drift[2], self.drift[2]))
                    load = state["lf"]
                else:
                    load = state["jump"] if k >= state["jump_at"] else 0.0
            m = int(self.mem[i] * math.exp(rng.normal(0, 0.01)))
            if log is not None:
                log.append((k, i, load))
            if not self.fits[i]:
                if rng.random() < self.oom_as_exception:
                    return DryRunResult(0.0, None, "exception: RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED "
                                                   "when calling `cublasCreate(handle)`")
                return DryRunResult(0.0, m, "oom: synthetic")
            if self.raises[i]:
                return DryRunResult(0.0, None, "exception: RuntimeError: synthetic incompatibility")
            if self.hangs[i] or rng.random() < self.transient_timeout:
                return DryRunResult(0.0, None, "timeout: dry run exceeded 600 s")
            step = BATCH / math.exp(self.logtp[i] + self.bias[i] + load)
            sig = self.noise[i] * math.sqrt(STEPS)
            t = []
            for _ in range(STEPS):
                x = step * math.exp(rng.normal(0, sig))
                if self.spike_p and rng.random() < self.spike_p:
                    x *= rng.uniform(self.spike_lo, self.spike_hi)
                t.append(float(x))
            mean = float(np.mean(t))
            if self.robust_report:
                from atorch.auto.step_timing import summarize
                mean = float(summarize(t).mean_s)
            return DryRunResult(BATCH / mean, m, None, mean, tuple(t))
        return evaluate

    def ratio(self, s):
        if s is None:
            return 0.0
        i = self.index[s]
        return float(math.exp(self.logtp[i])) / self.best if self.runnable[i] else 0.0


def random_search(land, budget, seed):
    rng = np.random.default_rng([seed, 99])
    naive, robust = [], []
    for _ in range(RANDOM_ORDERS):
        ev = land.evaluator()
        order = rng.permutation(land.n)[:budget]
        b1, t1, b2, t2 = None, -1, None, -1
        for i in order:
            r = ev(land.strategies[i])
            if r.ok:
                if r.throughput > t1:
                    b1, t1 = land.strategies[i], r.throughput
                med = BATCH / float(np.median(r.step_times_s))
                if med > t2:
                    b2, t2 = land.strategies[i], med
        naive.append(land.ratio(b1))
        robust.append(land.ratio(b2))
    return naive, robust


def run_one(space, fam, seed, budget, log=None):
    land = Land(space, fam, seed, budget)
    rn, rr = random_search(land, budget, seed)
    WARN.msgs.clear()
    err = None
    t0 = time.time()
    with warnings.catch_warnings(record=True) as pyw:
        warnings.simplefilter("always")
        try:
            res = search_strategy(space, land.evaluator(log), max_trials=budget, patience=budget, seed=seed,
                                  memory_limit_bytes=land.limit)
        except Exception as e:  # noqa
            res, err = None, f"{type(e).__name__}: {e}"
    wall = time.time() - t0
    rec = {"family": fam, "seed": seed, "n": land.n, "budget": budget, "random_naive": rn, "random_robust": rr,
           "error": err, "warnings": list(WARN.msgs), "pywarnings": [str(w.message)[:200] for w in pyw], "wall": wall,
           "oom_share": float(1 - land.fits.mean()), "runnable_share": float(land.runnable.mean())}
    if res is None:
        rec["ratio"] = 0.0
        return rec, land, None
    rec["ratio"] = land.ratio(res.best)
    tr = res.trials
    rec["runs"] = len(tr)
    rec["distinct"] = int(tr["strategy"].nunique()) if len(tr) else 0
    rec["status_counts"] = {k: int(v) for k, v in tr["status"].value_counts().items()}
    rec["sources"] = {k: int(v) for k, v in tr["source"].astype(str).value_counts().items()}
    rec["reason"] = res.reason
    rec["stop_reason"] = res.stop_reason
    rec["planner"] = res.planner_seconds
    rec["best_tried"] = bool(land.labels_[land.best_i] in set(tr["strategy"].astype(str)))
    rec["best_pruned"] = bool(land.labels_[land.best_i] in set(res.pruned["strategy"].astype(str))) if len(res.pruned) else False
    c = res.comparison
    if c is not None:
        wi, ri = land.index[c.winner], land.index[c.runner_up]
        true_r = math.exp(land.logtp[wi] - land.logtp[ri])
        rec["cmp"] = {"ratio": c.ratio, "lo": c.lo, "hi": c.hi, "separated": c.separated, "chosen_by": c.chosen_by,
                      "runs": list(c.runs), "true_ratio": true_r,
                      "winner_is_best": c.winner == res.best,
                      "covered": None if c.lo is None else bool(c.lo <= true_r <= c.hi),
                      "wrong_direction": bool(c.separated and ((c.lo > 1 and true_r < 1) or (c.hi < 1 and true_r > 1)))}
    return rec, land, res


def wilson(k, n, z=1.96):
    if n == 0:
        return (0, 0)
    p = k / n
    d = 1 + z * z / n
    c = p + z * z / (2 * n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return ((c - h) / d, (c + h) / d)


def boot_diff(ours, rnd_per_land, B=4000, seed=0):
    """Paired bootstrap over landscapes of P(search>=T) - P(random>=T) and of the mean-ratio difference."""
    rng = np.random.default_rng(seed)
    o = np.asarray(ours)
    r = np.asarray(rnd_per_land)         # (L, orders)
    dp = (o >= TARGET).astype(float) - (r >= TARGET).mean(1)
    dm = o - r.mean(1)
    L = len(o)
    idx = rng.integers(0, L, size=(B, L))
    bp = dp[idx].mean(1)
    bm = dm[idx].mean(1)
    return (dp.mean(), np.percentile(bp, 2.5), np.percentile(bp, 97.5)), (dm.mean(), np.percentile(bm, 2.5), np.percentile(bm, 97.5))


def summarize(recs):
    ours = [r["ratio"] for r in recs]
    rn = np.array([r["random_naive"] for r in recs])
    rr = np.array([r["random_robust"] for r in recs])
    k = sum(x >= TARGET for x in ours)
    lo, hi = wilson(k, len(ours))
    (dp, dplo, dphi), (dm, dmlo, dmhi) = boot_diff(ours, rn)
    out = {"L": len(recs), "search_P": k / len(ours), "search_P_ci": (lo, hi), "search_mean": float(np.mean(ours)),
           "search_worst": float(np.min(ours)), "random_P": float((rn >= TARGET).mean()), "random_mean": float(rn.mean()),
           "random_worst": float(rn.min()), "random_robust_P": float((rr >= TARGET).mean()),
           "random_robust_mean": float(rr.mean()), "dP": (dp, dplo, dphi), "dmean": (dm, dmlo, dmhi)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--space", type=int, default=64)
    ap.add_argument("--budget", type=int, default=14)
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--families", nargs="*", default=["spiky"])
    ap.add_argument("--out")
    a = ap.parse_args()
    space = make_space(a.space)
    t0 = time.time()
    for fam in a.families:
        recs = []
        for k in range(a.seeds):
            seed = 50_000 + 1000 * a.space + k + a.seed0
            rec, land, res = run_one(space, fam, seed, a.budget)
            recs.append(rec)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            print(f"{fam} #{k} ({time.time() - t0:.0f}s) ours={rec['ratio']:.3f} rnd={np.mean(rec['random_naive']):.3f} "
                  f"runs={rec.get('runs')} st={rec.get('status_counts')} err={rec['error']} warns={len(rec['warnings'])}",
                  flush=True)
        s = summarize(recs)
        print(f"SUMMARY {a.space}/{a.budget} {fam} " + json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
