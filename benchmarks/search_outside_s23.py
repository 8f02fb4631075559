# An outside probe's landscape families (session 23), copied into the repository unchanged: written by a
# helper session that read only the search's public API; figures in benchmarks/RESULTS.md ("Session 23").
# Changed since: the model and parallel dimension come from benchmarks/search.py. Run from the repository root: python benchmarks/search_outside_s23.py --size 64 --budget 14 --fams trap --n 10 --pred none
"""Independent landscape families for atorch.auto.search.search_strategy vs random search.
Usage: python lands.py --size 64 --budget 14 --fams pair2,oomfringe --n 6 [--patience P] [--pred none,wrong]
"""
import argparse, itertools, math, sys, time, json
import numpy as np
from transformers import LlamaConfig
from atorch.auto.cost_model import Estimate
from atorch.auto.opt_lib import registered_names
from atorch.auto.opt_lib.base import Optimization, register
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from search import model_world_and_parallel  # benchmarks/search.py (this script's directory is on sys.path)

BATCH = 32
def knob(name, order):
    if name not in registered_names():
        register(type("K_" + name, (Optimization,), {"name": name, "order": order}))

def make_space(size):
    cfg, world, parallel = model_world_and_parallel(size)   # benchmarks/search.py's (the probe's own copy before)
    dims = {"amp": [None, "amp_native"], "zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
            "module_replace": [None, "module_replace"]}
    if size >= 256:
        knob("lk_knob1", 51); dims["knob1"] = [None, "lk_knob1"]
    if size >= 512:
        knob("lk_knob2", 52); dims["knob2"] = [None, "lk_knob2"]
    dims["parallel"] = parallel
    sp = SearchSpace(dims, world_size=world, model_config=cfg, device_type="cuda", merge_idle=False)
    assert len(sp.candidates()) == size, len(sp.candidates())
    return sp

MEMSAVE = {"zero", "checkpoint", "parallel"}

