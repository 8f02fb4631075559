"""ATorch's `auto_accelerate` call, mapped onto atorch's arguments (pure: no process groups, no model work).

ATorch's signature (dlrover bfd04ef1, `atorch/auto/accelerate.py`) is positional in this order::

    auto_accelerate(model, optim_func, dataset, loss_func, prepare_input, model_input_format,
                    optim_args, optim_param_func, dataloader_args, distributed_sampler_cls,
                    excluded, included, load_strategy, lr_scheduler_cls, lr_scheduler_args,
                    finetune_strategy, save_strategy_to_file, **kargs)

with `kargs` holding `sample_batch`, `batch_size`, `expand_sample_batch` (default True),
`sampler_seed` (default 0), `ignore_dryrun_on_load_strategy` and ATorch internals. What
those keywords mean there, and here (`auto_accelerate` calls `translate_atorch_kwargs`
before anything else, so a mistake raises on every rank before any collective):

- `sample_batch` with `batch_size`: a batch standing in for the dataset where none is given,
  for the dry runs only (the search's, and `ignore_dryrun_on_load_strategy=False`); no
  dataloader is made from it, as in ATorch. `batch_size` is its global row count. With
  `expand_sample_batch` (default) `sample_batch` is one sample repeated `batch_size` times;
  without it, it is a batch whose rows are repeated up to `batch_size`. The dry runs read
  it through `SampleBatchDataset` with the global batch `batch_size`, so each data rank
  gets `batch_size // data size` rows, as ATorch's dry runs did.
- `distributed_sampler_cls`: a sampler class with `DistributedSampler`'s constructor, built
  as `cls(dataset, num_replicas=data size, rank=data rank, shuffle=, seed=, drop_last=)`
  (keywords it does not take are left out; `num_replicas` and `rank` are required).
- `sampler_seed`: that sampler's seed (atorch's spelling: `dataloader_args["seed"]`).
- `finetune_strategy`: with `load_strategy`, the configs of every item but `parallel_mode`
  are reset to None, i.e. to each optimization's default, and marked tunable: what ATorch's
  `Strategy.reset_config` did before its tune pass, whose result for these optimizations was
  the config it was given.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from atorch.auto.strategy import Strategy, StrategyItem

logger = logging.getLogger(__name__)

# ATorch's positional parameters after `model`, in order (`**kargs` follows them).
ATORCH_POSITIONAL_ORDER: Tuple[str, ...] = (
    "model", "optim_func", "dataset", "loss_func", "prepare_input", "model_input_format", "optim_args",
    "optim_param_func", "dataloader_args", "distributed_sampler_cls", "excluded", "included", "load_strategy",
    "lr_scheduler_cls", "lr_scheduler_args", "finetune_strategy", "save_strategy_to_file",
)

# kargs keys ATorch read; those without a meaning here are accepted and listed in `ignored`.
_KNOWN_KARGS = ("sample_batch", "batch_size", "expand_sample_batch", "sampler_seed")
_IGNORED_KARGS = ("meta_init_offload_name",)  # ATorch's disk-offload bookkeeping for its own FSDP path
# ATorch optimizations with no counterpart here: excluding one excludes nothing, so ATorch scripts that do
# keep running (any other unknown name in `excluded` is a typo, and raises).
ATORCH_ONLY_OPTIMIZATIONS = ("amp_apex_o1", "amp_apex_o2", "native_dynamo", "mixed_parallel", "sequence_parallel")


@dataclass
class CompatArgs:
    """ATorch's extra `auto_accelerate` keywords, turned into what atorch's entry point uses."""

    sample_batch: Any = None
    """The dry-run stand-in for a dataset (one sample when `expand_sample_batch`, else a batch)."""
    batch_size: Optional[int] = None
    """The global row count of the dry runs' batches when `sample_batch` is given."""
    expand_sample_batch: bool = True
    sampler_seed: Optional[int] = None
    """None: not given (the sampler seed is `dataloader_args.get("seed", 0)`)."""
    finetune_strategy: bool = False
    ignored: Dict[str, Any] = field(default_factory=dict)

    def dataloader_args(self, args: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
        """`args` with `sampler_seed` as atorch's `seed` key; ValueError when both are given and differ."""
        out = dict(args or {})
        if self.sampler_seed is not None:
            if "seed" in out and out["seed"] != self.sampler_seed:
                raise ValueError(f"auto_accelerate: sampler_seed={self.sampler_seed} and dataloader_args['seed']="
                                 f"{out['seed']!r} disagree; pass one of them")
            out["seed"] = self.sampler_seed
        return out

    def dry_run_dataset(self) -> Optional["SampleBatchDataset"]:
        """The dataset the dry runs read when `sample_batch` stands in for one, else None."""
        if self.sample_batch is None:
            return None
        assert self.batch_size is not None  # checked by translate_atorch_kwargs
        return SampleBatchDataset(self.sample_batch, self.batch_size, is_one_sample=self.expand_sample_batch)


def translate_atorch_kwargs(dataset: Any = None, load_strategy: Any = None, distributed_sampler_cls: Any = None,
                            finetune_strategy: bool = False, **kargs: Any) -> CompatArgs:
    """Validate and translate ATorch's extra keywords; TypeError/ValueError naming the keyword otherwise."""
    unknown = [k for k in kargs if k not in _KNOWN_KARGS and k not in _IGNORED_KARGS]
    if unknown:
        raise TypeError(f"auto_accelerate() got unexpected keyword argument(s) {unknown}; ATorch's extra keywords "
                        f"accepted here are {list(_KNOWN_KARGS + _IGNORED_KARGS)}")
    sample_batch = kargs.get("sample_batch")
    batch_size = kargs.get("batch_size")
    expand = kargs.get("expand_sample_batch", True)
    if not isinstance(expand, bool):
        raise ValueError(f"auto_accelerate: expand_sample_batch={expand!r} must be a bool")
    if sample_batch is not None and dataset is not None:
        raise ValueError("auto_accelerate: dataset and sample_batch exclude each other (sample_batch stands in for a "
                         "dataset in dry runs only); pass one")
    if batch_size is not None:
        if sample_batch is None:
            raise ValueError(f"auto_accelerate: batch_size={batch_size!r} sizes sample_batch, which is not given; the "
                             "dataloader's global batch size is dataloader_args['batch_size']")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"auto_accelerate: batch_size={batch_size!r} must be an integer >= 1")
    if sample_batch is not None:
        if batch_size is None:
            raise ValueError("auto_accelerate: sample_batch needs batch_size= (the global number of rows the dry "
                             "runs use), e.g. sample_batch=one_sample, batch_size=16")
        SampleBatchDataset(sample_batch, batch_size, is_one_sample=expand)   # its structure checks
    if distributed_sampler_cls is not None:
        check_sampler_cls(distributed_sampler_cls)
    if not isinstance(finetune_strategy, bool):
        raise TypeError(f"auto_accelerate: finetune_strategy={finetune_strategy!r} must be True or False")
    if finetune_strategy and load_strategy is None:
        raise ValueError("auto_accelerate: finetune_strategy=True tunes a loaded strategy; pass load_strategy too")
    seed = kargs.get("sampler_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"auto_accelerate: sampler_seed={seed!r} must be an int")
    return CompatArgs(sample_batch=sample_batch, batch_size=batch_size, expand_sample_batch=expand,
                      sampler_seed=seed, finetune_strategy=bool(finetune_strategy),
                      ignored={k: kargs[k] for k in _IGNORED_KARGS if k in kargs})


def check_sampler_cls(sampler_cls: Any) -> None:
    """ValueError unless `sampler_cls` can be built as `cls(dataset, num_replicas=, rank=, ...)`.

    A class that wraps a sampler (`DistributedProxySampler(sampler, ...)`, or any whose first parameter is
    named `sampler`) is refused: given the dataset in place of a sampler it would yield the dataset's
    samples as indices, which fails only at the first batch.
    """
    from atorch.data.samplers import DistributedProxySampler

    name = getattr(sampler_cls, "__name__", repr(sampler_cls))
    if not callable(sampler_cls):
        raise ValueError(f"auto_accelerate: distributed_sampler_cls={sampler_cls!r} must be a sampler class taking "
                         "(dataset, num_replicas=, rank=, shuffle=, seed=)")
    params: Optional[Mapping[str, inspect.Parameter]]
    try:
        params = inspect.signature(sampler_cls).parameters
    except (TypeError, ValueError):  # a builtin: nothing more to check
        params = None
    wraps_sampler = isinstance(sampler_cls, type) and issubclass(sampler_cls, DistributedProxySampler)
    if wraps_sampler or next(iter(params or {}), None) == "sampler":
        raise ValueError(f"auto_accelerate: distributed_sampler_cls {name} wraps a sampler, but atorch builds "
                         "distributed_sampler_cls(dataset, num_replicas=, rank=, shuffle=, seed=, drop_last=) with the "
                         f"dataset; pass a callable taking the dataset, e.g. distributed_sampler_cls=lambda dataset, "
                         f"**kw: {name}(MySampler(dataset), **kw), or leave it out for DistributedSampler")
    if params is None:
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in ("num_replicas", "rank") if k not in params]
    if missing:
        raise ValueError(f"auto_accelerate: distributed_sampler_cls {name} takes no {missing}; it must take "
                         "DistributedSampler's (dataset, num_replicas=, rank=, ...) because atorch builds it with "
                         "the data-parallel size and rank")


