"""Latency of one `generate` call: deployed with `atorch.deploy` (TP=2 workers) vs the model in-process (TP=1).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deploy.py --model tiny [--repeats 7] [--new-tokens 16]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deploy.py --model 100m

Greedy, batch 1, a 32-token prompt, `--new-tokens` new tokens (min = max, so every call does
the same work). The two are timed interleaved (in-process, deployed, in-process, ...) after
one warm-up call each; the deployed tokens are checked equal to the in-process ones. Each
worker gets `OMP_NUM_THREADS` threads like the caller, so TP=2 uses twice the cores: on a
2-core machine shared with other jobs, it measures the proxy's overhead more than a speed-up.
Also reported: the deployment's start time (worker start, weight transfer, sharding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import atorch
from atorch.testing import tiny_llama


def build(name: str) -> torch.nn.Module:
    if name == "tiny":
        return tiny_llama(seed=0).eval()
    # ~100M: 12 layers, hidden 768, intermediate 2048, 16k vocabulary (as in benchmarks/fusion.py)
    return tiny_llama(seed=0, num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=16000, max_position_embeddings=1024).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    model = build(args.model)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(4, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=False, pad_token_id=3)
    start = time.perf_counter()
    deployed = atorch.deploy(model, tensor_parallel_size=args.tp)
    started = time.perf_counter() - start
    with deployed, torch.no_grad():
        expected, got = model.generate(ids, **kwargs), deployed.generate(ids, **kwargs)  # warm-up
        assert torch.equal(expected, got)
        local, remote = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model.generate(ids, **kwargs)
            local.append(time.perf_counter() - t)
            t = time.perf_counter()
            deployed.generate(ids, **kwargs)
            remote.append(time.perf_counter() - t)
    ratios = [r / l for r, l in zip(remote, local)]
    print(f"model {args.model} ({params / 1e6:.1f}M parameters), {args.new_tokens} new tokens, batch 1, prompt 32, "
          f"{torch.get_num_threads()} thread(s) per process, {args.repeats} interleaved repeats, deploy start "
          f"{started:.1f} s")
    print(f"| {args.model} | {statistics.median(local) * 1e3:.0f} [{min(local) * 1e3:.0f}, {max(local) * 1e3:.0f}] | "
          f"{statistics.median(remote) * 1e3:.0f} [{min(remote) * 1e3:.0f}, {max(remote) * 1e3:.0f}] | "
          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] | {started:.0f} s |")


if __name__ == "__main__":
    main()
