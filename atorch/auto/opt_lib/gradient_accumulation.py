"""`gradient_accumulation`: split each per-rank batch into `steps` micro-batches per optimizer step.

The global batch per optimizer step stays `dataloader_args["batch_size"]`: the per-rank batch
the dataloader yields is cut into `steps` equal micro-batches whose gradients accumulate
(`atorch.auto.train_step` does it). Training is unchanged; activation memory is that of one
micro-batch, traded for `steps` smaller forward/backward passes. This is the search's micro-batch
dimension. `deepspeed_3d_parallel` has its own `gradient_accumulation_steps` (its ds_config).

When the gradients are reduced over the data ranks (`sync_each_micro_step`) is a trade of memory
for communication, and the default follows the wrapper's gradients:
- torch FSDP2 (`fsdp`, `zero2`) reduce-scatters every micro-step, so the accumulated gradients stay
  sharded (1/data of them, as ZeRO-2/3 promise; torch's and DeepSpeed's own behaviour). Skipping the
  sync keeps every unit's unsharded gradient, in fp32 under amp, through the step: for a 7B model on
  16 ranks that is more memory than the micro-batches save (benchmarks/declared_savings.py).
  `sync_each_micro_step=False` asks for it all the same: one reduce-scatter per step instead of
  `steps`, where the memory is there.
- DDP and torch ZeRO-1 keep whole gradients either way: the sync runs once per step (`no_sync` on the
  others); True reduces every micro-step, which costs communication and saves nothing.
- DeepSpeed engines decide themselves (ZeRO-1 at the accumulation boundary, ZeRO-2/3 every micro-step)
  and the native pipeline reduces inside each schedule step: an explicit value is refused there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.auto.opt_lib.pipeline_parallel import search_layouts

# Step counts offered per layout's rows per data rank (`search_steps`), and in all (`search_step_counts`;
# more only where the micro-batches of one row of every layout need more).
STEPS_PER_LAYOUT = 4
MAX_SEARCH_CHOICES = 6


@dataclass(frozen=True)
class GradientAccumulationConfig:
    steps: int
    """Micro-batches per optimizer step; must divide the per-rank batch (global batch / data-parallel size)."""
    sync_each_micro_step: Optional[bool] = None
    """Reduce the gradients over the data ranks in every micro-step (True) or only in the last (False);
    None: True under torch FSDP2 (sharded gradients), False under DDP and torch ZeRO-1 (module docstring)."""

    def __post_init__(self) -> None:
        if self.sync_each_micro_step is not None and not isinstance(self.sync_each_micro_step, bool):
            raise ValueError(f"gradient_accumulation: sync_each_micro_step={self.sync_each_micro_step!r} must be "
                             "True, False or None (None: per wrapper, see the gradient_accumulation docs)")


def _per_rank_batch(global_batch: int, data: int, steps: int, pipeline_chunks: int = 1) -> None:
    """Raise ValueError unless `global_batch` splits into data ranks x steps (x pipeline chunks) equal parts."""
    if global_batch % data != 0:
        raise ValueError(f"gradient_accumulation: the global batch size {global_batch} is not divisible by the "
                         f"data-parallel size {data}")
    per_rank = global_batch // data
    if per_rank % steps != 0:
        raise ValueError(f"gradient_accumulation: steps={steps} does not divide the per-rank batch {per_rank} (global "
                         f"batch {global_batch} / data-parallel size {data}); use a divisor of {per_rank}")
    if (per_rank // steps) % pipeline_chunks != 0:
        raise ValueError(f"gradient_accumulation: micro-batches of {per_rank // steps} rows (per-rank batch {per_rank} "
                         f"/ steps={steps}) do not split into the pipeline's {pipeline_chunks} chunks")


@register
class GradientAccumulationOptimization(Optimization):
    name = "gradient_accumulation"
    order = Order.GRADIENT_ACCUMULATION
    conflicts = frozenset({"deepspeed_3d_parallel"})
    Config = GradientAccumulationConfig
    search_dimension = "micro_batch"

    @classmethod
    def memory_saving(cls, config: GradientAccumulationConfig) -> Dict[str, float]:
        # At a fixed batch per step, `steps` micro-batches of 1/steps the rows each hold the
        # activations of one micro-batch, next to the gradients the earlier micro-steps leave: their
        # shards under FSDP2 (the default sync), whole under DDP (as at the end of any backward). With
        # sync_each_micro_step=False FSDP2 keeps them unsharded (fp32 under amp), which can outweigh the
        # activations saved (a 7B on 16 ranks: 2.8x; benchmarks/declared_savings.py): no saving is
        # declared over the choices that sync (a negative score in a kind of its own), only over fewer
        # steps synced the same way. Where the cost model predicts a declared saving reversed all
        # the same, the search does not let the order rule a candidate out (`feasibility.CONTRADICTION_SDS`).
        saving = {"micro_batches": math.log2(max(int(config.steps), 1))}
        if config.sync_each_micro_step is False:
            saving["unsharded_accumulation"] = -1.0
        return saving

    @classmethod
    def cost_traits(cls, config: GradientAccumulationConfig, context: CostContext) -> Dict[str, Any]:
        # Activations of one micro-batch at a time; the same global batch per step.
        return {"accumulation_steps": config.steps, "accumulation_sync": config.sync_each_micro_step}

    @classmethod
    def parse_config(cls, raw: Any) -> GradientAccumulationConfig:
        """Also accept the bare number: ("gradient_accumulation", 4)."""
        if raw is None:
            raise ValueError("gradient_accumulation needs its number of micro-batches per step, e.g. "
                             "('gradient_accumulation', {'steps': 4})")
        if isinstance(raw, int) and not isinstance(raw, bool):
            return GradientAccumulationConfig(raw)
        return super().parse_config(raw)

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        """Not accumulating, and for the rows each data rank splits per step in every layout the space
        may hold (`_layout_rows`), the steps of `search_steps`: each divides those rows, micro-batches
        of one row included. Validation keeps, per candidate, the steps that divide its own rows.
        Nothing when the batch size is unknown."""
        batch = context.global_batch_size
        if not batch:
            return [None]
        steps = search_step_counts(_layout_rows(context, batch))
        return [None, *((cls.name, {"steps": k}) for k in steps)]

    def validate(self, config: GradientAccumulationConfig, context: ValidationContext) -> None:
        steps = config.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation: steps={steps!r} must be an integer >= 1")
        if context.global_batch_size is not None:
            sizes = context.parallel_sizes()
            _per_rank_batch(context.global_batch_size, sizes.get("data", 1), steps, _pipeline_chunks(context, sizes))
        _check_sync_choice(config.sync_each_micro_step, context)

    def apply(self, ctx: ModelContext, config: GradientAccumulationConfig) -> None:
        global_batch = ctx.dataloader_args.get("batch_size")
        if global_batch is not None:   # also checked here: validation may not have known the batch size
            _per_rank_batch(int(global_batch), ctx.data_parallel_size(), config.steps)
        ctx.gradient_accumulation_steps = config.steps
        ctx.sync_each_micro_step = config.sync_each_micro_step


def _check_sync_choice(sync: Optional[bool], context: ValidationContext) -> None:
    """Refuse an explicit `sync_each_micro_step` where the engine decides when gradients are reduced."""
    if sync is None:
        return
    for name in ("zero1", "zero2", "fsdp"):
        if getattr(context.configs.get(name), "use_ds_zero", False):
            raise ValueError(f"gradient_accumulation: sync_each_micro_step={sync} does not apply to DeepSpeed's "
                             f"ZeRO engine ({name} with use_ds_zero=True), which decides when it reduces (stage 1 "
                             "once per step, stages 2-3 in every micro-step); leave it unset")
    if sync is False and "pipeline_parallel" in context.configs:
        raise ValueError("gradient_accumulation: sync_each_micro_step=False is not possible with "
                         "pipeline_parallel: the pipeline's schedule reduces the gradients over the data ranks in "
                         "every micro-step; leave it unset")


def search_step_counts(layout_rows: List[int], limit: int = MAX_SEARCH_CHOICES) -> List[int]:
    """The step counts the search offers for layouts splitting `layout_rows` rows per data rank: those
    `search_steps` picks for each, at most `limit` of them. Every layout keeps its micro-batches of one
    row and its mildest split (its steps = rows, and its smallest divisor), even beyond `limit`; of the
    others, those that divide the rows of the most layouts are kept (a count serves each layout it
    divides: validation keeps it there)."""
    picks = [search_steps(rows) for rows in layout_rows]
    kept = {k for steps in picks for k in steps[:1] + steps[-1:]}
    optional = {k for steps in picks for k in steps} - kept
    by_use = sorted(optional, key=lambda k: (-sum(rows % k == 0 for rows in layout_rows), k))
    return sorted(kept | set(by_use[:max(0, limit - len(kept))]))


def search_steps(rows: int, limit: int = STEPS_PER_LAYOUT) -> List[int]:
    """At most `limit` step counts > 1 dividing `rows`, spread evenly on a log scale from the smallest
    (the mildest split) to `rows` itself (micro-batches of one row: the least activation memory, the
    only size at which some models fit); all of them when there are no more than `limit`."""
    divisors = [k for k in range(2, rows + 1) if rows % k == 0]
    if len(divisors) <= limit:
        return divisors
    low, high = math.log(divisors[0]), math.log(divisors[-1])
    picked = set()
    for i in range(limit):
        target = low + (high - low) * i / (limit - 1)
        picked.add(min(divisors, key=lambda k: (abs(math.log(k) - target), k)))
    return sorted(picked)


def _layout_rows(context: ValidationContext, batch: int) -> List[int]:
    """The rows each data rank splits into micro-batches, for every layout the space may hold: the
    per-rank batch of every data size that divides the world and the batch (the rest of the world
    split by tensor or pipeline parallelism, or unused), and for each pipeline the search offers
    (`search_layouts`) that batch over its chunks (the schedule already cuts the rows into them)."""
    world = context.world_size
    rows = {batch // data for data in range(1, world + 1) if world % data == 0 and batch % data == 0}
    rows.update(batch // data // chunks for data, _, chunks in search_layouts(context) if chunks)
    return sorted(rows)


def _pipeline_chunks(context: ValidationContext, sizes: dict) -> int:
    pipeline = context.configs.get("pipeline_parallel")
    if pipeline is None:
        return 1
    return getattr(pipeline, "chunks", None) or sizes.get("pipeline", 1)
