"""Cost of returning full logits from a tensor-parallel model (the default) vs the vocabulary slice.

    .venv/bin/python benchmarks/tp_logits.py [--repeats 5] [--steps 8] [--vocab 32000] [--seq 256]

On 2 gloo ranks (TP=2), a Llama with a large vocabulary trains with its own loss (labels in the
batch) under `gather_logits=True` (the loss is computed from the slices, then the returned
logits are all-gathered) and `gather_logits=False` (the slice is returned). The two modes are
interleaved step by step on the same model (the gather is a forward hook toggled between
steps), so machine noise hits both alike. Reports the median step time of each mode over
`repeats` x `steps` steps (after warm-up), the spread (min-max of the per-repeat medians),
and the bytes the gather moves and holds per step: each rank receives (T-1)/T of B x S x V
fp32 logits and holds the full B x S x V tensor while the output is alive.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist


def _measure(args: argparse.Namespace) -> Dict[str, Any]:
    from transformers import LlamaForCausalLM

    from atorch.distributed import create_parallel_group, parallel_group
    from atorch.tensor_parallel import MultiDimParallelRandomizer, shard_model, tpinfo_for_model
    from atorch.tensor_parallel.logits import gather_output_logits
    from atorch.testing import tiny_llama_config

    create_parallel_group(([("tensor", 2)], None))
    group = parallel_group("tensor")
    torch.manual_seed(0)
    config = tiny_llama_config(num_hidden_layers=args.layers, hidden_size=args.hidden,
                               intermediate_size=args.hidden * 2, num_attention_heads=8, num_key_value_heads=8,
                               vocab_size=args.vocab)
    model = LlamaForCausalLM(config)
    model = shard_model(model, tpinfo_for_model(model), group, gather_logits=False,
                        randomizer=MultiDimParallelRandomizer(0, {"tensor": dist.get_rank(group)}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times: Dict[str, List[List[float]]] = {"full": [], "slice": []}
    shapes = {}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        per_mode: Dict[str, List[float]] = {"full": [], "slice": []}
        for _ in range(args.steps):
            for mode in ("full", "slice"):
                handle = model.register_forward_hook(gather_output_logits) if mode == "full" else None
                dist.barrier()
                start = time.perf_counter()
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                per_mode[mode].append(time.perf_counter() - start)
                shapes[mode] = tuple(out.logits.shape)
                del out
                if handle is not None:
                    handle.remove()
        if repeat:
            for mode in per_mode:
                times[mode].append(per_mode[mode])
    return {"times": times, "shapes": shapes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()

    from atorch.testing import run_distributed

    result = run_distributed(_measure, 2, args, timeout=1800)[0]
    full_bytes = args.batch * args.seq * args.vocab * 4
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch {args.batch} x seq {args.seq}, "
          f"TP=2 gloo, {platform.processor() or platform.machine()}, torch {torch.__version__}; rank 0; "
          f"{args.repeats} repeats x {args.steps} interleaved steps\n")
    print("| returned logits | shape | step s (median) | spread of repeat medians | gathered bytes in / held |")
    print("|---|---|---|---|---|")
    for mode in ("slice", "full"):
        medians = [statistics.median(r) for r in result["times"][mode]]
        flat = [t for r in result["times"][mode] for t in r]
        moved = f"{full_bytes / 2 / 2**20:.1f} MiB / {full_bytes / 2**20:.1f} MiB" if mode == "full" else "0 / 0"
        print(f"| {mode} | {result['shapes'][mode]} | {statistics.median(flat):.4f} | "
              f"{min(medians):.4f}-{max(medians):.4f} | {moved} |")


if __name__ == "__main__":
    main()
