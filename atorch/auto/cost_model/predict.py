"""`estimate`: a strategy's predicted per-rank peak memory and step time, from the parts above."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch import nn

from atorch.auto.cost_model.activations import shape_of
from atorch.auto.cost_model.memory import memory_breakdown, peak_bytes
from atorch.auto.cost_model.optimizer import OptimizerStates
from atorch.auto.cost_model.shape import ModelShape
from atorch.auto.cost_model.step_time import DEVICE_PROFILES, time_breakdown
from atorch.auto.cost_model.traits import StrategyTraits, micro_batch_size
from atorch.auto.strategy import StrategyLike


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank peak memory and step time of one training step."""

    peak_memory_bytes: int
    step_time_s: float
    breakdown: Dict[str, float] = field(default_factory=dict, compare=False)

    def throughput(self, batch_size: int) -> float:
        """Predicted samples/s for a global batch of `batch_size`."""
        return batch_size / self.step_time_s if self.step_time_s > 0 else 0.0


def estimate(model_or_config: Union[nn.Module, Any, ModelShape], strategy: StrategyLike, batch_size: int,
             seq_len: int, world_size: int, device: Union[str, torch.device] = "cpu",
             profile: Optional[Mapping[str, float]] = None,
             optimizer: Optional[OptimizerStates] = None) -> Estimate:
    """Predict (per-rank peak memory, step time) of `strategy` for a *global* batch of `batch_size`.

    `model_or_config` is a module, a transformers config or a `ModelShape`; a module's frozen
    parameters (requires_grad=False) get no gradients or optimizer state. `profile` overrides
    the device rates of `DEVICE_PROFILES[device type]`. `optimizer`: what the user's optimizer
    keeps (`optimizer_states(optim_func, optim_args)`); Adam's by default. The peak counts device
    memory only: what CPU offload keeps in host memory is in the breakdown as `mem_host_*` entries.
    """
    if batch_size <= 0 or seq_len <= 0 or world_size <= 0:
        raise ValueError(f"batch_size={batch_size}, seq_len={seq_len}, world_size={world_size} must all be > 0")
    shape = shape_of(model_or_config, seq_len)
    device_type = torch.device(device).type
    traits = StrategyTraits.from_strategy(strategy, world_size, shape, device_type, optimizer)
    rates = dict(DEVICE_PROFILES.get(device_type, DEVICE_PROFILES["cuda"]))
    rates.update(profile or {})

    per_rank = max(1, batch_size // traits.data)
    memory = memory_breakdown(shape, traits, micro_batch_size(traits, batch_size), seq_len, device_type)
    time = time_breakdown(shape, traits, per_rank, seq_len, rates)
    return Estimate(peak_bytes(memory), sum(time.values()), {**{f"mem_{k}": v for k, v in memory.items()},
                                                             **{f"time_{k}": v for k, v in time.items()}})
