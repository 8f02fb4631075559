"""Forward and training-step time of each fusion kind on a ~100M-parameter model (CPU).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fusion.py --model llama [--repeats 5] [--batch 2] [--seq 256]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fusion.py --model gpt2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fusion.py --kernels   # eager vs torch.compile vs TorchScript

`--kernels`: the three elementwise tails alone (forward + backward on a (8, 256, 2048) fp32
activation), eager vs `torch.compile(dynamic=True)` vs `torch.jit.script`, 12 interleaved
repeats: the measurement behind `atorch.modules.fused.mlp` using torch.compile.

Variants: unfused, each kind alone (`attention`, `norm`, `activation`, `mlp`, where the model has
it) and all kinds together (`fuse(model)`). They are timed *interleaved* on one model: the fused
modules share their parameters with the unfused ones, so each variant is switched in by setting
a few child modules (and the attention implementation) and one set of weights, gradients and
AdamW state serves all, which keeps memory at one model and every variant on the same weights.
Each repeat times every variant once, in a rotating order; reported are the medians and, per
variant, the median and [min, max] of the per-repeat ratios unfused / fused (> 1: fused faster).
Warm-up: 2 calls per variant (the first compiles the fused MLP kernels).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Dict, List, Tuple

import torch
from torch import nn

from atorch.auto.opt_lib.module_replace import fuse
from atorch.testing.models import tiny_gpt2_config, tiny_llama_config

Swap = Tuple[nn.Module, str, nn.Module]


def build(model_name: str) -> nn.Module:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if model_name == "llama":  # 12 x 6.3M + 2 x 16000 x 768 = 100M
        config = tiny_llama_config(num_hidden_layers=12, hidden_size=768, intermediate_size=2048,
                                   num_attention_heads=12, num_key_value_heads=12, vocab_size=16000,
                                   max_position_embeddings=1024)
        return LlamaForCausalLM(config)
    # GPT-2 small shape with a 16k vocabulary (tied): 12 x 7.1M + 16000 x 768 = 98M
    config = tiny_gpt2_config(n_layer=12, n_embd=768, n_head=12, n_inner=3072, vocab_size=16000, n_positions=1024)
    return GPT2LMHeadModel(config)


def _children(model: nn.Module) -> Dict[Tuple[int, str], Tuple[nn.Module, nn.Module]]:
    return {(id(p), n): (p, c) for p in model.modules() for n, c in p._modules.items()}


def variant_swaps(model: nn.Module, kinds: List[str]) -> List[Swap]:
    """The (parent, name, fused child) settings that turn `model` into its `kinds`-fused variant; model left unfused."""
    before = _children(model)
    fuse(model, kinds)
    after = _children(model)
    swaps = [(parent, name, child) for (pid, name), (parent, child) in after.items()
             if (pid, name) in before and before[(pid, name)][1] is not child]
    for parent, name, _ in swaps:
        setattr(parent, name, before[(id(parent), name)][1])
    return swaps


def activate(model: nn.Module, swaps: List[Swap], originals: Dict, attention: str) -> None:
    for (pid, name), (parent, child) in originals.items():
        if parent._modules.get(name) is not child:
            setattr(parent, name, child)
    for parent, name, child in swaps:
        setattr(parent, name, child)
    model.set_attn_implementation(attention)


def kernels(repeats: int = 12) -> None:
    import torch.nn.functional as F

    def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + b, approximate="tanh")

    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    def bias_dropout(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.dropout(x + b, 0.1, True)

    print("| tail | eager ms | torch.compile ms | TorchScript ms | eager/compile | eager/script |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fn in (("bias + gelu_tanh", bias_gelu), ("silu(gate) * up", silu_mul), ("bias + dropout", bias_dropout)):
        fns = {"eager": fn, "compile": torch.compile(fn, dynamic=True), "script": torch.jit.script(fn)}
        x = torch.randn(8, 256, 2048, requires_grad=True)
        other = torch.randn(8, 256, 2048, requires_grad=True) if fn is silu_mul else torch.randn(2048, requires_grad=True)
        for f in fns.values():
            for _ in range(3):
                f(x, other).sum().backward()
        times: Dict[str, List[float]] = {k: [] for k in fns}
        for r in range(repeats):
            for k in list(fns)[r % 3:] + list(fns)[:r % 3]:
                start = time.perf_counter()
                y = fns[k](x, other)
                y.backward(torch.ones_like(y))
                times[k].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {name} | {med['eager']:.1f} | {med['compile']:.1f} | {med['script']:.1f} | "
              f"{med['eager'] / med['compile']:.2f} | {med['eager'] / med['script']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if args.kernels:
        kernels()
        return
    model = build(args.model)
    params = sum(p.numel() for p in model.parameters())
    kinds = ["attention", "norm", "mlp"] if args.model == "llama" else ["attention", "activation", "mlp"]
    variants: Dict[str, Tuple[List[Swap], str]] = {"unfused": ([], "eager")}
    originals = _children(model)
    for kind in kinds:
        variants[kind] = (variant_swaps(model, [kind]), "sdpa" if kind == "attention" else "eager")
        model.set_attn_implementation("eager")
    variants["all"] = (variant_swaps(model, None), "sdpa")
    model.set_attn_implementation("eager")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randint(4, 16000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def forward() -> None:
        model.eval()
        with torch.no_grad():
            model(input_ids=x)

    def step() -> None:
        model.train()
        model(input_ids=x, labels=x).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    print(f"{args.model}, {params / 1e6:.0f}M parameters, batch {args.batch}, seq {args.seq}, fp32, "
          f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{args.repeats} interleaved repeats\n")
    print("| variant | forward ms (median) | forward unfused/fused [min, max] | step ms (median) | "
          "step unfused/fused [min, max] |")
    print("| --- | --- | --- | --- | --- |")
    names = list(variants)
    times: Dict[str, Dict[str, List[float]]] = {what: {n: [] for n in names} for what in ("forward", "step")}
    for name in names:  # warm-up: compiles the fused kernels for these shapes
        activate(model, *variants[name][:1], originals, variants[name][1])
        forward(), step()
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            activate(model, variants[name][0], originals, variants[name][1])
            for what, fn in (("forward", forward), ("step", step)):
                start = time.perf_counter()
                fn()
                times[what][name].append(time.perf_counter() - start)
    for name in names:
        cells = []
        for what in ("forward", "step"):
            base, mine = times[what]["unfused"], times[what][name]
            ratios = [b / m for b, m in zip(base, mine)]
            cells += [f"{statistics.median(mine) * 1e3:.0f}",
                      f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
