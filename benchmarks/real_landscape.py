"""A measured landscape (issue 12, evidence 2): every candidate of a 32-candidate space dry-run 3 times
on 2 CPU ranks, then the strategy search replayed on the recorded measurements.

    # measure (slow: 96 dry runs; resumable, writes after every dry run)
    nice -n 5 python benchmarks/real_landscape.py measure [--out benchmarks/real_landscape.json]
    # replay the search on the table (1-2 min; re-run it after changing the search)
    python benchmarks/real_landscape.py replay [--table benchmarks/real_landscape.json] [--replays 10]
    # the RESULTS.md table (7 min on the loaded machine)
    python benchmarks/real_landscape.py replay --replays 20 --max-trials 8 12

Model: Llama, hidden 256, 4 layers, 4 heads, intermediate 688, vocabulary 1024 (the bundled
tokenizer's), 3.7M parameters; global batch 8 x 64 tokens; AdamW. Space: amp x {-, zero1,
zero2, fsdp} x checkpoint x {data 2, tensor 2}: the default space without module_replace.
Each round dry-runs all 32 candidates in a fresh random order (interleaved, so a change of the
machine's load spreads over candidates instead of biasing one), with the dry runner's
measurement (timed until the 95% CI half-width is <= 3%) on a smaller budget (30 steps / 15 s).

The replay calls `atorch.auto.search.search.search_strategy` with an evaluator that serves, for
each dry run the search asks for, one of the candidate's 3 recorded measurements at random (a
replay's noise is the real noise). The true best is the candidate with the highest mean of its
3 measurements; the declared winner is "within the measured noise" of it when the two
candidates' ranges of measurements overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TABLE = os.path.join(HERE, "real_landscape.json")
MODEL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
             num_key_value_heads=4)
GLOBAL_BATCH, SEQ_LEN, REPEATS = 8, 64, 3
# The default budget (40 steps / 60 s) would make the 96 dry runs take ~80 min on this busy machine.
MEASUREMENT = dict(max_profile_steps=30, max_profile_seconds=15.0)
DIMENSIONS = ("amp", "zero", "checkpoint", "parallel")


def build_space(model: Any) -> Any:
    from atorch.auto.search.space import SearchSpace

    space = SearchSpace.default_for(model, 2, "cpu")
    dims = {d: space.dimensions[d] for d in DIMENSIONS}
    # The measured space: torch's ZeRO backend only, data or tensor parallel (the default space
    # has since gained the DeepSpeed backend and pipeline stages, which the table never measured).
    dims["zero"] = [z for z in dims["zero"] if z is None or isinstance(z, str)]
    dims["parallel"] = [p for p in dims["parallel"] if "pipeline" not in repr(p)]
    # merge_idle=False: the table measured torch ZeRO over tensor=2 (one data rank) too; the automatic
    # space now keeps only the candidate without it (ZeRO-1 measured alike, 50.7 vs 51.0 samples/s;
    # zero2 and fsdp without amp slower, 46.1 and 45.8).
    return SearchSpace(dims, world_size=2, model=model, device_type="cpu", merge_idle=False)


def table_key(label: str) -> str:
    """A strategy's label as the table wrote it (before resolve named DDP and amp its dtype)."""
    return label.replace("+ddp", "").replace("amp_native(bfloat16)", "amp_native")


def landscape_model() -> torch.nn.Module:
    from atorch.testing import tiny_llama

    return tiny_llama(seed=0, **MODEL)


# -- measuring -----------------------------------------------------------------------------------

def _measure_rank(path: str) -> None:
    from atorch import distributed as adist
    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=landscape_model(), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=256, seq_len=SEQ_LEN), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": GLOBAL_BATCH})
    candidates = build_space(ctx.model).candidates()
    table = _load(path) if os.path.exists(path) else _new_table(len(candidates))
    done = {(m["round"], m["strategy"]) for m in table["measurements"]}
    config = DryRunConfig(**MEASUREMENT)
    for round_ in range(REPEATS):
        order = np.random.default_rng(round_).permutation(len(candidates))
        for i in order:
            label = candidates[int(i)].label()
            if (round_, label) in done:
                continue
            start = time.monotonic()
            r = dry_run(ctx, candidates[int(i)].strategy, config)
            if adist.rank() == 0:
                table["measurements"].append({
                    "round": round_, "strategy": label, "status": r.status, "error": r.error,
                    "throughput": r.throughput, "throughput_ci": list(r.throughput_ci) if r.throughput_ci else None,
                    "step_times_s": list(r.step_times_s), "peak_memory_bytes": r.peak_memory_bytes,
                    "seconds": time.monotonic() - start, "load_average": os.getloadavg()[0]})
                _save(table, path)
                print(f"round {round_} {label}: {r.status} {r.throughput:.4g}/s CI {r.throughput_ci} "
                      f"({len(r.step_times_s)} samples, {time.monotonic() - start:.1f} s)", flush=True)


def _new_table(n: int) -> Dict[str, Any]:
    return {"model": MODEL, "vocab_size": 1024, "measurement": MEASUREMENT, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "world_size": 2,
            "candidates": n, "repeats": REPEATS, "machine": f"{platform.node()} {os.cpu_count()} CPUs",
            "torch": torch.__version__, "measurements": []}


def _load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _save(table: Dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)


def measure(path: str) -> None:
    from atorch.testing import run_distributed

    run_distributed(_measure_rank, 2, path, timeout=4 * 3600)


# -- replaying -----------------------------------------------------------------------------------

