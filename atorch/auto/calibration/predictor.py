"""The cost model as a predictor of a strategy's step (`strategy -> Estimate`), gradient accumulation included."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from atorch.auto.calibration.shape_probe import ShapedConstants, strategy_workload
from atorch.auto.cost_model import Estimate, estimate, shape_of
from atorch.auto.cost_model.optimizer import OptimizerStates
from atorch.auto.strategy import Strategy, StrategyLike

COMPONENTS = ("time_compute", "time_overhead", "time_communication")

Predictor = Callable[[Strategy], Estimate]


def cost_model_predictor(model_or_shape: Any, batch_size: int, seq_len: int, world_size: int,
                         device: Any = "cpu",
                         profile: Union[None, Mapping[str, float], ShapedConstants] = None,
                         optimizer: Optional[OptimizerStates] = None) -> Predictor:
    """`strategy -> Estimate` from the cost model, with `gradient_accumulation` accounted for.

    `estimate` itself counts a strategy's passes per step (accumulation's micro-steps, a
    pipeline's micro-batches: per-layer overhead and FSDP2's parameter gathers once per pass,
    gradient reductions once per step); this adds the rates. `profile`: rate overrides for every
    strategy, or `ShapedConstants`, from which each strategy gets the rates probed at its own
    tokens per rank and micro-step and tensor split (a smaller micro-batch multiplies at a lower
    rate). `optimizer`: what the user's optimizer keeps per parameter (Adam's by default).
    """
    # Block activations measured by the activation probe, as `estimate` does (`shape_of`).
    shape = shape_of(model_or_shape, seq_len)

    def predict(strategy: StrategyLike) -> Estimate:
        s = Strategy.from_any(strategy)
        rates: Optional[Mapping[str, float]]
        if isinstance(profile, ShapedConstants):
            tokens, tensor, _, half = strategy_workload(shape, s, batch_size, seq_len, world_size)
            rates = profile.profile_for(tokens, tensor, half)
        else:
            rates = profile
        return estimate(shape, s, batch_size, seq_len, world_size, device, profile=rates, optimizer=optimizer)

    return predict
