"""`estimate`: a strategy's predicted per-rank peak memory and step time, from the parts above."""

from __future__ import annotations

import dataclasses
import math
import numbers
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
from atorch.auto.strategy import Strategy, StrategyLike

# The rates `profile` may override: those that divide must be > 0; a latency, an overhead, or a
# rate whose 0 means "none" or "unknown" (host_* : no host link to cross or CPU optimizer step
# counted; ranks_per_node: devices per node unknown) may be 0. DEVICE_PROFILES' keys are valid too.
_POSITIVE_RATES = ("flops_fp32", "flops_bf16", "comm_bytes_per_s", "intra_node_bytes_per_s")
_NON_NEGATIVE_RATES = ("layer_overhead_s", "step_overhead_s", "comm_latency_s", "host_bytes_per_s",
                       "host_optimizer_params_per_s", "ranks_per_node")


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

    ValueError naming the argument, before anything is computed, for: sizes that are not ints > 0,
    a device torch does not know, a profile key the cost model does not read or a rate it cannot
    use (0 or negative where it divides, negative, not finite), an unregistered optimization name;
    and for what `auto_accelerate` would refuse: parallel dims whose product is not `world_size`,
    more pipeline stages than layers, a global batch that does not split over the data ranks and
    the pipeline's chunks (`validate_batch_layout`). Given a module or a transformers config (not a
    `ModelShape`: the planner's own candidates are valid already), also what else `auto_accelerate` refuses
    before applying: the strategy's combination and each optimization's checks (`resolve_strategy`: a
    tensor size the heads do not split over, conflicting ZeRO items, accumulation steps the per-rank batch
    does not split into, a parallel dim no optimization splits over) and a `seq_len` longer than the model's
    positions (`check_sequence_length`): a prediction for a strategy that cannot run would mislead.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be an int > 0")
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or a torch.device (rates are "
                         f"known for {sorted(DEVICE_PROFILES)}; other device types get cuda's)") from None
    _check_profile(profile)
    s = _registered(strategy)
    shape = shape_of(model_or_config, seq_len)
    if device_type != "cpu" and shape.sdpa_quadratic_bytes:
        # Measured with the CPU's kernel choice; CUDA's flash and memory-efficient kernels take shapes (one key/value
        # head broadcast, a value head narrower than the query's) that send the CPU to its math path. Not measured
        # there (no GPU): the fused kernel is assumed, as before.
        shape = dataclasses.replace(shape, sdpa_quadratic_bytes=0.0)
    traits = StrategyTraits.from_strategy(s, world_size, shape, device_type, optimizer)
    _check_layout(s, traits, shape, batch_size, world_size)
    if not isinstance(model_or_config, ModelShape):
        _check_as_auto_accelerate(model_or_config, s, batch_size, seq_len, world_size, device_type)
    rates = dict(DEVICE_PROFILES.get(device_type, DEVICE_PROFILES["cuda"]))
    rates.update(profile or {})

    per_rank = max(1, batch_size // traits.data)
    memory = memory_breakdown(shape, traits, micro_batch_size(traits, batch_size), seq_len, device_type)
    time = time_breakdown(shape, traits, per_rank, seq_len, rates)
    return Estimate(peak_bytes(memory), sum(time.values()), {**{f"mem_{k}": v for k, v in memory.items()},
                                                             **{f"time_{k}": v for k, v in time.items()}})


def _check_as_auto_accelerate(model_or_config: Any, strategy: Strategy, batch_size: int, seq_len: int,
                              world_size: int, device_type: str) -> None:
    """ValueError for what `auto_accelerate` refuses of this strategy and model before applying it (see `estimate`)."""
    from atorch.auto.token_limits import position_limit
    from atorch.auto.opt_lib.base import ValidationContext
    from atorch.auto.opt_lib.resolve import resolve_strategy

    module = model_or_config if isinstance(model_or_config, nn.Module) else None
    config = getattr(module, "config", None) if module is not None else model_or_config
    limit = position_limit(config) if config is not None else None
    if limit is not None and seq_len > limit[1]:
        raise ValueError(f"seq_len={seq_len} is longer than the model's {limit[0]}={limit[1]} ({type(config).__name__}), "
                         f"which auto_accelerate refuses; use seq_len <= {limit[1]}")
    context = ValidationContext(world_size=world_size, model=module, model_config=config, device_type=device_type,
                                global_batch_size=batch_size)
    try:
        resolve_strategy(strategy, context)
    except ValueError as e:
        raise ValueError(f"auto_accelerate would refuse this strategy: {e}") from None


def _check_profile(profile: Optional[Mapping[str, float]]) -> None:
    """ValueError naming the first `profile` key that is not a rate the cost model reads, or whose value cannot be
    one (a division by 0, a negative time)."""
    if profile is None:
        return
    if not isinstance(profile, Mapping):
        raise ValueError(f"profile={profile!r} must be a mapping of rates, e.g. {{'flops_bf16': 4e14}}, or None")
    known = set(_POSITIVE_RATES) | set(_NON_NEGATIVE_RATES) | {k for rates in DEVICE_PROFILES.values() for k in rates}
    for key, value in profile.items():
        if key not in known:
            raise ValueError(f"profile[{key!r}] is not a rate the cost model reads; valid keys are {sorted(known)}")
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        positive = key in _POSITIVE_RATES
        if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(f"profile[{key!r}]={value!r} must be a finite number {'> 0' if positive else '>= 0'}")


def _registered(strategy: StrategyLike) -> Strategy:
    """`strategy` as a Strategy whose every item names a registered optimization (ValueError listing them):
    `auto_accelerate` refuses an unknown name, so a typo is not estimated as if the item were absent."""
    from atorch.auto.opt_lib.base import get_optimization

    s = Strategy.from_any(strategy)
    for index, item in enumerate(s):
        try:
            get_optimization(item.name)
        except ValueError as e:
            raise ValueError(f"strategy item {index}: {e}") from None
    return s


def _check_layout(strategy: Strategy, traits: StrategyTraits, shape: ModelShape, batch_size: int,
                  world_size: int) -> None:
    """The layout checks `auto_accelerate` makes before applying a strategy: parallel_mode's dims cover the
    world (`ParallelLayout.create`), a pipeline has a layer per stage, and the global batch splits over the
    data ranks and the pipeline's chunks (`validate_batch_layout`); ValueError naming the argument."""
    from atorch.auto.arguments import BatchLayoutError, validate_batch_layout
    from atorch.auto.opt_lib.base import get_optimization
    from atorch.distributed.parallel_layout import ParallelLayout

    dims: Any = (("data", world_size),)
    item = strategy.get("parallel_mode")
    if item is not None:
        config = get_optimization("parallel_mode").parse_config(item.config)
        dims = getattr(config, "dims", None) or dims
        try:
            ParallelLayout.create(dims, world_size, getattr(config, "rank_order", None))
        except ValueError as e:
            raise ValueError(f"strategy's parallel_mode does not fit world_size={world_size}: {e}") from None
    if traits.pipeline > 1 and shape.num_layers > 0 and traits.pipeline > shape.num_layers:
        raise ValueError(f"strategy's pipeline of {traits.pipeline} stages is longer than the model's "
                         f"{shape.num_layers} layers (every stage needs at least one); use at most "
                         f"{shape.num_layers} stages")
    chunks = traits.pipeline_chunks if traits.pipeline_engine == "native" else None
    try:
        validate_batch_layout({"batch_size": batch_size}, dict(dims), chunks)
    except BatchLayoutError as e:
        raise ValueError(f"batch_size={batch_size} (the global batch) does not split over the strategy's layout, "
                         f"which auto_accelerate refuses: {e}") from None
