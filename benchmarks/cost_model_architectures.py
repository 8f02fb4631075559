r"""The cost model on every causal-LM architecture the installed transformers knows.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_model_architectures.py [--strategies 3]

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, its default config (the family's
published size, built on the meta device: no memory) is estimated under three strategies
(fsdp + amp, zero1 + checkpoint, tensor 2 x data 4 + amp) for a global batch of 8 x 256 tokens on
8 ranks. Printed: the architectures the cost model refuses, with its error, and the counts.
A refusal is a ValueError naming what the config lacks; anything else is a bug.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections import Counter
from typing import List, Tuple


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", type=int, default=3, choices=(1, 2, 3))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    from atorch.auto.cost_model import estimate
    from atorch.auto.strategy import Strategy

    hf_logging.set_verbosity_error()
    strategies = [Strategy(["parallel_mode", "amp_native", "fsdp"]), Strategy(["parallel_mode", "checkpoint", "zero1"]),
                  Strategy([("parallel_mode", ([("tensor", 2), ("data", 4)], None)), "tensor_parallel", "amp_native"])]
    refused: List[Tuple[str, str]] = []
    crashed: List[Tuple[str, str]] = []
    no_config, ok = [], 0
    started = time.time()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a family without a default config is not the cost model's
            no_config.append(model_type)
            continue
        errors = []
        for strategy in strategies[:args.strategies]:
            try:
                est = estimate(config, strategy, 8, 256, 8)
                assert est.peak_memory_bytes > 0 and est.step_time_s > 0, est
            except ValueError as e:
                errors.append(("refused", str(e).splitlines()[0]))
            except Exception as e:  # noqa: BLE001 - reported as a bug
                errors.append(("crashed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        if not errors:
            ok += 1
        else:
            kind, message = errors[0]
            (refused if kind == "refused" else crashed).append((model_type, message[:160]))
    total = ok + len(refused) + len(crashed)
    print(f"transformers causal-LM model types with a default config: {total} ({len(no_config)} without one); "
          f"{time.time() - started:.0f} s\n")
    print(f"estimated under every strategy: {ok}; refused (ValueError): {len(refused)}; crashed: {len(crashed)}\n")
    for title, rows in (("refused", refused), ("crashed", crashed)):
        for model_type, message in rows:
            print(f"- {title}: {model_type}: {message}")
    reasons = Counter(message.split(" has none of ")[-1] for _, message in refused)
    if reasons:
        print("\nrefusals by what is missing: " + "; ".join(f"{k} x{v}" for k, v in reasons.items()))


if __name__ == "__main__":
    main()
