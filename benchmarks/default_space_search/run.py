"""search_strategy on a real default space (`SearchSpace.default_for`) against random search, on a
synthetic landscape written by an outside probe session (session 19) that had not seen the search's
tuning (`landscape.py`: pipeline bubbles, micro-batch efficiency, tensor-parallel all-reduces with a
slower link past 8 ranks, ZeRO/FSDP traffic, CPU offload, its own memory arithmetic with 20-60% of
the candidates out of memory, 3% noise; nothing from atorch's cost model).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_space_search/run.py llama7b 64 512 --trials 20 \
        --landscapes 10 --first 2 [--predictor cost] [--per-node 8]

`--per-node N` searches the space a job of N ranks per node gets (tensor splits inside a node) on
the same landscapes (calibrated on the full space). Prints one JSON line per search and a SUMMARY.
"""
import argparse, logging, os, resource, statistics, sys, time, json, collections, warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, torch
import models
from landscape import Landscape
from atorch.auto.search import SearchSpace
from atorch.auto.search.search import search_strategy

ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("world", type=int); ap.add_argument("batch", type=int)
ap.add_argument("--trials", default="20"); ap.add_argument("--landscapes", type=int, default=5)
ap.add_argument("--first", type=int, default=0)
ap.add_argument("--predictor", default="none"); ap.add_argument("--report", default=None)
ap.add_argument("--seq", type=int, default=2048); ap.add_argument("--per-node", type=int, default=None); ap.add_argument("--json", default=None)
a = ap.parse_args()


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING); self.c = collections.Counter()
    def emit(self, rec):
        self.c[rec.getMessage()[:110]] += 1
counter = Count(); logging.getLogger().addHandler(counter); logging.getLogger().setLevel(logging.WARNING)

model = models.build(a.model)
cfg = model.config
P = sum(p.numel() for p in model.parameters())
L = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
H = getattr(cfg, "hidden_size", None) or cfg.n_embd
t0 = time.perf_counter()
space = SearchSpace.default_for(model, world_size=a.world, device_type="cuda", global_batch_size=a.batch)
cands = space.candidates()
full_cands = cands
if a.per_node:
    space = SearchSpace.default_for(model, world_size=a.world, device_type="cuda", global_batch_size=a.batch,
                                    ranks_per_node=a.per_node)
    cands = space.candidates()
    print(f"# restricted to tensor splits <= {a.per_node}: {len(cands)} candidates", flush=True)
print(f"# {a.model} w={a.world} B={a.batch}: {len(cands)} candidates, built in {time.perf_counter()-t0:.1f}s, P={P/1e9:.2f}B", flush=True)
pred = None
if a.predictor == "cost":
    from atorch.auto.search.auto_search import make_predictor
    pred_factory = lambda: make_predictor(model, a.batch, a.seq, a.world, torch.device("cuda"))
    t = time.perf_counter(); p0 = pred_factory(); [p0(c.strategy) for c in cands[:50]]
    print(f"# cost model: {(time.perf_counter()-t)/50*1000:.1f} ms/candidate", flush=True)
rows = []
for trials in map(int, a.trials.split(",")):
    for k in range(a.first, a.first + a.landscapes):
        ls = Landscape(P, L, H, a.seq, a.world, a.batch, seed=1000 + k).calibrate(full_cands)
        oom = sum(1 for x in ls.thr if x == 0) / len(full_cands)
        counter.c.clear()
        t = time.perf_counter()
        err = None
        try:
            res = search_strategy(space, ls.evaluator(seed=k), max_trials=trials, random_samples=3, patience=8,
                                  predictor=pred_factory() if a.predictor == "cost" else None,
                                  memory_limit_bytes=int(ls.limit), batch_size=a.batch, seed=k)
        except Exception as e:
            import traceback; traceback.print_exc(); err = repr(e); res = None
        wall = time.perf_counter() - t
        if res is None:
            rows.append(dict(trials=trials, k=k, err=err)); print(rows[-1], flush=True); continue
        ps = res.planner_seconds
        src = collections.Counter(s.split(" ")[0] for s in res.trials["source"])
        status = collections.Counter(res.trials["status"])
        ratio = ls.true_thr(res.best) / ls.best if res.best is not None else 0.0
        # random search, same budget
        rr = []
        for rep in range(5):
            rng = np.random.default_rng(10_000 * k + rep)
            ev = ls.evaluator(seed=10_000 * k + rep + 1)
            pick = rng.choice(len(cands), size=min(trials, len(cands)), replace=False)
            meas = [(ev(cands[i].strategy).throughput, i) for i in pick]
            best_i = max(meas)[1]
            rr.append(ls.true_thr(cands[best_i].strategy) / ls.best if max(meas)[0] > 0 else 0.0)
        # which parallel dims were tried
        dims = list(space.dimensions)
        tried_par = sorted({cands[[c.strategy for c in cands].index(s)].choices[0] for s in res.evaluated}) if res.evaluated else []
        best_c = max(range(len(full_cands)), key=lambda i: ls.thr[i])
        row = dict(trials=trials, k=k, oom_frac=round(oom, 2), wall=round(wall, 1), n=len(res.trials),
                   planner_med=round(statistics.median(ps), 3) if ps else None, planner_max=round(max(ps), 3) if ps else None,
                   n_planner=len(ps), src=dict(src), status=dict(status), ratio=round(ratio, 3),
                   random=round(statistics.mean(rr), 3), random_all=[round(x, 3) for x in rr],
                   stop=res.stop_reason, warnings=sum(counter.c.values()), warn_kinds=len(counter.c),
                   best_label=full_cands[best_c].label(), win_label=res.best.describe() if res.best else None,
                   tried_parallel=tried_par, rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if counter.c:
            print("  warnings:", dict(counter.c.most_common(3)), flush=True)
        if a.report and k == a.first:
            from atorch.auto.search.report import write_report
            try:
                print("  report:", write_report(res, f"{a.report}/t{trials}"), flush=True)
                print("  reason:", res.reason, flush=True)
            except Exception as e:
                import traceback; traceback.print_exc()
if a.json:
    json.dump(rows, open(a.json, "w"))
for trials in map(int, a.trials.split(",")):
    rs = [r for r in rows if r["trials"] == trials and "ratio" in r]
    if rs:
        h = [r["ratio"] for r in rs]; rnd = [r["random"] for r in rs]
        print(f"SUMMARY {a.model} w={a.world} B={a.batch} pred={a.predictor} trials={trials} n={len(rs)}: "
              f"hebo mean {np.mean(h):.3f} >=0.98 {np.mean([x>=0.98 for x in h]):.2f} | random mean {np.mean(rnd):.3f} "
              f">=0.98 {np.mean([x>=0.98 for r in rs for x in r['random_all']]):.2f} | wall med {np.median([r['wall'] for r in rs]):.1f}s "
              f"| planner med {np.median([r['planner_med'] or 0 for r in rs]):.2f}s max {max(r['planner_max'] or 0 for r in rs):.2f}s", flush=True)
