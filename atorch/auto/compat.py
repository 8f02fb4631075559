"""ATorch's `auto_accelerate` call, mapped onto atorch's arguments (pure: no process groups, no model work).

ATorch's signature (dlrover bfd04ef1, `atorch/auto/accelerate.py`) is positional in this order::

    auto_accelerate(model, optim_func, dataset, loss_func, prepare_input, model_input_format,
                    optim_args, optim_param_func, dataloader_args, distributed_sampler_cls,
                    excluded, included, load_strategy, lr_scheduler_cls, lr_scheduler_args,
                    finetune_strategy, save_strategy_to_file, **kargs)

with `kargs` holding `sample_batch`, `batch_size`, `expand_sample_batch` (default True),
`sampler_seed` (default 0), `ignore_dryrun_on_load_strategy` and ATorch internals. What
those keywords mean there, and here:

- `sample_batch`: one sample (or batch) standing in for the dataset where none is given,
  used by the planner's dry runs only; ATorch creates no dataloader from it and refuses it
  together with `dataset`. With `expand_sample_batch` (default) it is one sample, expanded
  to `batch_size` rows (`atorch.data.expand_batch_dim`). -> `CompatArgs.sample_batch`.
- `batch_size`: the global row count of that expanded sample batch, not the dataloader's
  batch size (that is `dataloader_args["batch_size"]`, global in both systems).
- `distributed_sampler_cls`: a sampler class with `DistributedSampler`'s constructor,
  built as `cls(dataset, shuffle=..., num_replicas=data size, rank=data rank, seed=sampler_seed)`
  instead of torch's -> `build_distributed_sampler`.
- `finetune_strategy`: with `load_strategy`, the configs of the tunable items are reset to
  None so the planner chooses them again -> `finetune_strategy_items`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from atorch.auto.strategy import Strategy, StrategyItem

# ATorch's positional parameters after `model`, in order (`**kargs` follows them).
ATORCH_POSITIONAL_ORDER: Tuple[str, ...] = (
    "model", "optim_func", "dataset", "loss_func", "prepare_input", "model_input_format", "optim_args",
    "optim_param_func", "dataloader_args", "distributed_sampler_cls", "excluded", "included", "load_strategy",
    "lr_scheduler_cls", "lr_scheduler_args", "finetune_strategy", "save_strategy_to_file",
)

# kargs keys ATorch read; those without a meaning here are accepted and listed in `ignored`.
_KNOWN_KARGS = ("sample_batch", "batch_size", "expand_sample_batch", "sampler_seed",
                "ignore_dryrun_on_load_strategy")
_IGNORED_KARGS = ("meta_init_offload_name",)  # ATorch's disk-offload bookkeeping for its own FSDP path


@dataclass
class CompatArgs:
    """ATorch's extra `auto_accelerate` keywords, turned into what atorch's entry point uses."""

    sample_batch: Any = None
    """The dry-run stand-in for a dataset (already expanded to `batch_size` rows when asked)."""
    sampler_cls: Optional[Callable[..., Any]] = None
    sampler_seed: int = 0
    finetune_strategy: bool = False
    ignore_dryrun_on_load_strategy: Optional[bool] = None
    ignored: Dict[str, Any] = field(default_factory=dict)


def translate_atorch_kwargs(dataset: Any = None, load_strategy: Any = None, distributed_sampler_cls: Any = None,
                            finetune_strategy: bool = False, **kargs: Any) -> CompatArgs:
    """Validate and translate ATorch's extra keywords; ValueError naming the keyword otherwise."""
    unknown = [k for k in kargs if k not in _KNOWN_KARGS and k not in _IGNORED_KARGS]
    if unknown:
        raise ValueError(f"auto_accelerate: unknown keyword argument(s) {unknown}; ATorch's extra keywords accepted "
                         f"here are {list(_KNOWN_KARGS + _IGNORED_KARGS)}")
    sample_batch = kargs.get("sample_batch")
    batch_size = kargs.get("batch_size")
    if sample_batch is not None and dataset is not None:
        raise ValueError("auto_accelerate: dataset and sample_batch exclude each other (sample_batch stands in for a "
                         "dataset in dry runs only); pass one")
    if batch_size is not None:
        if sample_batch is None:
            raise ValueError(f"auto_accelerate: batch_size={batch_size!r} sizes sample_batch, which is not given; the "
                             "dataloader's global batch size is dataloader_args['batch_size']")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"auto_accelerate: batch_size={batch_size!r} must be an integer >= 1")
    if sample_batch is not None and kargs.get("expand_sample_batch", True) and batch_size is not None:
        from atorch.data.batch_utils import expand_batch_dim

        sample_batch = expand_batch_dim(sample_batch, batch_size)
    if distributed_sampler_cls is not None and not callable(distributed_sampler_cls):
        raise ValueError(f"auto_accelerate: distributed_sampler_cls={distributed_sampler_cls!r} must be a sampler "
                         "class taking (dataset, shuffle=, num_replicas=, rank=, seed=)")
    if finetune_strategy and load_strategy is None:
        raise ValueError("auto_accelerate: finetune_strategy=True tunes a loaded strategy; pass load_strategy too")
    seed = kargs.get("sampler_seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"auto_accelerate: sampler_seed={seed!r} must be an int")
    ignore_dryrun = kargs.get("ignore_dryrun_on_load_strategy")
    return CompatArgs(sample_batch=sample_batch, sampler_cls=distributed_sampler_cls, sampler_seed=seed,
                      finetune_strategy=bool(finetune_strategy), ignore_dryrun_on_load_strategy=ignore_dryrun,
                      ignored={k: kargs[k] for k in _IGNORED_KARGS if k in kargs})


def build_distributed_sampler(sampler_cls: Callable[..., Any], dataset: Any, num_replicas: int, rank: int,
                              shuffle: bool = True, seed: int = 0) -> Any:
    """`sampler_cls(dataset, shuffle=, num_replicas=, rank=, seed=)`, as ATorch builds a custom sampler.

    The keywords the class does not take are left out (`seed` is optional in ATorch's samplers);
    `num_replicas` and `rank` are the data-parallel size and rank.
    """
    kwargs: Dict[str, Any] = {"shuffle": shuffle, "num_replicas": num_replicas, "rank": rank, "seed": seed}
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(sampler_cls).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = [k for k in ("num_replicas", "rank") if k not in params]
        if missing:
            raise ValueError(f"distributed_sampler_cls {getattr(sampler_cls, '__name__', sampler_cls)} takes no "
                             f"{missing}; it must take DistributedSampler's (dataset, num_replicas=, rank=, ...)")
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return sampler_cls(dataset, **kwargs)


def finetune_strategy_items(strategy: Strategy) -> Strategy:
    """The strategy with the configs of its tunable items reset to None (the planner picks them again)."""
    return Strategy(StrategyItem(i.name, None if i.tunable else i.config, i.tunable) for i in strategy)


def bind_atorch_positional(*args: Any, **kwargs: Any) -> Dict[str, Any]:
    """Name the arguments of an ATorch-style call: positional ones in `ATORCH_POSITIONAL_ORDER`, then keywords.

    Raises TypeError like Python would for too many positional arguments or a duplicate.
    """
    if len(args) > len(ATORCH_POSITIONAL_ORDER):
        raise TypeError(f"auto_accelerate takes at most {len(ATORCH_POSITIONAL_ORDER)} positional arguments "
                        f"({', '.join(ATORCH_POSITIONAL_ORDER)}), got {len(args)}")
    bound = dict(zip(ATORCH_POSITIONAL_ORDER, args))
    duplicate = [k for k in kwargs if k in bound]
    if duplicate:
        raise TypeError(f"auto_accelerate got multiple values for argument(s) {duplicate}")
    bound.update(kwargs)
    return bound
