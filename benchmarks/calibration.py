"""Kendall's tau between predicted and measured throughput on a real landscape, before and after calibration.

The landscape is the table of `benchmarks/real_landscape.py` (every candidate of a
32-candidate space dry-run 3 times on 2 CPU ranks; the tiny-but-not-trivial Llama). Compared:

- cost model: `cost_model.estimate` with its built-in CPU constants;
- probed: the same with this machine's rates at the model's own shapes
  (`calibration.calibrate_model`: one decoder block's forward + backward per tokens-per-rank,
  tensor split and dtype, giving FLOP/s and a per-layer overhead; gloo all-reduce at the sizes
  the candidates move), measured in a 2-rank spawn and cached as JSON (`probe`, below); also
  reported on all candidates: the block's matmuls alone ("gemm") and one large square matmul
  (`calibrate_device`, the session-3 probe);
- + refit after k trials: `LearningPredictor` that observed k candidates (one of their
  recorded measurements each, at random: the real noise), scored on the candidates it has not
  seen, over random trial orders: component weights only (the session-3 refit), per-option
  corrections only, and both (the default). The rows without refit are scored on the same
  held-out sets.

The measured throughput of a candidate is the median of its recorded measurements.

    flock /tmp/atorch-bench.lock nice -n 0 python benchmarks/calibration.py probe [--table ...] [--cache ...]
    nice -n 19 python benchmarks/calibration.py analyze [--table benchmarks/real_landscape.json] [--orders 200]

`analyze` reads the probe's cache (`--cache`, default benchmarks/calibration_probe.json) and
refuses to measure under load: run `probe` first (a cache that misses a point is completed by
the next `probe`).

`measure` records a smaller landscape of its own in the same format (9 candidates that cover
the dimensions the search space gained: gradient accumulation, pipeline; every candidate
built with `auto_accelerate` and timed with `train_step`, 2 warm-up and 6 timed steps, the median step; rounds in a fresh random order each, interleaved):

    nice -n 5 python benchmarks/calibration.py measure [--rounds 3] [--out benchmarks/step_time_landscape.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from typing import Any, Dict, List

import numpy as np

from atorch.auto.calibration import (
    LearningPredictor,
    calibrate_device,
    calibrate_model,
    cost_model_predictor,
    kendall_tau,
    strategy_workload,
)
from atorch.auto.strategy import Strategy

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_description(text: str) -> Strategy:
    """`Strategy.describe()` of default-config items back into a Strategy (e.g. "parallel_mode(tensor=2,data=1)+fsdp")."""
    items: List[Any] = []
    for part in text.split("+"):
        m = re.fullmatch(r"parallel_mode\((.*)\)", part)
        if m:
            dims = [(k, int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(","))]
            items.append(("parallel_mode", (dims, None)))
        elif re.fullmatch(r"[a-z_0-9]+", part):
            items.append(part)
        elif re.fullmatch(r"amp_native\((\w+)\)", part):     # describe() names amp's dtype
            items.append(("amp_native", {"dtype": part[len("amp_native("):-1]}))
        else:
            raise ValueError(f"cannot parse strategy item {part!r} of {text!r} (only default configs are supported)")
    return Strategy(items)


def _probe_rank(cache: str, config: Any, workloads: List[Any], sizes: List[int], seq_len: int,
                refresh: bool = False) -> Dict[str, Any]:
    import torch

    from atorch.auto.cost_model import ModelShape

    shape = ModelShape.from_config(config)
    cpu = torch.device("cpu")
    return {"block": calibrate_model(shape, workloads, sizes, cpu, seq_len=seq_len, cache_path=cache, refresh=refresh),
            "gemm": calibrate_model(shape, workloads, sizes, cpu, method="gemm", cache_path=cache, refresh=refresh),
            "square": calibrate_device(cpu, cache_path=cache, refresh=refresh).as_profile()}


def probe_constants(cache: str, config: Any, strategies: List[Strategy], batch: int, seq: int,
                    world: int, refresh: bool = False) -> Dict[str, Any]:
    """The probed rates for these candidates: read from `cache`, measured (2 ranks) where it misses."""
    from atorch.auto.cost_model import ModelShape
    from atorch.testing import run_distributed

    shape = ModelShape.from_config(config)
    workloads, sizes = set(), set()
    for s in strategies:
        tokens, tensor, moved, _ = strategy_workload(shape, s, batch, seq, world)
        workloads.add((tokens, tensor))
        sizes.update(moved)
    return run_distributed(_probe_rank, 2, cache, config, sorted(workloads), sorted(sizes), seq, refresh,
                           timeout=600)[0]


def noise_ceiling(table: Dict[str, Any]) -> float:
    """Mean Kendall tau between the throughputs of two measurement rounds: what re-measuring agrees with itself."""
    rounds: Dict[int, Dict[str, float]] = {}
    for m in table["measurements"]:
        if m["status"] == "ok" and m["throughput"] > 0:
            rounds.setdefault(m["round"], {})[m["strategy"]] = float(m["throughput"])
    taus = []
    keys = sorted(rounds)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            common = sorted(set(rounds[a]) & set(rounds[b]))
            if len(common) >= 3:
                taus.append(kendall_tau([rounds[a][n] for n in common], [rounds[b][n] for n in common]))
    return float(np.mean(taus)) if taus else float("nan")


MODEL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
             num_key_value_heads=4)
VOCAB, GLOBAL_BATCH, SEQ_LEN, WARMUP, TIMED = 1024, 8, 64, 2, 6
DATA2 = ("parallel_mode", ([("data", 2)], None))
TENSOR2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]
CANDIDATES: List[List[Any]] = [
    [DATA2], [DATA2, "amp_native"], [DATA2, "checkpoint"], [DATA2, "fsdp"], [DATA2, ("gradient_accumulation", 2)],
    [DATA2, ("gradient_accumulation", 4)], TENSOR2, [*TENSOR2, "amp_native"],
    [("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), "pipeline_parallel"],
]


def _measure_rank(rounds: int, path: str) -> List[Dict[str, Any]]:
    import time

    import torch
    import torch.distributed as dist

    from atorch.auto import auto_accelerate, train_step
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    out = []
    for round_ in range(rounds):
        for i in np.random.default_rng(round_).permutation(len(CANDIDATES)):
            strategy = Strategy(CANDIDATES[int(i)])
            status, result, chosen = auto_accelerate(
                tiny_llama(seed=0, vocab_size=VOCAB, **MODEL), optim_func=torch.optim.AdamW,
                dataset=TokenDataset(n=256, seq_len=SEQ_LEN, vocab_size=VOCAB), optim_args={"lr": 1e-3},
                model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
            assert status, strategy.describe()
            batches = iter(result.dataloader)
            times = []
            for step in range(WARMUP + TIMED):
                batch = next(batches)
                dist.barrier()
                start = time.perf_counter()
                train_step(result, batch)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= WARMUP:
                    times.append(float(elapsed))
            engine = result.args.get("engine")
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()
            del result, engine
            dist.barrier()
            median = statistics.median(times)
            ga = chosen.get("gradient_accumulation")
            label = chosen.describe().replace("gradient_accumulation", f"gradient_accumulation(steps={ga.config})"
                                              if ga is not None else "gradient_accumulation")
            out.append({"round": round_, "strategy": label, "strategy_json": json.loads(chosen.to_json()),
                        "status": "ok", "throughput": GLOBAL_BATCH / median, "step_times_s": times,
                        "load_average": os.getloadavg()[0]})
            if dist.get_rank() == 0:   # written after every measurement: a killed run keeps what it measured
                _write(path, rounds, out)
                print(f"round {round_}: {label}: {GLOBAL_BATCH / median:.1f} samples/s", flush=True)
    return out


def _write(path: str, rounds: int, measurements: List[Dict[str, Any]]) -> None:
    import platform

    import torch

    table = {"model": MODEL, "vocab_size": VOCAB, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "world_size": 2,
             "candidates": len(CANDIDATES), "repeats": rounds, "warmup_steps": WARMUP, "timed_steps": TIMED,
             "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "torch": torch.__version__,
             "measurements": measurements}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)


def measure(rounds: int, path: str) -> None:
    from atorch.testing import run_distributed

    measurements = run_distributed(_measure_rank, 2, rounds, path, timeout=3600)[0]
    print(f"wrote {path}: {len(measurements)} measurements")


def load_landscape(path: str) -> Dict[str, Any]:
    """The table's candidates: their strategies, recorded throughputs and the model config."""
    from atorch.testing import tiny_llama_config

    with open(path) as f:
        table = json.load(f)
    runs: Dict[str, List[float]] = {}
    for m in table["measurements"]:
        if m["status"] == "ok" and m["throughput"] > 0:
            runs.setdefault(m["strategy"], []).append(float(m["throughput"]))
    names = sorted(runs)
    encoded = {m["strategy"]: m.get("strategy_json") for m in table["measurements"]}
    strategies = {n: Strategy.from_json(json.dumps(encoded[n])) if encoded.get(n) else parse_description(n)
                  for n in names}
    return {"table": table, "config": tiny_llama_config(**table["model"], vocab_size=table["vocab_size"]),
            "runs": runs, "names": names, "strategies": strategies,
            "batch": table["global_batch"], "seq": table["seq_len"], "world": table["world_size"]}


