"""Dry-run one candidate of every combination class of the default search space, in one process per rank.

    python scripts/sweep_space.py [--model llama|gpt2|FAMILY] [--world 2] [--batch_size 16] [--limit N]
        [--match SUBSTRING] [--out FILE]

FAMILY: any tiny architecture of `atorch.testing.tp_families` (qwen2, gpt_neox, falcon, bloom, opt,
mixtral, gemma2, phi3, ..., and the MORE_PLAN_FAMILIES: gemma3_text, olmo2, cohere, ...), built from
its config as the tensor-parallel tests build it.

A combination class is the set of optimizations a candidate combines, with the DeepSpeed
variants of zero1/zero2/fsdp counted apart (e.g. `pm(data)+gradient_accumulation+checkpoint+
fsdp[ds]`); the gradient-accumulation steps vary across the classes' representatives. The
candidates run one after another through the dry runner on `--world` gloo ranks (spawned here),
exactly as a search runs them, so a failure is either a composition bug or state a previous
candidate left behind. Each result is one JSON line in `--out` (rank 0); the exit status is 1
when any candidate failed. Run it under `nice`: it takes a few minutes for the 192 classes of
the tiny models on 2 ranks.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from typing import Any, Dict, List

import torch

from atorch.testing import run_distributed, tiny_gpt2, tiny_llama
from atorch.testing.tp_families import FAMILIES, MORE_PLAN_FAMILIES, build_family, more_family_config

MODELS = ("llama", "gpt2") + tuple(f for f in FAMILIES if f not in ("llama", "gpt2")) + tuple(MORE_PLAN_FAMILIES)


def _model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        return tiny_llama(seed=0)
    if kind == "gpt2":
        return tiny_gpt2(seed=0)
    if kind in FAMILIES:
        return build_family(kind, seed=0)[0]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(more_family_config(kind))


def _vocab(kind: str) -> int:
    """Token ids the dataset may draw: within every family's vocabulary (Bloom's is 1001)."""
    return min(int(_model(kind).config.vocab_size), 1000)


def combination_class(strategy: Any) -> str:
    """`pm(<split dims>)+<optimization>[ds]+...` in application order."""
    parts = []
    for item in strategy:
        config = item.config
        if item.name == "parallel_mode":
            dims = dict(config[0]) if isinstance(config, (tuple, list)) and config else {}
            parts.append("pm(" + ",".join(k for k, v in dims.items() if int(v) > 1) + ")")
        elif getattr(config, "use_ds_zero", False) or (isinstance(config, dict) and config.get("use_ds_zero")):
            parts.append(item.name + "[ds]")
        else:
            parts.append(item.name)
    return "+".join(parts)


def representatives(kind: str, world: int, batch_size: int) -> Dict[str, str]:
    """{class: strategy JSON}, one candidate per class (the i-th class takes its i-th member, cyclically)."""
    from atorch.auto.search.space import SearchSpace

    space = SearchSpace.default_for(_model(kind), world, "cpu", global_batch_size=batch_size)
    classes: Dict[str, List[Any]] = collections.defaultdict(list)
    for candidate in space.candidates():
        classes[combination_class(candidate.strategy)].append(candidate.strategy)
    print(f"{kind}: {len(space.candidates())} candidates in {len(classes)} combination classes; "
          f"{len(space.rejected)} combinations excluded up front", flush=True)
    return {name: members[i % len(members)].to_json() for i, (name, members) in enumerate(sorted(classes.items()))}


def _run(kind: str, batch_size: int, chosen: Dict[str, str], out_path: str) -> None:
    import torch.distributed as dist

    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=_model(kind), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=4 * batch_size, seq_len=64, vocab_size=_vocab(kind)),
                       model_input_format="unpack_dict",
                       dataloader_args={"batch_size": batch_size})
    config = DryRunConfig(warmup_steps=1, profile_steps=1, max_profile_steps=1, timeout_s=150)
    for name, text in chosen.items():
        strategy = Strategy.from_json(text)
        start = time.monotonic()
        result = dry_run(ctx, strategy, config)
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps({"class": name, "strategy": strategy.describe(), "ok": result.ok,
                                    "error": result.error, "seconds": round(time.monotonic() - start, 1)}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16, help="global batch size (the demo's)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N classes")
    parser.add_argument("--match", default=None, help="only the classes whose name contains this, e.g. pipeline")
    parser.add_argument("--out", default="sweep_space.jsonl")
    args = parser.parse_args()
    chosen = representatives(args.model, args.world, args.batch_size)
    if args.match is not None:
        chosen = {name: text for name, text in chosen.items() if args.match in name}
    if args.limit is not None:
        chosen = dict(list(chosen.items())[:args.limit])
    open(args.out, "w").close()
    run_distributed(_run, args.world, args.model, args.batch_size, chosen, args.out, timeout=150 * len(chosen) + 120)
    with open(args.out) as f:
        rows = [json.loads(line) for line in f]
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} classes dry-run, {len(rows) - len(failed)} ran, {len(failed)} failed", flush=True)
    for r in failed:
        print(f"  FAILED {r['class']}: {r['strategy']}: {r['error']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
