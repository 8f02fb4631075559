"""The cost model's activation memory on architectures other than Llama and GPT-2, before and after the probe.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/activation_probe.py [--families F ...] [--seq 256] [--batch 2]

For each architecture family of `atorch.testing.tp_families` (FAMILIES, or `--families more`: the
MORE_PLAN_FAMILIES), widened to hidden 256 / 4 layers so
that activations are most of a training step's memory (vocabulary 1024-1003 as the family
defines it), on real CPU tensors in one process:

- saved: the bytes every block saves for backward in one forward (counted with
  `saved_tensors_hooks`, each storage once, parameters excluded) -- what the block formula models;
- peak: the peak of two plain fp32 training steps (forward, backward, AdamW step; PeakMemoryTracker's
  exact storage accounting) plus the parameters, against `estimate(...)` with the formula alone
  (`ModelShape.from_module`) and with the probe (`estimate(model, ...)`, which measures the first block).

Ratios are model / measured (1.000 is exact).
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List

import torch
from torch import nn

from atorch.auto.activation_probe import find_blocks
from atorch.auto.cost_model import ModelShape, StrategyTraits, block_activation_bytes, calibrated_shape, estimate
from atorch.testing.activations import saved_by_every_block
from atorch.testing.tp_families import FAMILIES, MORE_PLAN_FAMILIES, family_config, more_family_config
from atorch.utils.peak_memory import PeakMemoryTracker

WIDE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8}
# Names the families use for the same quantities.
ALIASES = {"hidden_size": ("hidden_size", "n_embd"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
           "num_attention_heads": ("num_attention_heads", "n_head"),
           "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")}


def widened(name: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    small = family_config(name) if name in FAMILIES else more_family_config(name)
    values = small.to_dict()
    values.pop("layer_types", None)      # per-layer lists follow the new layer count
    values.pop("mlp_only_layers", None)
    values.pop("no_rope_layers", None)       # SmolLM3: one flag a layer
    for key in ("max_position_embeddings", "n_positions"):     # room for --seq
        if values.get(key):
            values[key] = max(values[key], 2048)
    small_heads = next(values[a] for a in ALIASES["num_attention_heads"] if values.get(a))
    for key in ("num_key_value_heads", "num_kv_heads"):      # the family's key/value share of the heads
        if values.get(key):
            values[key] = WIDE["num_attention_heads"] * values[key] // small_heads
    for key, value in WIDE.items():
        for alias in ALIASES[key]:
            if values.get(alias) is not None:
                values[alias] = value
    if values.get("head_dim"):
        values["head_dim"] = WIDE["hidden_size"] // WIDE["num_attention_heads"]
    if values.get("moe_intermediate_size"):
        values["moe_intermediate_size"] = WIDE["intermediate_size"] // 4
    config = type(small).from_dict(values)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def measured_peak(model: nn.Module, batch: int, seq: int, vocab: int) -> int:
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, vocab, (batch, seq))
    with PeakMemoryTracker(torch.device("cpu")) as tracker:
        for _ in range(2):
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes + sum(p.numel() * p.element_size() for p in model.parameters())


def row(name: str, batch: int, seq: int) -> Dict[str, float]:
    model = widened(name)
    vocab = model.config.vocab_size
    shape = ModelShape.from_module(model)
    traits = StrategyTraits.from_strategy([], 1, shape, "cpu")
    layers = len(find_blocks(model) or [])
    start = time.perf_counter()
    calibrated = calibrated_shape(model, seq)
    probe_s = time.perf_counter() - start
    saved = saved_by_every_block(model, batch, seq)
    formula = layers * block_activation_bytes(shape, traits, batch, seq)
    probed = layers * block_activation_bytes(calibrated, traits, batch, seq)
    peak = measured_peak(model, batch, seq, vocab)
    return {"saved_formula": formula / saved, "saved_probe": probed / saved, "scale": calibrated.activation_scale,
            "peak_formula": estimate(shape, [], batch, seq, 1).peak_memory_bytes / peak,
            "peak_probe": estimate(model, [], batch, seq, 1).peak_memory_bytes / peak,
            "params_m": shape.num_params / 1e6, "probe_s": probe_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES),
                        help=f"of tp_families.FAMILIES (the default) or MORE_PLAN_FAMILIES ('more' for all of those)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"batch {args.batch}, seq {args.seq}, fp32, AdamW, one process; ratios model / measured")
    print("| family | params (M) | scale | saved: formula | saved: probe | peak: formula | peak: probe | probe s |")
    print("|---|---|---|---|---|---|---|---|")
    rows: List[Dict[str, float]] = []
    families = [f for name in args.families for f in (MORE_PLAN_FAMILIES if name == "more" else [name])]
    for name in families:
        try:
            r = row(name, args.batch, args.seq)
        except Exception as e:  # noqa: BLE001 - a family this widening does not fit is reported, not fatal
            print(f"| {name} | not run: {type(e).__name__}: {str(e)[:120]} |||||||", flush=True)
            continue
        rows.append(r)
        print(f"| {name} | {r['params_m']:.1f} | {r['scale']:.3f} | {r['saved_formula']:.3f} | {r['saved_probe']:.3f} "
              f"| {r['peak_formula']:.3f} | {r['peak_probe']:.3f} | {r['probe_s']:.2f} |", flush=True)
    worst = lambda key: max(abs(r[key] - 1) for r in rows)  # noqa: E731
    print(f"worst |ratio - 1|: saved {worst('saved_formula'):.3f} -> {worst('saved_probe'):.3f}, "
          f"peak {worst('peak_formula'):.3f} -> {worst('peak_probe'):.3f}")


if __name__ == "__main__":
    main()
