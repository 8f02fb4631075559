"""cProfile of one search_strategy on a default space (landscape 0):

    python benchmarks/default_space_search/profile_search.py llama7b 64 512 20
"""
import os, sys, cProfile, pstats, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models
from landscape import Landscape
from atorch.auto.search import SearchSpace
from atorch.auto.search.search import search_strategy
name, w, b, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = models.build(name); cfg = model.config
P = sum(p.numel() for p in model.parameters())
space = SearchSpace.default_for(model, world_size=w, device_type="cuda", global_batch_size=b)
cands = space.candidates()
ls = Landscape(P, cfg.num_hidden_layers, cfg.hidden_size, 2048, w, b, seed=1000).calibrate(cands)
ev = ls.evaluator(seed=0)
times = []
def timed(s):
    times.append(time.perf_counter()); return ev(s)
pr = cProfile.Profile(); pr.enable(); t = time.perf_counter()
res = search_strategy(space, timed, max_trials=trials, memory_limit_bytes=int(ls.limit), batch_size=b, seed=0)
pr.disable()
print("wall", time.perf_counter() - t, "gaps between dry runs:", [round(b - a, 2) for a, b in zip(times, times[1:])])
print(res.trials[["source", "status", "planner_seconds"]].to_string())
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
