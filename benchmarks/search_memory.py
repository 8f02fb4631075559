"""Peak RSS per rank during a strategy search, against the model's own size (issue 19, section 3).

    nice -n 5 python benchmarks/search_memory.py [--hidden 768 --layers 6]
    # the same with another checkout of atorch, e.g. the deep-copying dry runner:
    PYTHONPATH=/path/to/old/atorch nice -n 5 python benchmarks/search_memory.py

2 CPU ranks search a Llama (fp32, AdamW, global batch 2 x 16 tokens) with
ATORCH_DEVICE_MEMORY_LIMIT = 3.7 x the model's bytes (--limit-in-models): the model alone fits,
its unsharded training state (weights + gradients + Adam, >= 4 x) does not. --only-amp-fsdp
restricts the space to the one candidate amp + fsdp, so different versions do the same work. Each rank resets its peak RSS
(/proc/self/clear_refs) right before `search_for_context` and reads VmHWM right after it, so
the figure is the search's own peak; the model was built before the reset and is in the
baseline. Uses only APIs that the deep-copying dry runner had too, so both can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rank(hidden: int, layers: int, ffn: int, report_dir: str, limit_in_models: float, only: bool) -> dict:
    import gc

    from atorch import distributed as adist
    from atorch.auto.model_context import ModelContext
    from atorch.auto.search.auto_search import search_for_context
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    model = tiny_llama(seed=0, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn,
                       num_attention_heads=4, num_key_value_heads=4)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if limit_in_models > 0:
        os.environ["ATORCH_DEVICE_MEMORY_LIMIT"] = str(int(limit_in_models * model_bytes))
    ctx = ModelContext(model=model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                       dataset=TokenDataset(n=16, seq_len=16), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 2}, device=adist.device())
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                  # resets VmHWM to the current RSS
    before_kb = _status_kb("VmRSS")
    excluded = ["module_replace", "tensor_parallel", "checkpoint"] + (["zero1", "zero2"] if only else [])
    best = search_for_context(ctx, excluded=excluded, included=["amp_native", "fsdp"] if only else None,
                              report_path=os.path.join(report_dir, f"rank{adist.rank()}"))
    peak_kb = _status_kb("VmHWM")
    return {"rank": adist.rank(), "model_mb": model_bytes / 1e6, "rss_before_mb": before_kb / 1e3,
            "rss_peak_mb": peak_kb / 1e3, "search_peak_over_before_mb": (peak_kb - before_kb) / 1e3,
            "best": best.describe(), "atorch": os.path.dirname(sys.modules["atorch"].__file__)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--report-dir", default="/tmp/atorch_search_memory")
    parser.add_argument("--limit-in-models", type=float, default=3.7,
                        help="ATORCH_DEVICE_MEMORY_LIMIT in units of the model's bytes; 0: no limit")
    parser.add_argument("--only-amp-fsdp", action="store_true",
                        help="a one-candidate space (amp + fsdp): the same work for every atorch version")
    args = parser.parse_args()
    from atorch.testing import run_distributed

    env = {"BO_SG_MAX_IETR": "2", "RANDOM_SAMPLE": "0", "ATORCH_DRYRUN_WARMUP_STEP": "2",
           "ATORCH_DRYRUN_PROFILE_STEP": "1", "ATORCH_DRYRUN_MAX_STEPS": "1", "ATORCH_DRYRUN_TIMEOUT": "600",
           "ATORCH_SEARCH_CACHE": "off"}
    rows = run_distributed(_rank, 2, args.hidden, args.layers, args.ffn, args.report_dir, args.limit_in_models,
                           args.only_amp_fsdp, env=env, timeout=1800)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
