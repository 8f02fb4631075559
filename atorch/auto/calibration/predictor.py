"""The cost model as a predictor of a strategy's step (`strategy -> Estimate`), gradient accumulation included."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from atorch.auto.calibration.shape_probe import ShapedConstants, accumulation_steps, strategy_workload
from atorch.auto.cost_model import Estimate, StrategyTraits, estimate, shape_of
from atorch.auto.cost_model.optimizer import OptimizerStates
from atorch.auto.strategy import Strategy, StrategyLike

COMPONENTS = ("time_compute", "time_overhead", "time_communication")

Predictor = Callable[[Strategy], Estimate]


def cost_model_predictor(model_or_shape: Any, batch_size: int, seq_len: int, world_size: int,
                         device: Any = "cpu",
                         profile: Union[None, Mapping[str, float], ShapedConstants] = None,
                         optimizer: Optional[OptimizerStates] = None) -> Predictor:
    """`strategy -> Estimate` from the cost model, with `gradient_accumulation` accounted for.

    A strategy accumulating over k micro-batches: its memory is `estimate`'s for the whole
    strategy (a micro-batch's activations, and the gradients the earlier micro-steps keep alive);
    its time is one micro-step's at the global batch / k with compute and per-layer overhead
    k times, gradient reductions once (they are skipped on the other micro-steps), parameter
    gathers of FSDP2 k times. `profile`: rate overrides for every strategy, or `ShapedConstants`,
    from which each strategy gets the rates probed at its own tokens per rank and tensor split.
    `optimizer`: what the user's optimizer keeps per parameter (Adam's by default).
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
        ga = s.get("gradient_accumulation")
        steps = accumulation_steps(ga.config) if ga is not None else 1
        whole = estimate(shape, s, batch_size, seq_len, world_size, device, profile=rates, optimizer=optimizer)
        if steps == 1:
            return whole
        base = Strategy(i for i in s if i.name != "gradient_accumulation")
        micro = estimate(shape, base, max(1, batch_size // steps), seq_len, world_size, device, profile=rates,
                         optimizer=optimizer)
        traits = StrategyTraits.from_strategy(base, world_size, shape)
        comm_repeats = steps if traits.param_shard > 1 else 1
        b = {k: v for k, v in micro.breakdown.items() if k.startswith("time_")}
        b["time_compute"] *= steps
        b["time_overhead"] *= steps
        b["time_communication"] *= comm_repeats
        b.update((k, v) for k, v in whole.breakdown.items() if k.startswith("mem_"))
        return Estimate(whole.peak_memory_bytes, sum(b[k] for k in COMPONENTS), b)

    return predict
