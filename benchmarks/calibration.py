"""Kendall's tau between predicted and measured throughput on a real landscape, before and after calibration.

The landscape is the table of `benchmarks/real_landscape.py` (every candidate of a
32-candidate space dry-run 3 times on 2 CPU ranks; the tiny-but-not-trivial Llama). Compared:

- cost model: `cost_model.estimate` with its built-in CPU constants;
- probed: the same with this machine's constants from `calibration.calibrate_device` (matmul
  FLOP/s, gloo all-reduce over 2 ranks), measured here in a 2-rank spawn;
- refit after n trials: `LearningPredictor(probed)` that observed n candidates (one of
  their recorded measurements each, at random: the real noise), scored on the candidates it
  has not seen, averaged over random trial orders. The rows before calibration are scored on
  the same held-out sets.

The measured throughput of a candidate is the median of its recorded measurements.

    python benchmarks/calibration.py analyze [--table benchmarks/real_landscape.json] [--orders 200]

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
import tempfile
from typing import Any, Dict, List

import numpy as np

from atorch.auto.calibration import LearningPredictor, calibrate_device, cost_model_predictor, kendall_tau
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


def _probe_rank(cache: str) -> Dict[str, float]:
    import torch

    return calibrate_device(torch.device("cpu"), cache_path=cache).as_profile()


def probe_constants() -> Dict[str, float]:
    from atorch.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_probe_rank, 2, os.path.join(tmp, "calibration.json"), timeout=300)[0]


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("analyze", "measure"))
    parser.add_argument("--table", default=os.path.join(HERE, "real_landscape.json"))
    parser.add_argument("--out", default=os.path.join(HERE, "step_time_landscape.json"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--orders", type=int, default=200)
    parser.add_argument("--trials", default="4,8,12,16,20")
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.rounds, args.out)
        return
    with open(args.table) as f:
        table = json.load(f)
    from atorch.testing import tiny_llama_config

    config = tiny_llama_config(**table["model"], vocab_size=table["vocab_size"])
    batch, seq, world = table["global_batch"], table["seq_len"], table["world_size"]
    runs: Dict[str, List[float]] = {}
    for m in table["measurements"]:
        if m["status"] == "ok" and m["throughput"] > 0:
            runs.setdefault(m["strategy"], []).append(float(m["throughput"]))
    names = sorted(runs)
    encoded = {m["strategy"]: m.get("strategy_json") for m in table["measurements"]}
    strategies = {n: Strategy.from_json(json.dumps(encoded[n])) if encoded.get(n) else parse_description(n)
                  for n in names}
    measured = {n: statistics.median(runs[n]) for n in names}
    spread = [max(v) / min(v) for v in runs.values() if len(v) > 1]

    base = cost_model_predictor(config, batch, seq, world, "cpu")
    profile = probe_constants()
    probed = cost_model_predictor(config, batch, seq, world, "cpu", profile=profile)

    def tau(predict, subset):
        return kendall_tau([batch / predict(strategies[n]).step_time_s for n in subset], [measured[n] for n in subset])

    print(f"table: {args.table}: {len(names)} candidates, {sum(len(v) for v in runs.values())} measurements, "
          f"max/min spread of a candidate's measurements: median {statistics.median(spread):.2f}, "
          f"max {max(spread):.2f}")
    print(f"probed constants: {json.dumps({k: float(f'{v:.3g}') for k, v in profile.items()})}")
    print("| predictor | candidates scored | Kendall tau (mean over orders) | spread (10th-90th pct) |")
    print("|---|---|---|---|")
    print(f"| cost model (built-in CPU constants) | all {len(names)} | {tau(base, names):.3f} | - |")
    print(f"| one measured round vs another (the noise ceiling) | common candidates | {noise_ceiling(table):.3f} | - |")
    print(f"| probed constants | all {len(names)} | {tau(probed, names):.3f} | - |")
    rng = np.random.default_rng(0)
    for n_trials in (int(t) for t in args.trials.split(",") if int(t) < len(names) - 2):
        rows: Dict[str, List[float]] = {"cost model": [], "probed": [], "refit": [], "refit (base)": []}
        for _ in range(args.orders):
            order = list(rng.permutation(names))
            seen, held_out = order[:n_trials], order[n_trials:]
            learner = LearningPredictor(probed)
            learner_base = LearningPredictor(base)
            for n in seen:
                step = batch / float(rng.choice(runs[n]))   # one recorded measurement: the real noise
                learner.observe(strategies[n], step)
                learner_base.observe(strategies[n], step)
            rows["cost model"].append(tau(base, held_out))
            rows["probed"].append(tau(probed, held_out))
            rows["refit"].append(tau(learner, held_out))
            rows["refit (base)"].append(tau(learner_base, held_out))
        for label, values in rows.items():
            name = {"cost model": "cost model", "probed": "probed constants",
                    "refit": f"probed + refit on {n_trials} trials",
                    "refit (base)": f"cost model + refit on {n_trials} trials"}[label]
            lo, hi = np.percentile(values, [10, 90])
            print(f"| {name} | {len(names) - n_trials} held out | {np.mean(values):.3f} | {lo:.2f}-{hi:.2f} |")


if __name__ == "__main__":
    main()
