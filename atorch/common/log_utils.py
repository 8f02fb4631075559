"""`default_logger`: the logger ATorch scripts import from `atorch.common.log_utils`.

It is the standard `logging` logger named "atorch", the parent of every atorch module's
logger, so configuring it (level, handlers) configures atorch's messages too. Without any
logging configuration it prints INFO and above to stderr, as ATorch's did.
"""

from __future__ import annotations

import logging

__all__ = ["default_logger", "get_logger"]

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
