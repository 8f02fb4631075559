"""No-repeat-n-gram blocking: transformers' processor vs atorch's fused one, per call and per generate.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ngram.py [--repeats 15] [--device cpu] [--no-generate]

Per call: `processor(input_ids, scores)` for every (batch, sequence length) of the grid, a
32k vocabulary, n = 3, token ids drawn from the first 2000 ids (text repeats itself; the
cost barely depends on how many n-grams match). Three variants are timed *interleaved*
(each repeat runs every variant once, in a rotating order, so load drift hits all alike):
transformers' `NoRepeatNGramLogitsProcessor`, `FusedNoRepeatNGramLogitsProcessor` (returns a
new tensor, like transformers) and the fused processor with `inplace=True` (what the generate
switch uses when `output_logits` is off). Reported: median ms and the ratio of medians, with
the [min, max] of the per-repeat ratios as the spread.

Per generate: a Llama with a 32k vocabulary and a tiny body (hidden 64, 2 layers, so the
processor is a visible part of a step), greedy, 32 new tokens, `no_repeat_ngram_size=3`,
with and without `fused_no_repeat_ngram_blocking=True`, interleaved the same way; the tokens
of both are checked equal on every repeat.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable, Dict, List, Sequence

import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from atorch.generation import FusedNoRepeatNGramLogitsProcessor, enable_fused_generate
from atorch.testing import tiny_llama

VOCAB = 32000
NGRAM = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(variants: Dict[str, Callable[[], object]], repeats: int, device: torch.device) -> Dict[str, List[float]]:
    """Seconds per call of each variant, one call of each per repeat, in a rotating order."""
    names = list(variants)
    for fn in variants.values():  # warm-up
        fn()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            variants[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def ratio_cell(base: List[float], other: List[float]) -> str:
    ratios = [b / o for b, o in zip(base, other)]
    return (f"{statistics.median(base) / statistics.median(other):.1f}x "
            f"[{min(ratios):.1f}, {max(ratios):.1f}]")


def per_call(batches: Sequence[int], lengths: Sequence[int], repeats: int, device: torch.device) -> None:
    print("| batch | seq | transformers ms | fused ms | fused in-place ms | speed-up (fused) | "
          "speed-up (in-place) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reference = NoRepeatNGramLogitsProcessor(NGRAM)
    fused = FusedNoRepeatNGramLogitsProcessor(NGRAM)
    fused_inplace = FusedNoRepeatNGramLogitsProcessor(NGRAM, inplace=True)
    for batch in batches:
        for length in lengths:
            g = torch.Generator().manual_seed(batch * 7 + length)
            ids = torch.randint(0, 2000, (batch, length), generator=g).to(device)
            scores = torch.randn(batch, VOCAB, generator=g).to(device)
            work = scores.clone()  # the in-place variant writes -inf into its own copy, reused
            assert torch.equal(fused(ids, scores), reference(ids, scores))
            times = interleaved({"transformers": lambda: reference(ids, scores), "fused": lambda: fused(ids, scores),
                                 "inplace": lambda: fused_inplace(ids, work)}, repeats, device)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {batch} | {length} | {med['transformers']:.3f} | {med['fused']:.3f} | {med['inplace']:.3f} | "
                  f"{ratio_cell(times['transformers'], times['fused'])} | "
                  f"{ratio_cell(times['transformers'], times['inplace'])} |", flush=True)


def per_generate(batches: Sequence[int], lengths: Sequence[int], repeats: int, device: torch.device,
                 new_tokens: int) -> None:
    print("\n| batch | prompt | generate ms (transformers) | generate ms (fused switch) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    model = enable_fused_generate(tiny_llama(seed=0, vocab_size=VOCAB, max_position_embeddings=2048).to(device).eval())
    for batch in batches:
        for length in lengths:
            ids = torch.randint(4, 2000, (batch, length), generator=torch.Generator().manual_seed(length)).to(device)
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, no_repeat_ngram_size=NGRAM, pad_token_id=3)
            outputs: Dict[str, torch.Tensor] = {}

            def run(name: str, **extra) -> None:
                with torch.no_grad():
                    outputs[name] = model.generate(**kwargs, **extra)

            times = interleaved({"transformers": lambda: run("transformers"),
                                 "fused": lambda: run("fused", fused_no_repeat_ngram_blocking=True)}, repeats, device)
            assert torch.equal(outputs["transformers"], outputs["fused"])
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {batch} | {length} | {med['transformers']:.0f} | {med['fused']:.0f} | "
                  f"{ratio_cell(times['transformers'], times['fused'])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--generate-repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--generate-lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-generate", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"vocab {VOCAB}, n {NGRAM}, repeats {args.repeats}\n")
    per_call(args.batches, args.lengths, args.repeats, device)
    if not args.no_generate:
        per_generate(args.batches, args.generate_lengths, args.generate_repeats, device, args.new_tokens)


if __name__ == "__main__":
    main()
