r"""Strategy search vs random search (and HEBO's default suggest) on landscapes that do not come from the cost model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py --space 64 --landscapes 12 [--families F ...]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py --space 256 --landscapes 6 [--families F ...]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py --space 64 --landscapes 20 --budget 20   # another budget
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py --space 64 --landscapes 2 --families interact-3% \
        --skip-ours --hebo-default 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py --planner-time

Spaces: the 64 candidates of the issue (amp x {-, zero1, zero2, fsdp} x checkpoint x
module_replace x {data 4, tensor 2 x data 2}), and 256 (the same at world 8 with {data 8,
tensor 2/4/8} and one more two-way knob, a benchmark-only optimization standing for the
dimensions being added: micro-batch, ZeRO backend). The strategies are real: validity
comes from the registry; only the measurements are synthetic.

Each landscape (`Landscape`), drawn from a family, is built from its own random numbers, never
from the cost model or from the search's own tables:
- log-throughput = a sum of per-option effects (N(0, 0.25) each: options that speed up or slow
  down by ~25%) + pairwise interactions (each pair of dimensions interacts with probability
  `pair_p`, effects N(0, `sigma_int`) per option pair);
- per-device memory = a base x a saving factor per step of every memory-saving dimension
  (ZeRO stage, checkpointing, tensor degree: exp(-U(0.05, 0.5)) per step, so memory is monotone
  in them) x a factor in [0.92, 1.08] per option of the others (amp, module_replace, knob); the
  memory limit is set so that a fraction U(0, 0.45) of the candidates runs out of memory;
- one candidate, at random, raises in its dry run;
- every dry run measures 5 step times, each x exp(N(0, noise x sqrt 5)) (so a run's mean is off
  by `noise`, and its per-step spread says so, as the dry runner's steps do).
The target is the best candidate that neither runs out of memory nor raises.

Predictors (the search's `predictor`; all are given the memory limit):
- none;
- "noisy": a stand-in for a decent cost model, built with its own random numbers: the true
  log-throughput + a wrong effect per option (N(0, 0.15)) + N(0, 0.1) per candidate; memory =
  the true peak x a global bias exp(N(0, 0.2)) x exp(N(0, 0.1)) per candidate;
- "anti": deliberately wrong: minus the true log-throughput + N(0, 0.1); memory as "noisy".

Measured: the *true* throughput of the declared winner over the best, with a budget of 14 dry
runs (64) or 20 (256), re-measurements included. Random search tries `budget` distinct random
candidates and declares the best measured one (30 random orders per landscape).
`--hebo-default N` runs HEBO's own `suggest()` (NSGA-II over the acquisition, about a minute
per suggestion on the loaded 2-core machine) on the first N landscapes of each family, no
predictor, failures observed at log(2) below the worst success.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, cast

import numpy as np
from transformers import LlamaConfig

from atorch.auto.cost_model import Estimate
from atorch.auto.opt_lib import registered_names
from atorch.auto.opt_lib.base import Optimization, register
from atorch.auto.search import DryRunResult, SearchSpace, search_strategy
from atorch.auto.strategy import Strategy

TARGET = 0.98
BUDGET = {64: 14, 256: 20}
BATCH, STEPS = 32, 5
RANDOM_ORDERS = 30


@dataclass(frozen=True)
class Family:
    sigma_main: float       # log-effect of each option
    sigma_int: float        # log-effect of each interacting option pair
    pair_p: float           # probability that a pair of dimensions interacts
    noise: float            # relative error of one dry run's mean
    # The shapes below are off for the four original families (whose landscapes stay as they were).
    shape: str = "base"     # "base", "microbatch", "flat" or "needle" (see `Landscape`)
    failing: bool = False   # a whole option (or pair of options) raises: 10-25% of the candidates
    spikes: float = 0.0     # probability that a timed step is a load spike (x U(2, 3))
    # microbatch shape only: accumulating keeps a gradient copy alive (not sharded by ZeRO), so more
    # micro-batches can need more memory, against the order the options declare (the cost model knows)
    accumulated_grads: bool = False
    # failing families: how many independent causes (each an option or pair on 10-25% of the candidates)
    failing_causes: int = 1


FAMILIES = {
    "additive-3%": Family(0.25, 0.04, 0.3, 0.03),
    "interact-0%": Family(0.25, 0.12, 0.5, 0.0),
    "interact-3%": Family(0.25, 0.12, 0.5, 0.03),
    "interact-10%": Family(0.25, 0.12, 0.5, 0.10),
    # Shapes the search was not tuned on ("Search on other landscape families" in RESULTS.md).
    "microbatch-3%": Family(0.25, 0.12, 0.5, 0.03, shape="microbatch"),
    "failing-3%": Family(0.25, 0.12, 0.5, 0.03, failing=True),
    "spikes-3%": Family(0.25, 0.12, 0.5, 0.03, spikes=0.1),
    "flat-3%": Family(0.25, 0.12, 0.5, 0.03, shape="flat"),
    "needle-3%": Family(0.10, 0.0, 0.0, 0.03, shape="needle"),
    "microgradients-3%": Family(0.25, 0.12, 0.5, 0.03, shape="microbatch", accumulated_grads=True),
}
# The micro-batch family's global batch (the per-rank batch is this / the data-parallel size).
MICRO_GLOBAL_BATCH = 64
MICRO_STEPS = (2, 4, 8)
PREDICTORS = ("none", "noisy", "anti")

# The landscape's own physics of memory: which options save memory, in which order (its own
# table, so the benchmark does not borrow the search's `memory_saving_ranks`).
_SAVES = {"zero": ["none", "zero1", "zero2", "fsdp"], "checkpoint": ["none", "checkpoint"]}


def model_world_and_parallel(size: int) -> Tuple[LlamaConfig, int, list]:
    """The benchmark spaces' model config, world size (4 ranks for 64 candidates, else 8) and parallel
    dimension (plain data parallel, or tensor 2 (/4/8) x data)."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=16)
    world, tensors = (4, (2,)) if size == 64 else (8, (2, 4, 8))
    parallel: list = [("parallel_mode", ([("data", world)], None))]
    parallel += [[("parallel_mode", ([("tensor", t), ("data", world // t)], None)), "tensor_parallel"] for t in tensors]
    return cfg, world, parallel


def make_space(size: int, micro_batch: bool = False) -> SearchSpace:
    """The 64 or 256 candidates; with `micro_batch`, an ordinal micro-batch dimension (no
    accumulation, or 2/4/8 micro-batches per step at a global batch of 64) in place of
    module_replace (and the benchmark knob, and amp at 64), keeping the size."""
    if micro_batch:
        return _make_micro_space(size)
    cfg, world, parallel = model_world_and_parallel(size)
    dims = {"amp": [None, "amp_native"], "zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
            "module_replace": [None, "module_replace"]}
    if size == 256:
        if "bench_knob" not in registered_names():
            register(type("BenchKnob", (Optimization,), {"name": "bench_knob", "order": 50}))
        dims["knob"] = [None, "bench_knob"]
    dims["parallel"] = parallel
    # merge_idle=False: at 256 the synthetic landscape gives torch ZeRO over tensor=8 (one data rank)
    # throughputs of their own, as before the space merged them with the candidates without it.
    space = SearchSpace(dims, world_size=world, model_config=cfg, device_type="cuda", merge_idle=False)
    assert len(space.candidates()) == size, len(space.candidates())
    return space


def _make_micro_space(size: int) -> SearchSpace:
    cfg, world, parallel = model_world_and_parallel(size)
    dims: Dict[str, list] = {} if size == 64 else {"amp": [None, "amp_native"]}
    dims.update({"zero": [None, "zero1", "zero2", "fsdp"], "checkpoint": [None, "checkpoint"],
                 "micro_batch": [None, *(("gradient_accumulation", {"steps": k}) for k in MICRO_STEPS)],
                 "parallel": parallel})
    space = SearchSpace(dims, world_size=world, model_config=cfg, device_type="cuda",
                        global_batch_size=MICRO_GLOBAL_BATCH, merge_idle=False)
    assert len(space.candidates()) == size, (len(space.candidates()), list(space.rejected.items())[:2])
    return space


class Landscape:
    def __init__(self, space: SearchSpace, family: Family, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.family, self.seed = family, seed
        cands = space.candidates()
        labels = space.labels()
        names = list(labels)
        sizes = [len(v) for v in labels.values()]
        main = [rng.normal(0, family.sigma_main, size=k) for k in sizes]
        inter = {}
        for d, e in itertools.combinations(range(len(sizes)), 2):
            if rng.random() < family.pair_p:
                inter[d, e] = rng.normal(0, family.sigma_int, size=(sizes[d], sizes[e]))
        mem_factor = []
        for d, name in enumerate(names):
            if name in _SAVES or name == "parallel":
                steps = np.exp(-rng.uniform(0.05, 0.5, size=sizes[d] - 1))
                mem_factor.append(np.concatenate([[1.0], np.cumprod(steps)]))   # each option saves more
            else:
                mem_factor.append(rng.uniform(0.92, 1.08, size=sizes[d]))
        self.strategies = [c.strategy for c in cands]
        self.log_tp: Dict[Strategy, float] = {}
        self.mem: Dict[Strategy, float] = {}
        for c in cands:
            v = sum(main[d][i] for d, i in enumerate(c.choices))
            v += sum(m[c.choices[d], c.choices[e]] for (d, e), m in inter.items())
            self.log_tp[c.strategy] = float(v) + math.log(100.0)
            self.mem[c.strategy] = 40e9 * float(np.prod([mem_factor[d][i] for d, i in enumerate(c.choices)]))
        frac = rng.uniform(0.0, 0.45)
        # The other shapes draw from their own stream, so the original families' draws are unchanged.
        shape_rng = np.random.default_rng([seed, 15485863])
        if family.shape == "microbatch":
            frac = self._microbatch(space, cands, main, inter, mem_factor, shape_rng)
        elif family.shape == "flat":
            self._flatten(shape_rng)
        mems = sorted(self.mem.values())
        self.limit = int(mems[min(len(mems) - 1, int(math.floor((1 - frac) * len(mems))))] * 1.0000001) \
            if frac * len(mems) >= 1 else int(max(mems) * 1.01)
        self.raising = self.strategies[int(rng.integers(len(self.strategies)))]
        self.failing = {self.raising}
        if family.failing:
            for _ in range(family.failing_causes):
                self.failing |= self._failing_option(cands, sizes, shape_rng)
        if family.shape == "needle":
            self._needle(shape_rng)
        ok = self.runnable()
        self.best = max(math.exp(self.log_tp[s]) for s in ok)
        self.oom_fraction = 1 - sum(self.mem[s] <= self.limit and s != self.raising for s in self.strategies) / len(cands)
        self.leanest = min(self.mem[s] for s in ok)
        self.noise_rng = np.random.default_rng(seed + 7919)
        # Predictors, from their own random numbers.
        prng = np.random.default_rng(seed + 104729)
        bias = [prng.normal(0, 0.15, size=k) for k in sizes]
        mem_bias = math.exp(prng.normal(0, 0.2))
        self.predicted: Dict[str, Dict[Strategy, Estimate]] = {"noisy": {}, "anti": {}}
        for c in cands:
            s = c.strategy
            mem = int(self.mem[s] * mem_bias * math.exp(prng.normal(0, 0.1)))
            noisy = self.log_tp[s] + sum(bias[d][i] for d, i in enumerate(c.choices)) + prng.normal(0, 0.1)
            anti = -self.log_tp[s] + prng.normal(0, 0.1)
            self.predicted["noisy"][s] = Estimate(mem, BATCH / math.exp(noisy))
            self.predicted["anti"][s] = Estimate(mem, BATCH / math.exp(anti))

    def runnable(self) -> List[Strategy]:
        """The candidates that neither run out of memory nor raise (the best is one of them)."""
        return [s for s in self.strategies if self.mem[s] <= self.limit and s not in self.failing]

    def reset_noise(self, method: str) -> None:
        """Each method gets its own stream of measurement noise (so results do not depend on run order)."""
        tag = sum(ord(ch) * 31 ** k for k, ch in enumerate(method)) % 2**32
        self.noise_rng = np.random.default_rng([self.seed, tag])

    # -- the other shapes (RESULTS.md, "Search on other landscape families") ----------------------

    def _microbatch(self, space: SearchSpace, cands: list, main: list, inter: dict, mem_factor: list,
                    rng: np.random.Generator) -> float:
        """Throughput rising then saturating with the micro-batch (m / (m + h): small micro-batches
        leave the device idle), memory = static state (x the ZeRO and checkpoint-free savings, / the
        tensor degree) + activations of one micro-batch (proportional to its rows, x a checkpoint
        factor, / the tensor degree): monotone in every saving choice, the large micro-batches
        running out of memory. Returns the fraction of candidates to run out of memory."""
        names = list(space.labels())
        mb, par, ck, zero = (names.index(n) for n in ("micro_batch", "parallel", "checkpoint", "zero"))
        world = space.world_size
        tensor = [1] + [int(dict(c[0][1][0])["tensor"]) for c in space.dimensions["parallel"][1:]]
        steps = (1, *MICRO_STEPS)
        half = rng.uniform(0.5, 4.0)                   # rows per micro-batch at half the peak rate
        static, act = 30e9, rng.uniform(1.0, 3.0) * 1e9          # bytes; activation bytes per row
        ckpt = rng.uniform(0.15, 0.4)
        # With accumulated gradients: a whole unsharded copy of U(0.2, 0.8) of the static state, once
        # accumulating (drawn for this family only: the microbatch family's landscapes are unchanged).
        grads = static * rng.uniform(0.2, 0.8) if self.family.accumulated_grads else 0.0
        for c in cands:
            ch = c.choices
            v = sum(main[d][i] for d, i in enumerate(ch) if d != mb)
            v += sum(m[ch[d], ch[e]] for (d, e), m in inter.items() if mb not in (d, e))
            t = tensor[ch[par]]
            rows = MICRO_GLOBAL_BATCH * t / world / steps[ch[mb]]
            self.log_tp[c.strategy] = float(v + math.log(rows / (rows + half))) + math.log(100.0)
            self.mem[c.strategy] = (static * mem_factor[zero][ch[zero]] + act * rows * (ckpt if ch[ck] else 1.0)
                                    + (grads if ch[mb] else 0.0)) / t
        return float(rng.uniform(0.15, 0.5))

    def _flatten(self, rng: np.random.Generator) -> None:
        """Every candidate within U(1, 3)% of the best (the shape of the original draw kept), and
        memory spanning exactly 2x (monotone in the saving choices as before)."""
        spread = rng.uniform(0.01, 0.03)
        tp, mem = np.array(list(self.log_tp.values())), np.log(list(self.mem.values()))
        for s in self.strategies:
            self.log_tp[s] = math.log(100.0) + spread * (self.log_tp[s] - tp.max()) / np.ptp(tp)
            self.mem[s] = 40e9 * math.exp(math.log(2.0) * (math.log(self.mem[s]) - mem.max()) / np.ptp(mem))

    def _failing_option(self, cands: list, sizes: List[int], rng: np.random.Generator) -> set:
        """Every candidate with one option (or one pair of options) raises, e.g. compile on a model
        it cannot trace: a set of 10-25% of the candidates sharing a cause."""
        options = [((d, i),) for d, k in enumerate(sizes) for i in range(k) if k > 1]
        options += [(a, b) for a, b in itertools.combinations([o[0] for o in options], 2) if a[0] != b[0]]
        share = [sum(all(c.choices[d] == i for d, i in o) for c in cands) / len(cands) for o in options]
        causes = [o for o, f in zip(options, share) if 0.10 <= f <= 0.25]
        cause = causes[int(rng.integers(len(causes)))]
        self.failing_cause = cause
        return {c.strategy for c in cands if all(c.choices[d] == i for d, i in cause)}

    def _needle(self, rng: np.random.Generator) -> None:
        """One candidate (that fits and runs) U(10, 25)% faster than every other; its neighbours
        gain nothing."""
        ok = self.runnable()
        needle = ok[int(rng.integers(len(ok)))]
        self.log_tp[needle] = max(self.log_tp[s] for s in ok if s != needle) + rng.uniform(0.1, 0.25)

    def _dry_runner_steps(self, step: float) -> DryRunResult:
        """Steps timed as the dry runner times them (`dry_runner.time_steps`: until the 95% half-width
        is <= 3% of the mean after at least its default pilot, at most 40), each a load spike x U(2, 3)
        with probability `spikes`, summarized by the dry runner's own statistic (`step_timing.summarize`)."""
        from atorch.auto.step_timing import PILOT_SAMPLES, is_precise_enough, summarize

        sigma = self.family.noise * math.sqrt(STEPS)
        times: List[float] = []
        while len(times) < 40 and not is_precise_enough(times, 0.03, PILOT_SAMPLES):
            t = step * math.exp(self.noise_rng.normal(0, sigma))
            if self.noise_rng.random() < self.family.spikes:
                t *= self.noise_rng.uniform(2.0, 3.0)
            times.append(float(t))
        summary = summarize(times)
        return DryRunResult(summary.throughput(BATCH), None, None, summary.mean_s, tuple(times),
                            summary.throughput_interval(BATCH))

    def evaluate(self, strategy: Strategy) -> DryRunResult:
        if strategy == self.raising:
            raise RuntimeError("synthetic failure of this candidate's dry run")
        if strategy in self.failing:
            raise RuntimeError("synthetic failure of an option on this model (e.g. compile cannot trace it)")
        mem = self.mem[strategy]
        if mem > self.limit:
            return DryRunResult(0.0, int(mem), "oom: synthetic out of memory")
        step = BATCH / math.exp(self.log_tp[strategy])
        if self.family.spikes > 0:
            r = self._dry_runner_steps(step)
            r.peak_memory_bytes = int(mem * math.exp(self.noise_rng.normal(0, 0.01)))
            return r
        sigma = self.family.noise * math.sqrt(STEPS)
        steps = tuple(float(step * math.exp(self.noise_rng.normal(0, sigma))) for _ in range(STEPS))
        mean = float(np.mean(steps))
        return DryRunResult(BATCH / mean, int(mem * math.exp(self.noise_rng.normal(0, 0.01))), step_time_s=mean,
                            step_times_s=steps)

    def ratio(self, strategy: Optional[Strategy]) -> float:
        return 0.0 if strategy is None else math.exp(self.log_tp[strategy]) / self.best


def landscape_seed(space_size: int, family: str, index: int, offset: int = 0) -> int:
    """The seed of landscape `index` of `family` (offset 0: the seeds the search was developed on)."""
    return 1000 * space_size + 100 * list(FAMILIES).index(family) + index + offset


def run_ours(space: SearchSpace, land: Landscape, predictor: str, budget: int, seed: int,
             planner_factory: Optional[Callable] = None) -> Tuple[float, dict]:
    """Our search on `land` (its own noise stream per predictor setting; `planner_factory`
    replaces the surrogate, for benchmarks/search_ceiling.py): the declared winner's ratio to the
    best, and what the search did."""
    calls: List[DryRunResult] = []
    tried: List[Strategy] = []

    def evaluator(s: Strategy) -> DryRunResult:
        tried.append(s)
        try:
            r = land.evaluate(s)
        except RuntimeError:
            calls.append(DryRunResult(0.0, None, "exception"))
            raise
        calls.append(r)
        return r

    land.reset_noise(f"ours-{predictor}")
    pred = None if predictor == "none" else (lambda s, table=land.predicted[predictor]: table[s])
    # The device's memory is known to every real search (auto_search passes it), predictor or not.
    result = search_strategy(space, evaluator, max_trials=budget, patience=budget, seed=seed, predictor=pred,
                             memory_limit_bytes=land.limit, planner_factory=planner_factory)
    failed = [s for s, r in zip(tried, calls) if r.status == "exception"]
    cmp = result.comparison
    covered = None
    if cmp is not None and cmp.lo is not None:
        truth = math.exp(land.log_tp[cmp.winner] - land.log_tp[cmp.runner_up])
        covered = bool(cmp.lo <= truth <= cast(float, cmp.hi))
    best = result.best
    info = {"runs": len(calls), "oom": sum(r.status == "oom" for r in calls),
            "planner": result.planner_seconds, "separated": bool(cmp and cmp.separated),
            "failed": len(failed), "failed_twice": len(failed) - len(set(failed)),
            "bad_winner": best is not None and (best in land.failing or land.mem[best] > land.limit),
            "ci_covered": covered, "lean": land.mem[best] / land.leanest if best is not None else math.nan}
    return land.ratio(result.best), info


def run_random(land: Landscape, budget: int, rng: np.random.Generator, lean: Optional[List[float]] = None
               ) -> List[float]:
    """Ratios of `RANDOM_ORDERS` random searches; `lean` (if given) receives each winner's memory
    over the leanest candidate's that runs."""
    out = []
    land.reset_noise("random")
    for _ in range(RANDOM_ORDERS):
        order = [land.strategies[i] for i in rng.permutation(len(land.strategies))[:budget]]
        best, best_tp = None, -1.0
        for s in order:
            try:
                r = land.evaluate(s)
            except RuntimeError:
                continue
            if r.ok and r.throughput > best_tp:
                best, best_tp = s, r.throughput
        out.append(land.ratio(best))
        if lean is not None and best is not None:
            lean.append(land.mem[best] / land.leanest)
    return out


def run_hebo_default(space: SearchSpace, land: Landscape, budget: int, seed: int) -> Tuple[float, List[float]]:
    import pandas as pd

    from atorch.auto.search.bo import _preserve_torch_threads, _seeded, import_hebo

    import_hebo()
    from hebo.design_space.design_space import DesignSpace
    from hebo.optimizers.hebo import HEBO

    land.reset_noise("hebo-default")
    labels = space.labels()
    by_label = {tuple(labels[d][i] for d, i in zip(labels, c.choices)): c.strategy for c in space.candidates()}
    ds = DesignSpace().parse([{"name": d, "type": "cat", "categories": v} for d, v in labels.items()])
    opt = HEBO(ds, scramble_seed=seed)
    best, best_tp, seconds, ok_logs = None, -1.0, [], []
    with _preserve_torch_threads(), _seeded(seed):
        for _ in range(budget):
            start = time.perf_counter()
            rec = opt.suggest(n_suggestions=1)
            seconds.append(time.perf_counter() - start)
            s = by_label[tuple(rec.iloc[0][d] for d in labels)]
            try:
                r = land.evaluate(s)
            except RuntimeError:
                r = DryRunResult(0.0, None, "exception")
            if r.ok:
                ok_logs.append(math.log(r.throughput))
                if r.throughput > best_tp:
                    best, best_tp = s, r.throughput
                y = -math.log(r.throughput)
            else:
                y = -((min(ok_logs) if ok_logs else math.log(land.best) - 3) - math.log(2.0))
            opt.observe(pd.DataFrame(rec), np.array([[y]]))
    return land.ratio(best), seconds


def planner_seconds_512(repeats: int = 10) -> List[float]:
    """Seconds per suggestion of our planner on a 512-candidate space (2x4x2x2x4x2x2 options, a
    predictor feature) after 25 observed trials: the largest case the 2 s target covers."""
    from atorch.auto.search.bo import CandidatePlanner, Observation

    sizes = (2, 4, 2, 2, 4, 2, 2)
    labels = [[f"o{k}" for k in range(n)] for n in sizes]
    choices = list(itertools.product(*[range(n) for n in sizes]))
    rng = np.random.default_rng(0)
    planner = CandidatePlanner(labels, choices, prior=list(rng.normal(size=len(choices))), seed=0)
    out = []
    for r in range(repeats):
        seen = rng.choice(len(choices), size=25, replace=False)
        observed = [Observation(int(i), float(rng.normal()), 0.0004) for i in seen]
        remaining = [i for i in range(len(choices)) if i not in set(int(j) for j in seen)]
        out.append(planner.suggest(observed, remaining).seconds)
    return out


def _flag(value: Optional[bool]) -> str:
    return "-" if value is None else str(int(value))


def summarize(ratios: List[float]) -> str:
    r = np.asarray(ratios)
    return f"{np.mean(r >= TARGET) * 100:5.1f}% | {r.mean():.3f} | {r.min():.3f}"


def summarize_log(path: str) -> None:
    """The table rows of our search from a run's per-landscape lines (for a run stopped before
    its end: the rows are otherwise printed at the end)."""
    import re

    rows: Dict[Tuple[str, str], List[Tuple[float, Optional[int]]]] = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"(\S+) #\d+ \(\d+ s\): oom [\d.]+ (.*) random\(mean\)", line)
            if not m:
                continue
            for item in m.group(2).split():
                name, value = item.split("=")
                ratio, _, oom = value.partition("/oom")
                rows.setdefault((m.group(1), name), []).append((float(ratio), int(oom) if oom else None))
    for (family, predictor), values in rows.items():
        ooms = [o for _, o in values if o is not None]
        print(f"| {family} | ours, predictor {predictor} | {len(values)} | {summarize([r for r, _ in values])} | "
              f"{np.mean(ooms):.2f} |" if ooms else f"| {family} | ours, predictor {predictor} | {len(values)} | "
              f"{summarize([r for r, _ in values])} | |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--space", type=int, choices=(64, 256), default=64)
    parser.add_argument("--landscapes", type=int, default=12, help="per family")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--predictors", nargs="*", default=list(PREDICTORS))
    parser.add_argument("--hebo-default", type=int, default=0, help="landscapes per family for HEBO's own suggest()")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--planner-time", action="store_true", help="only time the planner on 512 candidates")
    parser.add_argument("--budget", type=int, help="dry runs per search, re-measurements included "
                        "(default: 14 at 64 candidates, 20 at 256)")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="added to every landscape seed: 0 = the seeds the search was developed on, "
                             "another value = held-out landscapes")
    parser.add_argument("--noise", type=float,
                        help="every family's dry runs off by this much instead of its own noise (the same "
                             "landscapes: e.g. 0.015, the standard error a 3%% 95%% half-width leaves)")
    parser.add_argument("--failing-causes", type=int, default=1,
                        help="failing families: that many independent causes of failures (the last one's "
                             "`failing_cause` is kept for traces)")
    parser.add_argument("--summarize-log", help="print the table rows from a (stopped) run's output and exit")
    args = parser.parse_args()
    if args.summarize_log:
        summarize_log(args.summarize_log)
        return
    if args.planner_time:
        secs = planner_seconds_512()
        print(f"planner on 512 candidates, 25 observations: seconds per suggestion median {np.median(secs):.3f}, "
              f"max {max(secs):.3f} ({len(secs)} suggestions)")
        return
    budget = args.budget or BUDGET[args.space]
    rows, diagnostics = [], []
    spaces: Dict[bool, SearchSpace] = {}
    planner: List[float] = []
    started = time.time()
    for fam_name in args.families:
        family = FAMILIES[fam_name]
        if args.noise is not None:
            family = dataclasses.replace(family, noise=args.noise)
        if args.failing_causes != 1:
            family = dataclasses.replace(family, failing_causes=args.failing_causes)
        ours: Dict[str, List[float]] = {p: [] for p in args.predictors}
        infos: Dict[str, List[dict]] = {p: [] for p in args.predictors}
        rand: List[float] = []
        rand_lean: List[float] = []
        hebo: List[float] = []
        ooms, rhos, fail_share = [], [], []
        for k in range(args.landscapes):
            seed = landscape_seed(args.space, fam_name, k, args.seed_offset)
            micro = family.shape == "microbatch"
            if micro not in spaces:
                spaces[micro] = make_space(args.space, micro_batch=micro)
            space = spaces[micro]
            land = Landscape(space, family, seed)
            ooms.append(land.oom_fraction)
            fail_share.append(len(land.failing) / len(land.strategies))
            from scipy.stats import spearmanr

            truth = [land.log_tp[s] for s in land.strategies]
            rhos.append(spearmanr(truth, [-math.log(land.predicted["noisy"][s].step_time_s)
                                          for s in land.strategies])[0])
            rand.extend(run_random(land, budget, np.random.default_rng(seed), rand_lean))
            if not args.skip_ours:
                for p in args.predictors:
                    ratio, info = run_ours(space, land, p, budget, seed)
                    ours[p].append(ratio)
                    infos[p].append(info)
                    planner.extend(info["planner"])
            if k < args.hebo_default:
                ratio, secs = run_hebo_default(space, land, budget, seed)
                hebo.append(ratio)
                print(f"  hebo default on {fam_name} #{k}: ratio {ratio:.3f}, suggest s median "
                      f"{np.median(secs):.1f}, max {max(secs):.1f}", flush=True)
            print(f"{fam_name} #{k} ({time.time() - started:.0f} s): oom {land.oom_fraction:.2f} " +
                  " ".join(f"{p}={ours[p][-1]:.3f}/oom{infos[p][-1]['oom']}" for p in args.predictors if ours[p]) +
                  f" random(mean)={np.mean(rand[-RANDOM_ORDERS:]):.3f} | " +
                  " ".join(f"{p}:failed{infos[p][-1]['failed']},twice{infos[p][-1]['failed_twice']},"
                           f"bad{int(infos[p][-1]['bad_winner'])},ci{_flag(infos[p][-1]['ci_covered'])},"
                           f"lean{infos[p][-1]['lean']:.2f}" for p in args.predictors if ours[p]), flush=True)
        for p in args.predictors:
            if ours[p]:
                info = infos[p]
                rows.append(f"| {args.space} | {fam_name} | ours, predictor {p} | {len(ours[p])} | "
                            f"{summarize(ours[p])} | {np.mean([i['runs'] for i in info]):.1f} | "
                            f"{np.mean([i['oom'] for i in info]):.2f} |")
                covered = [i["ci_covered"] for i in info if i["ci_covered"] is not None]
                diagnostics.append(
                    f"| {args.space} | {fam_name} | ours, predictor {p} | "
                    f"{np.mean([i['failed'] for i in info]):.2f} | {sum(i['failed_twice'] for i in info)} | "
                    f"{sum(i['bad_winner'] for i in info)} | {np.mean([i['separated'] for i in info]) * 100:.0f}% | "
                    f"{len(covered) - sum(covered)} of {len(covered)} | {np.mean([i['lean'] for i in info]):.2f} |")
        diagnostics.append(f"| {args.space} | {fam_name} | random search | {budget * np.mean(fail_share):.2f}"
                           f" (expected) | | | | | {np.mean(rand_lean):.2f} |")
        rows.append(f"| {args.space} | {fam_name} | random search ({RANDOM_ORDERS} orders each) | {args.landscapes} | "
                    f"{summarize(rand)} | {budget} | |")
        if hebo:
            rows.append(f"| {args.space} | {fam_name} | HEBO default suggest, no predictor | {len(hebo)} | "
                        f"{summarize(hebo)} | {budget} | |")
        print(f"{fam_name}: OOM share of candidates {min(ooms):.2f}-{max(ooms):.2f}; Spearman(noisy predictor, "
              f"truth) {np.mean(rhos):.2f} mean", flush=True)
    print(f"\nspace {args.space}, seed offset {args.seed_offset}, budget {budget} dry runs (re-measurements included), "
          f"target >= {TARGET} of the best" + (f", every dry run off by {args.noise}" if args.noise is not None else "")
          + "\n")
    print("| space | family | method | landscapes | P(>= 0.98) | mean ratio | worst | dry runs | OOM runs |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nfailed runs: dry runs that raised, mean per search; twice: a failed candidate run again; bad winner: "
          "a declared winner that raises or runs out of memory; separated: the winner declared faster than the "
          "runner-up (interval excludes 1); CI misses: the winner/runner-up interval not holding the true ratio; "
          "lean: the winner's memory over the leanest candidate's that runs\n")
    print("| space | family | method | failed runs | twice | bad winner | separated | CI misses | lean |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(diagnostics))
    if planner:
        p = np.asarray(planner)
        print(f"\nplanner seconds per suggestion over {len(p)} suggestions: median {np.median(p):.3f}, "
              f"p90 {np.percentile(p, 90):.3f}, max {p.max():.3f}")
    print(f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