def analyze(args: argparse.Namespace) -> None:
    land = load_landscape(args.table)
    table, config, runs, names, strategies = (land[k] for k in ("table", "config", "runs", "names", "strategies"))
    batch, seq, world = land["batch"], land["seq"], land["world"]
    measured = {n: statistics.median(runs[n]) for n in names}
    spread = [max(v) / min(v) for v in runs.values() if len(v) > 1]
    if not os.path.exists(args.cache):
        raise SystemExit(f"no probe cache at {args.cache}: run `flock /tmp/atorch-bench.lock nice -n 0 python "
                         f"benchmarks/calibration.py probe --table {args.table} --cache {args.cache}` first")
    probed_all = probe_constants(args.cache, config, list(strategies.values()), batch, seq, world)

    base = cost_model_predictor(config, batch, seq, world, "cpu")
    probed = cost_model_predictor(config, batch, seq, world, "cpu", profile=probed_all["block"])
    gemm = cost_model_predictor(config, batch, seq, world, "cpu", profile=probed_all["gemm"])
    square = cost_model_predictor(config, batch, seq, world, "cpu", profile=probed_all["square"])

    def tau(predict: Any, subset: List[str]) -> float:
        return kendall_tau([batch / predict(strategies[n]).step_time_s for n in subset], [measured[n] for n in subset])

    block = probed_all["block"]
    print(f"table: {args.table}: {len(names)} candidates, {sum(len(v) for v in runs.values())} measurements, "
          f"max/min spread of a candidate's measurements: median {statistics.median(spread):.2f}, "
          f"max {max(spread):.2f}; noise ceiling (one round vs another): tau {noise_ceiling(table):.3f}")
    print(f"probed (block, per tokens:tensor): " + ", ".join(
        f"{k} {v:.3g} FLOP/s + {block.layer_overhead_s.get(k, 0) * 1e3:.2f} ms/layer" for k, v in block.flops.items()))
    print(f"all-reduce fitted over the moved sizes: {block.comm_bytes_per_s or 0:.3g} B/s, "
          f"{(block.comm_latency_s or 0) * 1e6:.0f} us; GEMMs alone: "
          + ", ".join(f"{k} {v:.3g}" for k, v in probed_all["gemm"].flops.items())
          + f"; one square matmul: {json.dumps({k: float(f'{v:.3g}') for k, v in probed_all['square'].items()})}")
    print()
    print(f"| all {len(names)} candidates | Kendall tau |")
    print("|---|---|")
    for label, p in (("cost model (built-in CPU constants)", base), ("probed: one square matmul (session 3)", square),
                     ("probed: the block's GEMMs at the model's shapes", gemm),
                     ("probed: the model's block, rate + per-layer overhead", probed)):
        print(f"| {label} | {tau(p, names):.3f} |")
    print()
    variants = {
        "cost model": None,
        "cost model + component refit (session 3)": (base, dict(option_ridge=None)),
        "cost model + per-option refit": (base, dict(fit_components=False)),
        "cost model + both refits (default)": (base, {}),
        "probed (block)": None,
        "probed (block) + both refits": (probed, {}),
    }
    trials = [int(t) for t in args.trials.split(",") if int(t) < len(names) - 2]
    results: Dict[str, Dict[int, List[float]]] = {v: {} for v in variants}
    rng = np.random.default_rng(0)
    for k in trials:
        for v in variants:
            results[v][k] = []
        for _ in range(args.orders):
            order = list(rng.permutation(names))
            seen, held_out = order[:k], order[k:]
            learners = {v: LearningPredictor(spec[0], **spec[1]) for v, spec in variants.items() if spec is not None}
            for n in seen:
                step = batch / float(rng.choice(runs[n]))   # one recorded measurement: the real noise
                for learner in learners.values():
                    learner.observe(strategies[n], step)
            results["cost model"][k].append(tau(base, held_out))
            results["probed (block)"][k].append(tau(probed, held_out))
            for v, learner in learners.items():
                results[v][k].append(tau(learner, held_out))
    print(f"Held-out candidates only; mean Kendall tau over {args.orders} random trial orders (10th-90th pct):")
    print()
    print("| predictor | " + " | ".join(f"k={k} ({len(names) - k} held out)" for k in trials) + " |")
    print("|---|" + "---|" * len(trials))
    for v in variants:
        cells = []
        for k in trials:
            lo, hi = np.percentile(results[v][k], [10, 90])
            cells.append(f"{np.mean(results[v][k]):.3f} ({lo:.2f}-{hi:.2f})")
        print(f"| {v} | " + " | ".join(cells) + " |")
    print()
    print("Paired gain over the cost model on the same held-out sets (mean, 10th-90th pct, share of orders > 0):")
    for v in variants:
        if v == "cost model":
            continue
        cells = []
        for k in trials:
            d = np.array(results[v][k]) - np.array(results["cost model"][k])
            lo, hi = np.percentile(d, [10, 90])
            cells.append(f"k={k}: {d.mean():+.3f} ({lo:+.2f}..{hi:+.2f}, {np.mean(d > 0):.0%})")
        print(f"- {v}: " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("analyze", "measure", "probe"))
    parser.add_argument("--table", default=os.path.join(HERE, "real_landscape.json"))
    parser.add_argument("--out", default=os.path.join(HERE, "step_time_landscape.json"))
    parser.add_argument("--cache", default=os.path.join(HERE, "calibration_probe.json"))
    parser.add_argument("--refresh", action="store_true", help="probe: measure again what the cache holds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--orders", type=int, default=200)
    parser.add_argument("--trials", default="0,4,8,12,16")
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.rounds, args.out)
    elif args.command == "probe":
        land = load_landscape(args.table)
        probed = probe_constants(args.cache, land["config"], list(land["strategies"].values()), land["batch"],
                                 land["seq"], land["world"], args.refresh)
        print(f"{args.cache}: {probed['block'].device_kind}")
        for k in ("block", "gemm"):
            print(k, {key: f"{v:.3g}" for key, v in probed[k].flops.items()}, probed[k].layer_overhead_s,
                  probed[k].comm_bytes_per_s, probed[k].comm_latency_s)
        print("square", probed["square"])
    else:
        analyze(args)


if __name__ == "__main__":
    main()
