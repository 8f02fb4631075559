"""The cost model's per-rank peak against the dry runner's measured peak, on 2 gloo ranks.

Each strategy is dry-run by `atorch.auto.dry_runner.dry_run` (2 warm-up steps, the peak over
building the candidate and its steps, `PeakMemoryTracker`'s exact storage count, the largest
rank) and predicted by `atorch.auto.cost_model.estimate`. Byte counts are deterministic.

    python benchmarks/memory_dry_runs.py                             # tiny Llama, global batch 8 x 64
    python benchmarks/memory_dry_runs.py --arch gpt2 --batch 4 --seq 48 --strategies ddp,amp,fsdp,tp
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

import torch

from atorch.testing import run_distributed, tiny_gpt2, tiny_llama

TP2 = ("parallel_mode", ([("tensor", 2), ("data", 1)], None))
PP2 = ("parallel_mode", ([("data", 1), ("pipeline", 2)], None))
STRATEGIES: Dict[str, List[Any]] = {
    "ddp": ["parallel_mode"], "amp": ["parallel_mode", "amp_native"], "ckpt": ["parallel_mode", "checkpoint"],
    "module_replace": ["parallel_mode", "module_replace"], "zero1": ["parallel_mode", "zero1"],
    "zero2": ["parallel_mode", "zero2"], "fsdp": ["parallel_mode", "fsdp"],
    "amp+fsdp+ckpt": ["parallel_mode", "amp_native", "fsdp", "checkpoint"],
    "tp": [TP2, "tensor_parallel"], "tp (gather_logits=False)": [TP2, ("tensor_parallel", {"gather_logits": False})],
    "amp+tp": [TP2, "tensor_parallel", "amp_native"], "half": ["parallel_mode", "half"],
    "lora": ["parallel_mode", "lora"], "pipeline": [PP2, "pipeline_parallel"],
    "amp+fsdp": ["parallel_mode", "amp_native", "fsdp"],
    "deepspeed zero1 bf16": ["amp_native", ("zero1", {"use_ds_zero": True})],
}
DEFAULT = ["ddp", "amp", "ckpt", "module_replace", "zero1", "zero2", "fsdp", "amp+fsdp+ckpt", "tp"]


def _rank(names: List[str], arch: str, batch: int, seq: int) -> Dict[str, Tuple[Any, int, Any]]:
    import torch.distributed as dist

    from atorch.auto.cost_model import estimate
    from atorch.auto.dry_runner import DryRunConfig, dry_run
    from atorch.auto.model_context import ModelContext
    from atorch.auto.strategy import Strategy
    from atorch.testing.parity import TokenDataset

    model = (tiny_llama if arch == "llama" else tiny_gpt2)(seed=0)
    ctx = ModelContext(model=model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=64, seq_len=seq), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": batch})
    out = {}
    for name in names:
        config = DryRunConfig(warmup_steps=2, profile_steps=1, max_profile_steps=1, timeout_s=300)
        result = dry_run(ctx, Strategy(STRATEGIES[name]), config)
        predicted = estimate(model, STRATEGIES[name], batch, seq, dist.get_world_size(), "cpu")
        out[name] = (result.peak_memory_bytes, predicted.peak_memory_bytes, result.error)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--strategies", default=",".join(DEFAULT), help=f"names among {sorted(STRATEGIES)}")
    args = parser.parse_args()
    names = args.strategies.split(",")
    results = run_distributed(_rank, 2, names, args.arch, args.batch, args.seq, timeout=1800)[0]
    print("| strategy | measured B | predicted B | predicted/measured |\n|---|---|---|---|")
    for name in names:
        measured, predicted, error = results[name]
        ratio = f"{predicted / measured:.3f}" if measured else "-"
        print(f"| {name} | {measured} | {predicted} | {ratio}{' (' + error + ')' if error else ''} |")


if __name__ == "__main__":
    main()
