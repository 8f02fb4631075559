"""Per-rank memory and step time of tensor parallelism on a small Llama (CPU, gloo).

    .venv/bin/python benchmarks/tp_memory.py [--steps 6] [--layers 4] [--hidden 512] [--vocab 32000]

For T in (1, 2), each in fresh processes (T ranks, a tensor group of T):
- parameter bytes per rank, total and of the transformer blocks;
- peak resident memory added by building the model from its meta recording, exact mode
  (the whole model on the CPU, then sliced) and per-block mode (one block at full size);
- median wall time of a training step (forward, backward, AdamW) after two warm-up steps.
Prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from typing import Any, Dict

import torch
import torch.distributed as dist


def _config(args: argparse.Namespace):
    from atorch.testing import tiny_llama_config

    return tiny_llama_config(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                             num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(args: argparse.Namespace, tp: int, per_block: bool) -> Dict[str, Any]:
    from transformers import LlamaForCausalLM

    from atorch.distributed import create_parallel_group
    from atorch.utils.manual_tp_utils import materialize_tp_module, tp_manual_shard_custom_fn, tp_param_bytes
    from atorch.utils.meta_model_utils import record_module_init
    from atorch.utils.tp_presets import tpinfo_for_model

    create_parallel_group(([("tensor", tp)], None))
    with record_module_init():
        meta = LlamaForCausalLM(_config(args))
    tp_manual_shard_custom_fn(meta, tpinfo_for_model(meta))
    before = _rss_mib()
    model = materialize_tp_module(meta, base_seed=0, per_block=per_block)
    out = {"build_peak_mib": _rss_mib() - before, "param_mib": tp_param_bytes(model) / 2**20,
           "block_mib": tp_param_bytes(model.model.layers) / 2**20}
    if not per_block:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        out["step_s"] = statistics.median(times[2:])
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    from atorch.testing import run_distributed

    rows = []
    for tp in (1, 2):
        exact = run_distributed(_measure, tp, args, tp, False, timeout=900)[0]
        block = run_distributed(_measure, tp, args, tp, True, timeout=900)[0]
        rows.append((tp, exact, block))
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch {args.batch} x seq {args.seq}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, gloo, rank 0 shown\n")
    print("| T | params/rank MiB | blocks/rank MiB | build peak MiB, exact | build peak MiB, per-block | step s |")
    print("|---|---|---|---|---|---|")
    for tp, exact, block in rows:
        print(f"| {tp} | {exact['param_mib']:.1f} | {exact['block_mib']:.1f} | {exact['build_peak_mib']:.0f} | "
              f"{block['build_peak_mib']:.0f} | {exact['step_s']:.3f} |")


if __name__ == "__main__":
    main()
