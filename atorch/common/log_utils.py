"""`default_logger`, `Timer` and `TimeStats`: what ATorch scripts import from `atorch.common.log_utils`.

`default_logger` is the standard `logging` logger named "atorch", the parent of every atorch
module's logger, so configuring it (level, handlers) configures atorch's messages too. Without
any logging configuration it prints INFO and above to stderr, as ATorch's did.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Dict, Optional, Type

__all__ = ["TimeStats", "Timer", "default_logger", "get_logger"]

_FORMAT = "%(asctime)s %(levelname)s %(filename)s:%(lineno)d %(message)s"


def get_logger(name: str = "atorch", level: int = logging.INFO) -> logging.Logger:
    """The named logger, with a stderr handler added once if the process configured none."""
    logger = logging.getLogger(name)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(level)
    return logger


default_logger = get_logger()


class TimeStats:
    """Named durations in seconds (`stats["forward"] = 0.12`); a missing name reads as None."""

    def __init__(self, name: str):
        self.name = name
        self.time_statics: Dict[str, float] = {}   # ATorch's attribute name

    def __getitem__(self, key: str) -> Optional[float]:
        return self.time_statics.get(key)

    def __setitem__(self, key: str, value: float) -> None:
        self.time_statics[key] = value

    def to_dashboard(self, dashboard_writer, n_iter: Optional[int] = None) -> None:  # type: ignore[no-untyped-def]
        """Write the durations with a writer that has `add_scalars(values, n_iter, name=)` and `flush()`."""
        dashboard_writer.add_scalars(self.time_statics, n_iter, name=self.name)
        dashboard_writer.flush()


class Timer:
    """Wall-clock time of a block: `start()`/`end()` or `with Timer(name, stats):` (records `stats[name]`).

    `elapsed_time` is in seconds, from a monotonic clock (so a clock adjustment cannot make it
    negative). With the environment variable ATORCH_DEBUG set, a timed block also logs its
    duration and rank at INFO.
    """

    def __init__(self, name: str, time_stats: Optional[TimeStats] = None):
        self.name = name
        self.time_stats = time_stats
        self.elapsed_time: float = 0.0

    def start(self) -> None:
        self.start_time = time.perf_counter()

    def end(self) -> None:
        self.end_time = time.perf_counter()
        self.elapsed_time = self.end_time - self.start_time

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.end()
        if self.time_stats is not None:
            self.time_stats[self.name] = self.elapsed_time
            from atorch.utils.env import env_str

            if env_str("ATORCH_DEBUG", None):
                from atorch.distributed.process_group import rank

                default_logger.info("%s on rank %d took %.6f s", self.name, rank(), self.elapsed_time)
