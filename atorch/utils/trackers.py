"""`MetricsLogger`: training metrics to TensorBoard and/or a JSON-lines file, from rank 0 only.

`log_with="tensorboard"` writes event files with torch's `SummaryWriter` (the `tensorboard`
package is an optional extra: `pip install atorch[tensorboard]`); `log_with="jsonl"` appends
one JSON object per logged step to `<log_dir>/metrics.jsonl`, readable by anything. A list
gives both. Every other rank gets a logger that does nothing, so the training loop calls it
unconditionally.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, is_dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union, cast

TRACKERS = ("tensorboard", "jsonl")


def _rank() -> int:
    from atorch.distributed.process_group import rank   # imported when asked: keeps this module light

    return rank()


def parse_log_with(log_with: Union[None, str, Sequence[str]]) -> List[str]:
    """None/"none" -> [], "tensorboard" -> ["tensorboard"], "jsonl,tensorboard" or a list -> both."""
    if log_with is None:
        return []
    names = [n.strip() for n in log_with.split(",")] if isinstance(log_with, str) else [str(n) for n in log_with]
    names = [n for n in names if n and n != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"log_with={log_with!r}: unknown tracker(s) {unknown}; valid trackers are {list(TRACKERS)}")
    return sorted(set(names), key=names.index)


class MetricsLogger:
    """Log scalars per step to the chosen trackers; a no-op on ranks other than 0 (or `enabled=False`)."""

    def __init__(self, log_dir: str, log_with: Union[None, str, Sequence[str]] = "jsonl",
                 enabled: Optional[bool] = None) -> None:
        self.trackers = parse_log_with(log_with)
        self.log_dir = log_dir
        self.enabled = (_rank() == 0) if enabled is None else enabled
        self._writer: Any = None
        self._jsonl: Any = None
        if not self.enabled or not self.trackers:
            return
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise ValueError(f"MetricsLogger: log_dir={log_dir!r} is an existing file; give a directory")
        os.makedirs(log_dir, exist_ok=True)
        if "tensorboard" in self.trackers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("log_with='tensorboard' needs the tensorboard package: pip install "
                                 "'atorch[tensorboard]' (or pip install tensorboard)") from e
            self._writer = SummaryWriter(log_dir=log_dir)
        if "jsonl" in self.trackers:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def log(self, metrics: Union[Mapping[str, Any], Any], step: int) -> None:
        """Log the numeric values of `metrics` (a mapping or a dataclass such as `StepMetrics`) at `step`."""
        if not self.enabled or not self.trackers:
            return
        values: Dict[str, Any]
        if is_dataclass(metrics) and not isinstance(metrics, type):
            values = asdict(metrics)
        else:
            values = dict(cast(Mapping[str, Any], metrics))
        scalars: Dict[str, float] = {}
        for key, value in values.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(float(value)):
                scalars[key] = float(value)
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(f"train/{key}", value, global_step=step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
