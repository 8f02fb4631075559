"""Quiet by default: rank 0 logs atorch's INFO lines, other ranks only warnings and errors.

`configure_logging()` is called by atorch's entry points (`auto_accelerate`, the launcher, the
CLI). It touches the "atorch" logger only, never the root logger or the user's own loggers,
and adds a handler only when the process has none (so an application's logging setup wins).
`ATORCH_LOG_LEVEL` (DEBUG, INFO, WARNING, ...) sets the level on every rank.

`candidate_logs_quieted()` keeps what optimizations say while a dry run builds a candidate out
of the log (the dry run's result is its one line) unless ATORCH_LOG_LEVEL asks for more.

`third_party_warnings_filtered()` hides the FutureWarnings/DeprecationWarnings that DeepSpeed,
transformers and torch emit about their own internals while atorch drives them; users cannot
act on those. It is a context manager around atorch's own calls, never a global filter.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator, Optional

from atorch.utils.env import env_str

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Modules whose warnings are about their own internals (deprecated torch APIs they call).
_THIRD_PARTY = r"(deepspeed|transformers|torch|hebo|gpytorch|pymoo|peft|accelerate)(\.|$)"
_FORMAT = "[%(asctime)s atorch rank{rank} %(levelname)s] %(message)s"


def _rank() -> int:
    from atorch.distributed.process_group import rank   # imported when asked: keeps this module light

    return rank()


def log_level(rank: Optional[int] = None) -> int:
    """INFO on rank 0, WARNING elsewhere; ATORCH_LOG_LEVEL overrides both."""
    name = env_str("ATORCH_LOG_LEVEL", None)
    if name is not None:
        if name.upper() not in _LEVELS:
            raise ValueError(f"environment variable ATORCH_LOG_LEVEL={name!r} must be one of {list(_LEVELS)}")
        return getattr(logging, name.upper())
    return logging.INFO if (_rank() if rank is None else rank) == 0 else logging.WARNING


def configure_logging(rank: Optional[int] = None) -> logging.Logger:
    """Set the "atorch" logger's level for this rank; add a stderr handler if logging is unconfigured."""
    rank = _rank() if rank is None else rank
    logger = logging.getLogger("atorch")
    logger.setLevel(log_level(rank))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    return logger


@contextlib.contextmanager
def third_party_warnings_filtered() -> Iterator[None]:
    """Hide third-party Future/Deprecation warnings raised inside the block (not the caller's own)."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=_THIRD_PARTY)
        yield


@contextlib.contextmanager
def candidate_logs_quieted() -> Iterator[None]:
    """Raise the "atorch" logger to WARNING inside the block, unless ATORCH_LOG_LEVEL is set.

    A search builds many candidates; each optimization's INFO line (e.g. "checkpoint: 2 blocks
    recompute...") repeated per dry run would bury the one line per dry run that matters.
    """
    logger = logging.getLogger("atorch")
    previous = logger.level
    quiet = env_str("ATORCH_LOG_LEVEL", None) is None and logger.getEffectiveLevel() < logging.WARNING
    if quiet:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        if quiet:
            logger.setLevel(previous)
