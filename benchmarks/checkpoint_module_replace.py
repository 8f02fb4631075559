"""Step time and saved activation memory of `checkpoint` and `module_replace` on a small Llama (CPU).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/checkpoint_module_replace.py [--steps 5] [--seq 128]

One process, one model config, four strategies applied through the optimizations themselves:
plain, module_replace, checkpoint, module_replace + checkpoint. For each: median wall and CPU
time of a training step (forward, backward, AdamW) after two warm-up steps, and the bytes of
distinct storages autograd saves for backward during one forward (what activation
checkpointing trades for recomputation). Prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from typing import Dict, List

import torch

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import get_optimization
from atorch.testing import tiny_llama

STRATEGIES: Dict[str, List[str]] = {
    "plain": [],
    "module_replace": ["module_replace"],
    "checkpoint": ["checkpoint"],
    "module_replace + checkpoint": ["module_replace", "checkpoint"],
}


def build(names: List[str], base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    ctx = ModelContext(model=model)
    for name in names:  # already in Order: module_replace (30) before checkpoint (50)
        opt = get_optimization(name)()
        opt.apply(ctx, opt.parse_config(None))
    return ctx.model


def saved_bytes(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> int:
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def step_times(model: torch.nn.Module, batch: Dict[str, torch.Tensor], steps: int) -> tuple:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    walls, cpus = [], []
    for i in range(steps + 2):
        w0, c0 = time.perf_counter(), time.process_time()
        model(**batch).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps (allocator, lazy inits)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    base = tiny_llama(seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_attention_heads=max(4, args.hidden // 64),
                      num_key_value_heads=max(4, args.hidden // 64), max_position_embeddings=max(256, args.seq))
    base.train()
    tokens = torch.randint(4, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens}

    print(f"Llama hidden={args.hidden} layers={args.layers} batch={args.batch} seq={args.seq}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print()
    print("| strategy | step wall (median) | step CPU (median) | saved activations |")
    print("| --- | --- | --- | --- |")
    for label, names in STRATEGIES.items():
        model = build(names, base)
        mem = saved_bytes(model, batch)
        wall, cpu = step_times(model, batch, args.steps)
        print(f"| {label} | {wall * 1e3:.0f} ms | {cpu * 1e3:.0f} ms | {mem / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
