"""`auto_accelerate` and the `Strategy` it applies or finds."""

from atorch.auto.accelerate import AutoAccelerateResult, apply_strategy, auto_accelerate, train_step
from atorch.auto.opt_lib.resolve import plan
from atorch.auto.strategy import Strategy, StrategyItem

__all__ = ["AutoAccelerateResult", "Strategy", "StrategyItem", "apply_strategy", "auto_accelerate", "plan",
           "train_step"]
