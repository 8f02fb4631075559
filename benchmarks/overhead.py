"""Step time of `auto_accelerate`-built training vs the same strategy written by hand in plain PyTorch.

Launch (2 CPU ranks, gloo):
    .venv/bin/python -m atorch.distributed.run --nproc_per_node 2 benchmarks/overhead.py
Options: --repeats 3 --steps 20 --warmup 3 --hidden 256 --layers 4 --seq 128 --batch 8 [--json out.json]

For each strategy (ddp; fsdp; fsdp+amp_native(bf16)+checkpoint) it builds the model both ways,
`--repeats` times, and after `--warmup` steps alternates single timed steps of the two (which one
goes first alternates too), so slow phases of a shared machine hit both alike. Figures: the ratio
of the median step times auto/hand (target <= 1.03) and the median of the ratios of adjacent
auto/hand steps. The auto side is driven the documented way (`train_step(result, batch)`), the
hand side by a plain loop; both see the same per-rank batches. A control row times the
hand-written fsdp against itself (the noise floor of this machine), and a last row compares
atorch's `zero2` (FSDP2 without resharding after forward) with FSDP1's SHARD_GRAD_OP, the
other torch ZeRO-2 candidate (not an overhead figure).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama

Step = Callable[[Dict[str, torch.Tensor]], None]


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh builds of both variants")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each variant per repeat")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    return p.parse_args()


def _model(args: argparse.Namespace) -> nn.Module:
    return tiny_llama(seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 8 // 3, num_attention_heads=4, num_key_value_heads=4)


def _local_batches(args: argparse.Namespace, n: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    local = args.batch // dist.get_world_size()
    out = []
    for _ in range(n):
        ids = torch.randint(4, 1024, (local, args.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


# -- hand-written strategies -------------------------------------------------------------
def _plain_step(model: nn.Module, optim: torch.optim.Optimizer) -> Step:
    def step(batch: Dict[str, torch.Tensor]) -> None:
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return step


def _hand_fully_shard(model: nn.Module, amp: bool, ckpt: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = {"mesh": mesh}  # FSDP2's defaults: blocks reshard after forward, the root does not
    if amp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if ckpt:
        # Recomputing a block must not write the KV cache a second time (the usual HF practice).
        model.config.use_cache = False
    for layer in model.model.layers:
        if ckpt:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def hand_ddp(args: argparse.Namespace) -> Step:
    model = DistributedDataParallel(_model(args))
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def hand_fsdp(args: argparse.Namespace, amp: bool = False, ckpt: bool = False) -> Step:
    model = _hand_fully_shard(_model(args), amp, ckpt)
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def hand_fsdp1_shard_grad_op(args: argparse.Namespace) -> Step:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # FSDP1 on CPU needs device_id=cpu.
    model = FullyShardedDataParallel(_model(args), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                                     auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"), use_orig_params=True)
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


# -- the same strategies through auto_accelerate -------------------------------------------
def auto(strategy: list) -> Callable[[argparse.Namespace], Step]:
    def build(args: argparse.Namespace) -> Step:
        status, result, _ = auto_accelerate(_model(args), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-4},
                                            model_input_format="unpack_dict", load_strategy=strategy)
        assert status, strategy
        return functools.partial(train_step, result)
    return build


CASES: Dict[str, Tuple[Callable[[argparse.Namespace], Step], Callable[[argparse.Namespace], Step]]] = {
    "ddp": (auto(["ddp"]), hand_ddp),
    "fsdp": (auto(["fsdp"]), hand_fsdp),
    "fsdp+amp_native(bf16)+checkpoint": (auto([("amp_native", torch.bfloat16), "fsdp", "checkpoint"]),
                                         functools.partial(hand_fsdp, amp=True, ckpt=True)),
    # The noise floor: two identical hand-written variants; ratios within its spread are noise.
    "control: fsdp by hand vs itself": (hand_fsdp, hand_fsdp),
    # Not an overhead figure: atorch zero2 (FSDP2, no reshard after forward) vs FSDP1 SHARD_GRAD_OP.
    "zero2 (FSDP2) vs FSDP1 SHARD_GRAD_OP": (auto(["zero2"]), hand_fsdp1_shard_grad_op),
}


def _timed_step(step: Step, batch: Dict[str, torch.Tensor]) -> float:
    """Seconds for one step on rank 0, barrier to barrier, so it ends when the slowest rank is done."""
    dist.barrier()
    start = time.perf_counter()
    step(batch)
    dist.barrier()
    return time.perf_counter() - start


def _measure(build_auto: Callable[[argparse.Namespace], Step], build_hand: Callable[[argparse.Namespace], Step],
             args: argparse.Namespace, batches: List[Dict[str, torch.Tensor]]) -> Dict[str, List[float]]:
    """Interleaved at the step level: auto and hand steps alternate (which one goes first
    alternates too), so a slow phase of the shared machine hits both variants alike."""
    times: Dict[str, List[float]] = {"auto": [], "hand": []}
    for _ in range(args.repeats):
        steps = {"auto": build_auto(args), "hand": build_hand(args)}
        for batch in batches[:args.warmup]:
            for step in steps.values():
                step(batch)
        for i, batch in enumerate(batches[args.warmup:]):
            for variant in (("auto", "hand") if i % 2 == 0 else ("hand", "auto")):
                times[variant].append(_timed_step(steps[variant], batch))
        del steps
        dist.barrier()
    return times


def main() -> None:
    args = _parse_args()
    adist.init_distributed()
    torch.set_num_threads(1)
    batches = _local_batches(args, args.warmup + args.steps)
    figures = {}
    for name, (build_auto, build_hand) in CASES.items():
        times = _measure(build_auto, build_hand, args, batches)
        # Rank 0's barrier-to-barrier times are what counts; the other ranks just take part.
        paired = [a / h for a, h in zip(times["auto"], times["hand"])]
        figures[name] = {"auto_median_ms": 1e3 * statistics.median(times["auto"]),
                         "hand_median_ms": 1e3 * statistics.median(times["hand"]),
                         "ratio_of_medians": statistics.median(times["auto"]) / statistics.median(times["hand"]),
                         "median_paired_ratio": statistics.median(paired), "steps_each": len(paired)}
        if dist.get_rank() == 0:
            f = figures[name]
            print(f"{name}: auto {f['auto_median_ms']:.1f} ms, hand {f['hand_median_ms']:.1f} ms, ratio of medians "
                  f"{f['ratio_of_medians']:.3f}, median paired ratio {f['median_paired_ratio']:.3f} "
                  f"({f['steps_each']} steps each)", flush=True)
    if dist.get_rank() == 0:
        print("\n| strategy | auto ms/step | hand ms/step | auto/hand (ratio of medians) | median paired ratio |")
        print("|---|---|---|---|---|")
        for name, f in figures.items():
            print(f"| {name} | {f['auto_median_ms']:.1f} | {f['hand_median_ms']:.1f} | {f['ratio_of_medians']:.3f} | "
                  f"{f['median_paired_ratio']:.3f} |")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"args": vars(args), "figures": figures}, fh, indent=2)
    adist.destroy_distributed()


if __name__ == "__main__":
    main()