def per_candidate(table: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for m in table["measurements"]:
        out.setdefault(m["strategy"], []).append(m)
    return out


def replay(path: str, replays: int, max_trials_options: List[int],
           predictor_kinds: Sequence[str] = ("none", "cost model", "cost model + refit")) -> Dict[str, Any]:
    from atorch.auto.cost_model import ModelShape, estimate
    from atorch.auto.search.search import DryRunResult, search_strategy

    table = _load(path)
    with torch.device("meta"):
        model = landscape_model()
    space = build_space(model)
    measured = per_candidate(table)
    measured = {**measured, **{c.label(): measured[table_key(c.label())] for c in space.candidates()
                               if table_key(c.label()) in measured}}
    missing = [c.label() for c in space.candidates() if c.label() not in measured]
    if missing:
        raise SystemExit(f"{path} has no measurement of {len(missing)} candidates, e.g. {missing[0]}")
    means = {c.label(): statistics.mean(m["throughput"] for m in measured[c.label()]) for c in space.candidates()}
    true_best = max(means, key=means.get)
    best_low = min(m["throughput"] for m in measured[true_best])
    shape = ModelShape.from_module(model)

    def predictor(strategy: Any) -> Any:
        return estimate(shape, strategy, table["global_batch"], table["seq_len"], table["world_size"], "cpu")

    def make_predictor(kind: str) -> Any:
        """None, the cost model, or the cost model refitted on every dry run of the search
        (`LearningPredictor`: the search tells it each measured step time)."""
        if kind == "none":
            return None
        if kind == "cost model":
            return predictor
        from atorch.auto.calibration import LearningPredictor, cost_model_predictor

        return LearningPredictor(cost_model_predictor(shape, table["global_batch"], table["seq_len"],
                                                      table["world_size"], "cpu"))

    rows = []
    for max_trials in max_trials_options:
        for kind in predictor_kinds:
            outcomes = []
            for seed in range(replays):
                rng = np.random.default_rng(1000 + seed)

                def evaluate(strategy: Any) -> DryRunResult:
                    m = measured[strategy.describe()][int(rng.integers(REPEATS))]
                    ci = tuple(m["throughput_ci"]) if m["throughput_ci"] else None
                    return DryRunResult(m["throughput"], m["peak_memory_bytes"], m["error"],
                                        1.0 / m["throughput"] * table["global_batch"] if m["throughput"] else None,
                                        tuple(m["step_times_s"]), ci)

                result = search_strategy(space, evaluate, max_trials=max_trials, seed=seed,
                                         predictor=make_predictor(kind), batch_size=table["global_batch"])
                winner = result.best.describe() if result.best is not None else None
                within = winner is not None and max(m["throughput"] for m in measured[winner]) >= best_low
                outcomes.append({"ratio": means[winner] / means[true_best] if winner else 0.0,
                                 "dry_runs": len(result.trials), "within_noise": within, "winner": winner})
            ratios = [o["ratio"] for o in outcomes]
            rows.append({"max_trials": max_trials, "predictor": kind,
                         "replays": replays, "mean_ratio": statistics.mean(ratios), "worst_ratio": min(ratios),
                         "p_ge_0.98": sum(r >= 0.98 for r in ratios) / replays,
                         "mean_dry_runs": statistics.mean(o["dry_runs"] for o in outcomes),
                         "p_within_noise": sum(o["within_noise"] for o in outcomes) / replays,
                         "true_best_found": sum(o["winner"] == true_best for o in outcomes) / replays})
    return {"true_best": true_best, "true_best_mean": means[true_best], "rows": rows, "means": means,
            "spread": {k: max(m["throughput"] for m in v) / max(1e-9, min(m["throughput"] for m in v))
                       for k, v in measured.items()}}


def print_landscape(path: str) -> None:
    table = _load(path)
    rows = []
    for label, ms in per_candidate(table).items():
        tp = [m["throughput"] for m in ms]
        rel = [(m["throughput_ci"][1] - m["throughput_ci"][0]) / 2 / m["throughput"] if m["throughput_ci"] else math.nan
               for m in ms]
        rows.append((statistics.mean(tp), label, tp, rel, [len(m["step_times_s"]) for m in ms],
                     max(m["peak_memory_bytes"] or 0 for m in ms)))
    rows.sort(reverse=True)
    print("| strategy | mean samples/s | 3 measurements | max/min | CI half-width (rel) | samples | peak MB |")
    print("|---|---|---|---|---|---|---|")
    for mean, label, tp, rel, n, peak in rows:
        print(f"| {label} | {mean:.0f} | {', '.join(f'{t:.0f}' for t in tp)} | {max(tp) / min(tp):.2f} | "
              f"{', '.join(f'{r:.1%}' for r in rel)} | {', '.join(map(str, n))} | {peak / 1e6:.1f} |")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["measure", "replay", "table"])
    parser.add_argument("--out", "--table", dest="path", default=DEFAULT_TABLE)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--max-trials", type=int, nargs="+", default=[12])
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.path)
    elif args.command == "table":
        print_landscape(args.path)
    else:
        import logging

        logging.disable(logging.WARNING)
        out = replay(args.path, args.replays, args.max_trials)
        print(f"true best: {out['true_best']} ({out['true_best_mean']:.0f} samples/s, mean of {REPEATS})")
        print("| max_trials | predictor | replays | mean ratio | worst | P(>=0.98) | mean dry runs | "
              "P(winner within noise) | P(true best) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in out["rows"]:
            print(f"| {r['max_trials']} | {r['predictor']} | {r['replays']} | {r['mean_ratio']:.3f} | "
                  f"{r['worst_ratio']:.3f} | {r['p_ge_0.98']:.0%} | {r['mean_dry_runs']:.1f} | "
                  f"{r['p_within_noise']:.0%} | {r['true_best_found']:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