class Land:
    """A table: log throughput, memory, failure kind per candidate, built from my own RNG."""
    def __init__(self, space, fam, seed):
        self.fam, self.seed = fam, seed
        rng = np.random.default_rng([seed, 777])
        cands = space.candidates(); self.cands = cands
        names = list(space.labels()); sizes = [len(v) for v in space.labels().values()]
        self.names, self.sizes = names, sizes
        n = len(cands); X = np.array([c.choices for c in cands])
        self.S = [c.strategy for c in cands]
        lt = np.zeros(n); noise = 0.03; self.slow_p = 0.0; self.spike_p = 0.0
        # default monotone memory: each saving step saves 10-40%
        memf = []
        for d, nm in enumerate(names):
            if nm in MEMSAVE:
                memf.append(np.concatenate([[1.0], np.cumprod(np.exp(-rng.uniform(0.1, 0.5, sizes[d]-1)))]))
            else:
                memf.append(rng.uniform(0.95, 1.05, sizes[d]))
        mem = 40e9 * np.prod([memf[d][X[:, d]] for d in range(len(sizes))], axis=0)
        oom_frac = rng.uniform(0.1, 0.4)
        self.fail = {}  # index -> "exception"/"timeout"
        main = [rng.normal(0, 0.15, k) for k in sizes]
        base = sum(main[d][X[:, d]] for d in range(len(sizes)))
        if fam == "pair2":          # one strong 2-way interaction dominating main effects
            small = sum(rng.normal(0, 0.03, k)[X[:, d]] for d, k in enumerate(sizes))
            d, e = rng.choice(len(sizes), 2, replace=False)
            i, j = rng.integers(sizes[d]), rng.integers(sizes[e])
            lt = small + 0.35 * ((X[:, d] == i) & (X[:, e] == j))
        elif fam == "deceptive":    # main effects point away from the best pair
            d, e = rng.choice(len(sizes), 2, replace=False)
            i, j = rng.integers(sizes[d]), rng.integers(sizes[e])
            m = [rng.normal(0, 0.05, k) for k in sizes]
            m[d][:] = 0.15; m[d][i] = -0.15; m[e][:] = 0.15; m[e][j] = -0.15
            lt = sum(m[k][X[:, k]] for k in range(len(sizes))) + 0.6 * ((X[:, d] == i) & (X[:, e] == j))
        elif fam == "trap":         # 3-way deceptive trap: every main effect and pair points away
            dims = rng.choice(len(sizes), 3, replace=False); opt = [rng.integers(sizes[k]) for k in dims]
            hits = sum((X[:, k] == o).astype(float) for k, o in zip(dims, opt))
            lt = rng.normal(0, 0.03, n) - 0.08 * hits + 0.5 * (hits == 3)
        elif fam == "oomfringe":    # faster the more memory it uses; best fits by 0.5%
            lt = 0.6 * np.log(mem / mem.max()) * -1 * -1 + base * 0.3   # more memory -> faster
            order = np.argsort(-lt)
            k = int(oom_frac * n)
            # limit just above the memory of the best among those after the top k
            best = order[k]
            self.limit = mem[best] * 1.005
            # make sure top ones (more memory) OOM: they have higher memory? enforce
            for idx in order[:k]:
                mem[idx] = max(mem[idx], self.limit * rng.uniform(1.01, 1.3))
            for idx in order[k+1:]:
                mem[idx] = min(mem[idx], self.limit * rng.uniform(0.5, 0.999))
            lt[best] = lt[order[:k]].min() if k else lt[best]
        elif fam == "memnonmono":   # memory non-monotone: fsdp/checkpoint sometimes use MORE memory
            lt = base
            bump = rng.uniform(0.6, 1.8, size=[sizes[d] for d in range(len(sizes))])
            mem = 40e9 * np.array([bump[tuple(c)] for c in X]) * rng.uniform(0.8, 1.2, n)
            # best candidate: has the least saving options yet fits, all "leaner" neighbours OOM
        elif fam == "flat1":
            lt = 0.01 * (base - base.min()) / np.ptp(base)
        elif fam == "heavytail":
            lt = base + sum(rng.normal(0, 0.1, (sizes[d], sizes[e]))[X[:, d], X[:, e]]
                            for d, e in itertools.combinations(range(len(sizes)), 2) if rng.random() < 0.3)
            self.slow_p = 0.1      # whole dry run 2x slow (steps consistent within run)
        elif fam == "spiky":
            lt = base; self.spike_p = 0.1
        elif fam == "timeouts":
            lt = base
            for idx in rng.choice(n, int(0.15 * n), replace=False): self.fail[int(idx)] = "timeout"
        elif fam == "raising30":   # 30% raise, independently (no shared cause)
            lt = base
            for idx in rng.choice(n, int(0.3 * n), replace=False): self.fail[int(idx)] = "exception"
        elif fam == "raising30top":  # 30% raise, preferentially the fast ones
            lt = base
            p = np.exp(3 * (lt - lt.max())); p = 0.3 * n * p / p.sum(); p = np.clip(p, 0, 0.9)
            for idx in range(n):
                if rng.random() < p[idx]: self.fail[idx] = "exception"
        elif fam == "noisy10":
            lt = base; noise = 0.10
        else:
            raise ValueError(fam)
        self.lt = np.asarray(lt, float); self.mem = mem; self.noise = noise
        if fam != "oomfringe":
            ms = np.sort(mem); self.limit = ms[min(n - 1, int((1 - oom_frac) * n))] * 1.0000001
        if fam == "memnonmono":
            # move the best to a candidate with fewer saving options than some OOM one
            ok = [i for i in range(n) if mem[i] <= self.limit]
            best = max(ok, key=lambda i: lt[i])
        self.ok = np.array([mem[i] <= self.limit and i not in self.fail for i in range(n)])
        if not self.ok.any(): self.ok[np.argmin(mem)] = True; self.fail.pop(int(np.argmin(mem)), None)
        self.best = float(np.exp(self.lt[self.ok].max()))
        self.idx = {s: i for i, s in enumerate(self.S)}
        prng = np.random.default_rng([seed, 999])
        # deliberately wrong predictor: throughput anti-correlated, memory biased low by 30%
        self.wrong = {s: Estimate(int(mem[i] * 0.7), BATCH / (100 * math.exp(-self.lt[i] + prng.normal(0, 0.05))))
                      for i, s in enumerate(self.S)}
        # mislead: right on most, but the top 5% (true) predicted 30% slower and 2x over the memory limit
        top = set(np.argsort(-np.where(self.ok, self.lt, -9))[:max(1, n // 20)].tolist())
        self.mislead = {s: Estimate(int(self.limit * 2 if i in top else mem[i]),
                                    BATCH / (100 * math.exp(self.lt[i] + prng.normal(0, 0.05) - (0.3 if i in top else 0))))
                        for i, s in enumerate(self.S)}
        self.randpred = {s: Estimate(int(mem[i] * math.exp(prng.normal(0, 0.5))), BATCH / (100 * math.exp(prng.normal(0, 0.3))))
                         for i, s in enumerate(self.S)}
        self.reset("x")

    def reset(self, tag):
        self.rng = np.random.default_rng([self.seed, sum(map(ord, tag))])

    def evaluate(self, s):
        i = self.idx[s]
        if i in self.fail:
            if self.fail[i] == "timeout":
                return DryRunResult(0.0, None, "timeout: synthetic")
            raise RuntimeError("synthetic raise")
        if self.mem[i] > self.limit:
            return DryRunResult(0.0, int(self.mem[i]), "oom: synthetic out of memory")
        step = BATCH / (100 * math.exp(self.lt[i]))
        if self.slow_p and self.rng.random() < self.slow_p: step *= 2
        sig = self.noise * math.sqrt(8)
        steps = []
        for _ in range(8):
            t = step * math.exp(self.rng.normal(0, sig))
            if self.spike_p and self.rng.random() < self.spike_p: t *= self.rng.uniform(2, 3)
            steps.append(float(t))
        m = float(np.mean(steps))
        return DryRunResult(BATCH / m, int(self.mem[i]), step_time_s=m, step_times_s=tuple(steps))

    def ratio(self, s):
        if s is None: return 0.0
        i = self.idx[s]
        if not self.ok[i]: return -1.0   # declared a failed/oom candidate
        return float(np.exp(self.lt[i])) / self.best

def run_search(space, land, budget, pred, patience, seed):
    calls = []
    def ev(s):
        calls.append(s)
        return land.evaluate(s)
    land.reset("ours" + pred)
    table = {"none": None, "wrong": land.wrong, "mislead": land.mislead, "randpred": land.randpred}[pred]
    p = None if table is None else (lambda s: table[s])
    t0 = time.time()
    r = search_strategy(space, ev, max_trials=budget, patience=patience, seed=seed, predictor=p,
                        memory_limit_bytes=int(land.limit))
    return land.ratio(r.best), len(calls), len(set(calls)), time.time() - t0, r

def run_random(land, budget, orders=100):
    land.reset("random"); rng = np.random.default_rng([land.seed, 5])
    out = []
    for _ in range(orders):
        best, bt = None, -1
        for k in rng.permutation(len(land.S))[:budget]:
            try: r = land.evaluate(land.S[k])
            except RuntimeError: continue
            if r.ok and r.throughput > bt: best, bt = land.S[k], r.throughput
        out.append(land.ratio(best))
    return out

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64); ap.add_argument("--budget", type=int, default=14)
    ap.add_argument("--fams", default="pair2"); ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--patience", type=int, default=None); ap.add_argument("--pred", default="none,wrong")
    ap.add_argument("--seed0", type=int, default=0)
    a = ap.parse_args()
    space = make_space(a.size)
    for fam in a.fams.split(","):
        for pred in a.pred.split(","):
            ours, rnd, flags = [], [], []
            for k in range(a.n):
                seed = a.seed0 + k
                land = Land(space, fam, seed)
                pat = a.patience if a.patience else a.budget
                ratio, calls, uniq, secs, res = run_search(space, land, a.budget, pred, pat, seed)
                rr = run_random(land, a.budget)
                ours.append(ratio); rnd.extend(rr)
                f = []
                if calls > a.budget: f.append(f"OVERBUDGET{calls}")
                if ratio < 0: f.append("DECLARED_FAILED")
                print(f"  {fam} pred={pred} seed={seed} ours={ratio:.3f} calls={calls} uniq={uniq} rand_mean={np.mean(rr):.3f} "
                      f"secs={secs:.1f} plan_med={np.median(res.planner_seconds) if res.planner_seconds else float('nan'):.2f} plan_max={max(res.planner_seconds, default=float('nan')):.2f} stop={res.stop_reason!r} {' '.join(f)}", flush=True)
            o = np.clip(np.array(ours), 0, None); r = np.clip(np.array(rnd), 0, None)
            print(f"SUMMARY size={a.size} budget={a.budget} pat={a.patience or a.budget} fam={fam} pred={pred} n={a.n} | "
                  f"ours P98={np.mean(o>=0.98):.2f} mean={o.mean():.3f} worst={o.min():.3f} | "
                  f"random P98={np.mean(r>=0.98):.2f} mean={r.mean():.3f} worst={r.min():.3f} | "
                  f"{'WORSE' if o.mean() < r.mean() else 'ok'}", flush=True)