class SampleBatchDataset(torch.utils.data.Dataset):
    """`length` rows read from ATorch's `sample_batch`: the sample itself, or row `i % rows` of a batch.

    The default collate stacks the rows back into batches, so a data rank's batch equals
    `expand_batch_dim(sample, rows per rank)` (one sample) or the batch's rows (a batch).
    """

    def __init__(self, sample: Any, length: int, is_one_sample: bool = True):
        self.sample, self.length, self.is_one_sample = sample, length, is_one_sample
        tensors = _tensors(sample)
        if not tensors:
            raise ValueError(f"auto_accelerate: sample_batch holds no tensor ({type(sample).__name__}); pass the "
                             "model input (a tensor, or a dict/list/tuple of tensors)")
        if is_one_sample:
            self.rows = 1
        else:
            rows = {t.shape[0] if t.dim() else None for t in tensors}
            if len(rows) != 1 or None in rows:
                raise ValueError(f"auto_accelerate: expand_sample_batch=False needs a batch whose tensors share the "
                                 f"leading (batch) dimension; got leading sizes {sorted(map(str, rows))}")
            self.rows = int(next(iter(rows)))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.length:
            raise IndexError(index)
        if self.is_one_sample:
            return self.sample
        from atorch.common.util_func import apply_to_tensors

        row = index % self.rows
        return apply_to_tensors(lambda t: t[row], self.sample)


def _tensors(data: Any) -> list:
    found: list = []
    from atorch.common.util_func import apply_to_tensors

    apply_to_tensors(found.append, data)
    return found


def drop_atorch_only_names(excluded: Optional[Sequence[str]]) -> Optional[List[str]]:
    """`excluded` without the ATorch optimizations atorch does not have (logged once when there are some)."""
    if excluded is None:
        return None
    dropped = [n for n in excluded if n in ATORCH_ONLY_OPTIMIZATIONS]
    if dropped:
        logger.info("excluded=%s: %s are ATorch optimizations atorch does not have; nothing to exclude for them",
                    list(excluded), dropped)
    return [n for n in excluded if n not in ATORCH_ONLY_OPTIMIZATIONS]


def finetune_strategy_items(strategy: Strategy) -> Strategy:
    """ATorch's `reset_config`: every item but `parallel_mode` gets config None (its default), tunable."""
    return Strategy(i if i.name == "parallel_mode" else StrategyItem(i.name, None, True) for i in strategy)


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


__all__ = ["ATORCH_POSITIONAL_ORDER", "CompatArgs", "SampleBatchDataset", "bind_atorch_positional",
           "check_sampler_cls", "finetune_strategy_items", "translate_atorch_kwargs"]

