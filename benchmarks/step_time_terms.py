"""The cost model's step time for one 7B model across pipelines, accumulation and CPU offload.

Prints `cost_model.estimate`'s prediction (memory, step time and its compute / overhead /
communication parts) for Llama-2-7B on 8 H100s (datasheet rates of `atorch.auto.devices`),
global batch 64 x 4096 tokens, bf16: the figures of benchmarks/RESULTS.md, "Step-time model".
Nothing is run; it checks which terms the model charges, not how fast anything is.

    python benchmarks/step_time_terms.py
"""

from typing import Any, Dict, List

import torch

from atorch.auto.cost_model import calibrated_shape, estimate
from atorch.auto.devices import device_spec
from atorch.auto.search.cluster_plan import load_model_config, meta_model

GLOBAL_BATCH, SEQ, WORLD = 64, 4096, 8
BF16 = ("amp_native", {"dtype": torch.bfloat16})
DS_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def _layout(*dims: Any) -> Any:
    return ("parallel_mode", (list(dims), None))


STRATEGIES: Dict[str, List[Any]] = {
    "data=8 fsdp": [_layout(("data", 8)), BF16, "fsdp"],
    "data=8 fsdp, accumulation 8": [_layout(("data", 8)), ("gradient_accumulation", 8), BF16, "fsdp"],
    "data=8 fsdp cpu_offload": [_layout(("data", 8)), BF16, ("fsdp", {"cpu_offload": True})],
    "data=8 DeepSpeed ZeRO-3": [_layout(("data", 8)), BF16, ("fsdp", {"use_ds_zero": True})],
    "data=8 DeepSpeed ZeRO-3, offload optimizer + params": [
        _layout(("data", 8)), BF16, ("fsdp", {"use_ds_zero": True, "ds_config": DS_OFFLOAD})],
    "tensor=8": [_layout(("tensor", 8), ("data", 1)), "tensor_parallel", BF16],
    "tensor=8, accumulation 8": [_layout(("tensor", 8), ("data", 1)), ("gradient_accumulation", 8),
                                 "tensor_parallel", BF16],
    "pipeline=8, 8 micro-batches": [_layout(("data", 1), ("pipeline", 8)), "pipeline_parallel", BF16],
    "pipeline=8, 64 micro-batches": [_layout(("data", 1), ("pipeline", 8)), ("pipeline_parallel", {"chunks": 64}),
                                     BF16],
    "pipeline=2 x data=4": [_layout(("data", 4), ("pipeline", 2)), "pipeline_parallel", BF16],
}


def main() -> None:
    model = meta_model(load_model_config("llama2-7b"))
    shape = calibrated_shape(model, SEQ)
    profile = device_spec("h100").profile(multi_node=False)
    print("| strategy | memory GB | step s | compute / overhead / communication s |")
    print("|---|---|---|---|")
    for name, strategy in STRATEGIES.items():
        e = estimate(shape, strategy, GLOBAL_BATCH, SEQ, WORLD, "cuda", profile=profile)
        b = e.breakdown
        print(f"| {name} | {e.peak_memory_bytes / 1e9:.1f} | {e.step_time_s:.3f} | {b['time_compute']:.3f} / "
              f"{b['time_overhead']:.3f} / {b['time_communication']:.3f} |")


if __name__ == "__main__":
    main()
