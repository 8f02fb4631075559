"""Where the cost model contradicts the memory order the search assumes (`space.memory_saving_ranks`).

The search takes memory as monotone in each optimization's declared saving (`Optimization.memory_saving`):
an out-of-memory run rules out every candidate that saves no more. This script predicts every candidate of
the automatic space (`SearchSpace.default_for`) with the cost model for a model on the meta device and lists
the pairs where a candidate that should need at least another's memory is predicted below it, grouped by
the choices that differ (worst ratio, pairs). Figures in benchmarks/RESULTS.md ("Declared savings the cost
model reverses").

    python benchmarks/declared_savings.py            # ~1 min a model here
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from atorch.auto.cost_model import estimate
from atorch.auto.search import SearchSpace
from atorch.auto.search.feasibility import Feasibility
from atorch.auto.search.space import memory_saving_ranks


def llama_on_meta(hidden: int, layers: int, heads: int, intermediate: int) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=32000)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def contradictions(name: str, model: torch.nn.Module, world: int, batch: int, seq: int) -> None:
    space = SearchSpace.default_for(model, world_size=world, device_type="cuda", global_batch_size=batch)
    cands = space.candidates()
    peaks = [estimate(model, c.strategy, batch, seq, world, "cuda").peak_memory_bytes for c in cands]
    order = Feasibility([c.choices for c in cands], memory_saving_ranks(space), None)
    names, labels = list(space.dimensions), space.labels()
    groups: Dict[Tuple[str, ...], List[Tuple[float, str]]] = collections.defaultdict(list)
    for i, more in enumerate(cands):          # `more` is declared to need at least `less`'s memory
        for j, less in enumerate(cands):
            if i != j and order.needs_at_least(i, j) and peaks[i] < peaks[j] / 1.001:
                diff = tuple(f"{names[d]}: {labels[names[d]][more.choices[d]]} -> {labels[names[d]][less.choices[d]]}"
                             for d in range(len(names)) if more.choices[d] != less.choices[d])
                same = [labels[names[d]][c] for d, c in enumerate(more.choices) if c == less.choices[d]]
                shared = ", ".join(label for label in same if label != "none")
                groups[diff].append((peaks[j] / peaks[i], shared))
    total = sum(len(v) for v in groups.values())
    print(f"\n{name}, {world} ranks, global batch {batch} x {seq}: {len(cands)} candidates, {total} pairs predicted "
          "against the declared order")
    print("| choices that differ (declared to need more -> less) | pairs | worst predicted ratio | worst pair's other "
          "choices |")
    print("|---|---|---|---|")
    for diff, pairs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        ratio, shared = max(pairs)
        print(f"| {'; '.join(diff)} | {len(pairs)} | {ratio:.2f} | {shared} |")


def main() -> None:
    contradictions("Llama 1B (meta)", llama_on_meta(2048, 16, 16, 5504), 8, 64, 1024)
    contradictions("Llama 7B (meta)", llama_on_meta(4096, 32, 32, 11008), 16, 128, 2048)


if __name__ == "__main__":
    main()
