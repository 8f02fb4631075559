"""Time `SearchSpace.default_for(...).candidates()`: the automatic space's enumeration and validation.

Every combination goes through `resolve_strategy` (the rules `auto_accelerate` applies);
model-walking validations are memoized per space (`ValidationCache`). Prints one row per
setting: combinations, valid candidates, seconds (first call, then the median of `--repeats`
fresh spaces), and the cache's hit rate.

    python benchmarks/space_enumeration.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from atorch.auto.search import SearchSpace
from atorch.auto.search import space as space_module
from atorch.testing import tiny_llama


def llama_7b_on_meta() -> torch.nn.Module:
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def measure(name: str, model: torch.nn.Module, world: int, batch: int, repeats: int, cached: bool = True) -> None:
    original = space_module.ValidationCache
    if not cached:
        space_module.ValidationCache = lambda: None  # type: ignore[assignment]
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            space = SearchSpace.default_for(model, world_size=world, device_type="cuda", global_batch_size=batch)
            candidates = space.candidates()
            times.append(time.perf_counter() - start)
    finally:
        space_module.ValidationCache = original
    print(f"| {name} | {world} | {batch} | {'yes' if cached else 'no'} | {space.size} | {len(candidates)} | "
          f"{times[0]:.2f} | {statistics.median(times[1:]):.2f} ({min(times[1:]):.2f}-{max(times[1:]):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| model | world | global batch | validation cache | combinations | candidates | first s | median s "
          "(range) |")
    print("|---|---|---|---|---|---|---|---|")
    tiny = tiny_llama()
    big = llama_7b_on_meta()
    for cached in (False, True):   # interleaved per setting
        measure("tiny Llama (2 layers)", tiny, 8, 64, args.repeats, cached)
    for cached in (False, True):
        measure("Llama 7B (meta)", big, 64, 512, args.repeats, cached)


if __name__ == "__main__":
    main()
