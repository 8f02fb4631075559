"""Checks of `auto_accelerate`'s arguments: pure, identical on every rank, run before any collective.

A mistake in the arguments (a batch size of 0, an optimizer keyword the optimizer does not
take, a dataset shorter than one global batch, a sequence longer than the model's positions,
a strategy file into a missing directory, ...) raises `ValueError` (a wrong value) or
`TypeError` (a wrong kind of object) naming the argument, its value and what is expected.
Nothing here touches the network or the model's weights; the filesystem only through `os.path`
queries and one probe file created and removed where an output file will go (`os.access` says yes
to root in a read-only directory such as /proc). The verdicts are voted on across ranks, so none
is left waiting in a collective.

- `validate_arguments`: everything that does not depend on the strategy (called first).
- `check_dry_run_batches`: the search or the dry run asked for has batches (a dataset).
- `validate_batch_layout`: the global batch against the chosen data-parallel size and
  pipeline chunks (called once the strategy is resolved, still before it is applied).
- `check_loss`: the loss function's result at use (a non-scalar loss named with its shape);
  `check_optimizer`: what `optim_func` returned (an optimizer, or a TypeError naming it).
(TPInfo suffixes that match modules of different shapes: `atorch.utils.tp_checks`.)
"""

from __future__ import annotations

import collections
import difflib
import inspect
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from atorch.auto.token_limits import check_token_range, position_limit, token_limits
from atorch.auto.user_errors import UserTypeError, UserValueError

if TYPE_CHECKING:
    from atorch.auto.opt_lib.base import ValidationContext

logger = logging.getLogger(__name__)

# `sample` not given: the check reads dataset[0] itself.
_UNREAD = object()
# The global batch size when dataloader_args has no "batch_size": torch's DataLoader default.
DEFAULT_GLOBAL_BATCH = 1
# Keys of `dataloader_args` that `build_dataloader` handles itself (the rest go to DataLoader).
_OWN_DATALOADER_KEYS = ("batch_size", "shuffle", "seed", "drop_last")
# DataLoader keywords atorch sets itself: a user value would be silently replaced.
_RESERVED_DATALOADER_KEYS = ("dataset", "sampler", "batch_sampler")


def _check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model the user already wrapped for distributed training: atorch wraps it itself, so DDP inside
    DDP reduced every gradient twice, and a model sharded by FSDP2's `fully_shard` (DTensor parameters) failed
    later with a misleading message (weights "differ across ranks") or inside DDP."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise TypeError(f"model is already a DistributedDataParallel (around {type(model.module).__name__}); pass "
                        "model.module: auto_accelerate wraps the model for the strategy it applies")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise TypeError(f"model is already sharded by torch's fully_shard ({name or 'the root'}: "
                            f"{type(module).__name__}); pass the model before fully_shard: auto_accelerate shards "
                            "it itself under zero2 / fsdp")
        if isinstance(module, DistributedDataParallel) or type(module).__name__ == "FullyShardedDataParallel":
            raise TypeError(f"model holds {name!r}, already wrapped in {type(module).__name__}; pass the module it "
                            "wraps: auto_accelerate wraps the model for the strategy it applies")
    dtensors = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise TypeError(f"model has DTensor parameters (e.g. {dtensors[0]!r}): it is already sharded (fully_shard, "
                        "or a tensor-parallel plan applied); pass the plain model: auto_accelerate shards it for the "
                        "strategy it applies")


def validate_arguments(
    *,
    model: Any,
    optim_func: Any = None,
    dataset: Any = None,
    model_input_format: Optional[str] = None,
    loss_func: Any = None,
    prepare_input: Any = None,
    optim_args: Any = None,
    optim_param_func: Any = None,
    dataloader_args: Any = None,
    lr_scheduler_cls: Any = None,
    lr_scheduler_args: Any = None,
    save_strategy_to_file: Any = None,
    report_path: Any = None,
    excluded: Any = None,
    included: Any = None,
) -> None:
    """Raise ValueError/TypeError naming the first argument of `auto_accelerate` that cannot work."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_describe(model)}")
    _check_not_wrapped(model)
    for name, value in (("loss_func", loss_func), ("prepare_input", prepare_input),
                        ("optim_param_func", optim_param_func)):
        _check_callable(name, value)
    # How atorch calls them (train_step): loss_func(batch, model_output), prepare_input(batch, device).
    _check_takes("loss_func", loss_func, "(batch, model_output)", 2)
    _check_takes("prepare_input", prepare_input, "(batch, device)", 2)
    _check_takes("optim_param_func", optim_param_func, "(model)", 1)
    _check_factory("optim_func", optim_func, "optim_args", optim_args, skip_first=1)
    _check_takes("optim_func", optim_func, "(parameters, **optim_args)", 1, dict(optim_args or {}))
    if optim_args and optim_func is None:
        raise ValueError(f"optim_args={dict(optim_args)!r} were given without optim_func; pass optim_func (e.g. "
                         "torch.optim.AdamW) or drop optim_args")
    if optim_func is not None and optim_param_func is not None:
        check_optim_params_in_model(model, optim_param_func)
    if optim_func is not None and optim_param_func is None and not any(True for _ in model.parameters()):
        raise ValueError(f"model {type(model).__name__} has no parameters, so optim_func={_name(optim_func)} would "
                         "get an empty parameter list")
    _check_factory("lr_scheduler_cls", lr_scheduler_cls, "lr_scheduler_args", lr_scheduler_args, skip_first=1)
    if lr_scheduler_args and lr_scheduler_cls is None:
        raise ValueError(f"lr_scheduler_args={dict(lr_scheduler_args)!r} were given without lr_scheduler_cls; pass "
                         "lr_scheduler_cls (e.g. torch.optim.lr_scheduler.StepLR) or drop lr_scheduler_args")
    if lr_scheduler_cls is not None and optim_func is None:
        raise ValueError(f"lr_scheduler_cls={_name(lr_scheduler_cls)} needs an optimizer; pass optim_func too")
    if isinstance(lr_scheduler_cls, type) and issubclass(lr_scheduler_cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # train_step and DeepSpeed engines call step() without arguments, once per optimizer step.
        raise ValueError(f"lr_scheduler_cls={_name(lr_scheduler_cls)} steps on a metric (step(metrics)), but "
                         "train_step and DeepSpeed engines step the scheduler once per optimizer step without one; "
                         "leave lr_scheduler_cls out and build it on result.optim yourself, calling "
                         "scheduler.step(val_loss) in your loop")
    args = _check_mapping("dataloader_args", dataloader_args)
    global_batch = args.get("batch_size", DEFAULT_GLOBAL_BATCH)
    _check_batch_size(global_batch)
    _check_dataloader_keys(args)
    if dataset is not None:
        # dataset[0] read once for every check of it (a dataset may tokenize on every read).
        sample = _check_dataset(dataset, global_batch, args.get("drop_last", True))
        check_sequence_length(model, dataset, sample=sample)
        check_sample_format(dataset, model_input_format, args, prepare_input, model, sample=sample)
    _check_report_path(report_path)
    _check_output_path("save_strategy_to_file", save_strategy_to_file, created_dir=_report_directory(report_path))
    for name, value in (("excluded", excluded), ("included", included)):
        if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)
                                  or not all(isinstance(v, str) for v in value)):
            raise TypeError(f"{name}={value!r} must be a list of optimization names, e.g. ['fsdp', 'amp_native']")
        _check_optimization_names(name, value)


def _check_optimization_names(argument: str, names: Optional[Iterable[str]]) -> None:
    """Every name of `excluded`/`included` is an optimization (or one of ATorch's that atorch does not
    have): a typo raises even when `load_strategy` makes the list unused, so it does not go unnoticed
    until the search is run."""
    from atorch.auto.compat import ATORCH_ONLY_OPTIMIZATIONS
    from atorch.auto.opt_lib.base import default_registry

    default_registry().canonical_names(argument, names, ignore=ATORCH_ONLY_OPTIMIZATIONS)


def check_dry_run_batches(*, has_batches: bool, load_strategy_given: bool, ignore_dryrun_on_load_strategy: Any) -> None:
    """The dry runs `auto_accelerate` is asked for have batches to train on: the search (no
    load_strategy) dry-runs its candidates, and `ignore_dryrun_on_load_strategy=False` the loaded
    strategy, on batches of `dataset` (or of ATorch's `sample_batch`). Without either every dry run
    would fail after the model was built: refused here instead."""
    if not isinstance(ignore_dryrun_on_load_strategy, bool):
        raise TypeError(f"ignore_dryrun_on_load_strategy={ignore_dryrun_on_load_strategy!r} must be True or False")
    if has_batches:
        return
    if not load_strategy_given:
        raise ValueError("auto_accelerate: load_strategy=None searches for a strategy by dry-running candidates on "
                         "batches of the dataset, but no dataset was given; pass dataset= (or ATorch's sample_batch= "
                         "with batch_size=), or pass load_strategy (e.g. load_strategy=['fsdp']) to apply a strategy "
                         "without a search")
    if not ignore_dryrun_on_load_strategy:
        raise ValueError("auto_accelerate: ignore_dryrun_on_load_strategy=False dry-runs the loaded strategy on "
                         "batches of the dataset, but no dataset was given; pass dataset= (or ATorch's sample_batch= "
                         "with batch_size=), or leave ignore_dryrun_on_load_strategy=True to apply the strategy "
                         "without a dry run")


class BatchLayoutError(ValueError):
    """The global batch does not split over a strategy's data ranks or pipeline chunks."""


def validate_resolved_layout(dataloader_args: Optional[Mapping], context: "ValidationContext") -> None:
    """`validate_batch_layout` for a strategy just resolved against `context` (its parallel sizes,
    and the chunks of its pipeline: its own setting, else one per stage)."""
    sizes = context.parallel_sizes()
    pipeline = context.configs.get("pipeline_parallel")
    validate_batch_layout(dataloader_args, sizes, (pipeline.chunks or sizes.get("pipeline")) if pipeline else None)


def validate_batch_layout(dataloader_args: Optional[Mapping], parallel_sizes: Mapping[str, int],
                          pipeline_chunks: Optional[int] = None) -> None:
    """The global batch size splits evenly over the data-parallel ranks (and into pipeline chunks).

    `auto_accelerate` has already written the default batch size (1) where a dataloader is built
    (`accelerate.default_batch_size`); a batch size still absent means no dataloader, or a batch
    that deepspeed_3d_parallel takes from its ds_config (and checks itself): nothing to check here.
    """
    global_batch = dict(dataloader_args or {}).get("batch_size")
    if global_batch is None:
        return
    dp = int(parallel_sizes.get("data", 1))
    if global_batch % dp != 0:
        raise BatchLayoutError(f"dataloader_args['batch_size']={global_batch} (the global batch size) is not "
                               f"divisible by the data-parallel size {dp} (parallel dims {dict(parallel_sizes)}); "
                               f"use a multiple of {dp}")
    if pipeline_chunks is not None and (global_batch // dp) % pipeline_chunks != 0:
        raise BatchLayoutError(f"pipeline_parallel chunks={pipeline_chunks} does not divide the "
                               f"{global_batch // dp} rows per data-parallel rank (dataloader_args['batch_size']="
                               f"{global_batch} over data size {dp}); use a global batch size that is a multiple of "
                               f"{pipeline_chunks * dp}")


def check_loss(loss: Any, func: Optional[Callable]) -> torch.Tensor:
    """The loss `func` returned, refused unless it is a one-element tensor (backward needs a scalar)."""
    who = f"loss_func {_name(func)}" if func is not None else "the model output's .loss (loss_func=None)"
    if not isinstance(loss, torch.Tensor):
        raise UserTypeError(f"{who} returned {_describe(loss)}; it must return a scalar torch.Tensor "
                            "(or a sequence whose first item is one)")
    if loss.numel() != 1:
        raise UserValueError(f"{who} returned a loss of shape {tuple(loss.shape)}; it must return a scalar "
                             "(reduce it, e.g. with .mean())")
    return loss


def check_optimizer(optim: Any, func: Any) -> Any:
    """What `optim_func` returned, refused unless it is an optimizer (anything else fails at the first step)."""
    is_optimizer = isinstance(optim, torch.optim.Optimizer) or (
        callable(getattr(optim, "step", None)) and callable(getattr(optim, "zero_grad", None))
        and isinstance(getattr(optim, "param_groups", None), list))
    if not is_optimizer:
        raise TypeError(f"optim_func={_name(func)} returned {_describe(optim)}; it must return a "
                        "torch.optim.Optimizer over the parameters it is given (e.g. torch.optim.AdamW)")
    return optim


def check_sample_format(dataset: Any, model_input_format: Optional[str], dataloader_args: Mapping[str, Any],
                        prepare_input: Any, model: Optional[nn.Module] = None, sample: Any = _UNREAD) -> None:
    """dataset[0] has the shape `model_input_format` unpacks (a dict for 'unpack_dict', a sequence for
    'unpack_sequence'), and for a Hugging Face model taking `input_ids` one it can be called with (`model`), its
    token ids inside the vocabulary and, for a causal LM (whose forward computes its loss from them), its labels;
    skipped when a collate_fn or prepare_input may reshape the batch. A dataset that cannot be indexed by 0
    raises TypeError (`first_sample`); `sample`: dataset[0] when the caller has read it."""
    if dataset is None or prepare_input is not None or dataloader_args.get("collate_fn") is not None:
        return
    if sample is _UNREAD:
        sample = first_sample(dataset)
    if model is not None:
        _check_token_model_sample(model, sample, model_input_format)
    if model_input_format == "unpack_dict" and not isinstance(sample, Mapping):
        raise TypeError(f"model_input_format='unpack_dict' calls model(**batch), but dataset[0] is "
                        f"{_describe(sample)}; return a dict such as {{'input_ids': ..., 'labels': ...}} from the "
                        "dataset, or pass collate_fn in dataloader_args or prepare_input")
    if model_input_format == "unpack_sequence" and (not isinstance(sample, (tuple, list))
                                                    or isinstance(sample, (str, bytes))):
        raise TypeError(f"model_input_format='unpack_sequence' calls model(*batch), but dataset[0] is "
                        f"{_describe(sample)}; return a tuple or list of model inputs from the dataset, or pass "
                        "collate_fn in dataloader_args or prepare_input")


def _check_token_model_sample(model: nn.Module, sample: Any, model_input_format: Optional[str]) -> None:
    """For a Hugging Face model whose forward takes `input_ids`: a tuple sample under the default format is
    passed whole (model(batch)) and failed inside the embedding ("argument 'indices' must be Tensor, not
    list"); a dict naming none of the forward's inputs (untokenized {'text': ...}) failed inside transformers
    ("You must specify exactly one of input_ids or inputs_embeds"); ids given as lists (a `datasets.Dataset`
    without `.with_format('torch')`) were turned by torch's collate into one tensor per position; ids or
    labels outside the vocabulary failed (or trained silently wrong) at the first step (`check_token_range`).
    Keys the forward does not name are warned about (`_warn_unknown_keys`)."""
    from atorch.auto.train_step import is_causal_lm, takes_token_ids

    if not takes_token_ids(model):
        return
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    accepted = set(parameters)
    if "input_ids" not in accepted:
        return
    name = type(model).__name__
    if model_input_format is None and isinstance(sample, (tuple, list)):
        raise TypeError(f"dataset[0] is {_describe(sample)}, and with model_input_format=None a batch that is not a "
                        f"dict is passed to the model as one argument, which {name} cannot take: return a dict such "
                        "as {'input_ids': ..., 'labels': ...} from the dataset, or pass "
                        "model_input_format='unpack_sequence' to call model(*batch)")
    if isinstance(sample, Mapping) and model_input_format in (None, "unpack_dict") and not set(sample) & accepted:
        texts = [k for k, v in sample.items() if isinstance(v, str)]
        hint = (f" ({texts[0]!r} holds text: tokenize it first, e.g. with the model's tokenizer in the dataset or "
                "`atorch preprocess` for a Megatron-format corpus)" if texts else "")
        raise TypeError(f"dataset[0] has keys {sorted(map(str, sample))[:8]}, none of which {name}.forward takes; it "
                        f"needs 'input_ids' (token ids) and, to compute a loss, 'labels'{hint}; or pass a collate_fn "
                        "in dataloader_args (or prepare_input) that builds them")
    if not isinstance(sample, Mapping) or model_input_format not in (None, "unpack_dict"):
        return
    listed = [k for k in ("input_ids", "labels") if isinstance(sample.get(k), (list, tuple))]
    if listed:
        raise TypeError(f"dataset[0][{listed[0]!r}] is a {type(sample[listed[0]]).__name__}, not a tensor: torch's "
                        "default collate would make one tensor per position of it, not a [rows, tokens] batch. Return "
                        "tensors from the dataset (a Hugging Face datasets.Dataset: dataset.with_format('torch')), or "
                        "pass dataloader_args={'collate_fn': ...} that builds them (e.g. transformers' "
                        "DataCollatorForLanguageModeling)")
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        _warn_unknown_keys(name, sample, [p for p, v in parameters.items()
                                          if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)])
    check_token_range(sample, name, token_limits(model), labels=is_causal_lm(model), where="dataset[0]")


def _warn_unknown_keys(model_name: str, sample: Mapping, named: List[str]) -> None:
    """Warn (rank 0) about keys of dataset[0] that `model_name`.forward does not name: a forward taking **kwargs
    (every transformers model does) drops them silently, so a typo (`attention_masks`) or a key another model
    family takes (`token_type_ids` on Llama) trained as if it were not there. A warning, not an error: the
    **kwargs may be meant to take them."""
    from atorch import distributed as adist

    unknown = [str(k) for k in sample if k not in named]
    if not unknown or adist.rank() != 0:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, named, n=1, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    logger.warning("dataset[0] has key(s) %s that %s.forward does not name; it takes them into **kwargs, where "
                   "they are likely ignored: the model trains as if they were not in the batch. Rename or drop "
                   "them (its named inputs: %s)", ", ".join(hints), model_name, ", ".join(named[:12]))


def check_sample_batch(stand_in: Any, expand: bool, model: nn.Module, model_input_format: Optional[str],
                       prepare_input: Any) -> None:
    """ATorch's `sample_batch` (the dry runs' stand-in dataset, `stand_in`), checked like a dataset before anything
    runs: each mistake ended every dry run with status=False and the reason only in the log. One sample where
    `expand` (ATorch's default: repeated batch_size times), so a batch there (token ids of [rows, tokens]) is
    refused; then a batch of two stand-in rows goes through train_step's batch checks (integer ids, labels
    shaped like them, ids inside the vocabulary)."""
    from torch.utils.data import default_collate

    from atorch.auto.train_step import check_batch, is_causal_lm, takes_token_ids

    try:
        check_sample_format(stand_in, model_input_format, {}, prepare_input, model)
    except (TypeError, ValueError) as e:
        text = str(e).replace("dataset[0][", "sample_batch[") \
            .replace("dataset[0]", "sample_batch (the dry runs' dataset[0])")
        raise type(e)(text) from None
    if prepare_input is not None:
        return      # it may make model input of anything
    sample = stand_in[0]
    ids = sample.get("input_ids") if isinstance(sample, Mapping) else None
    if expand and takes_token_ids(model) and isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        raise ValueError(f"sample_batch['input_ids'] has shape {tuple(ids.shape)}, a batch; with expand_sample_batch="
                         "True (ATorch's default) sample_batch is one sample, repeated batch_size times: pass one "
                         "sample (each tensor's row 0), or expand_sample_batch=False to read it as a batch")
    if not isinstance(sample, Mapping):
        return
    batch = default_collate([stand_in[i] for i in range(min(2, len(stand_in)))])
    try:
        check_batch(batch, is_causal_lm(model), takes_token_ids(model))
        check_token_range(batch, type(model).__name__, token_limits(model), labels=is_causal_lm(model))
    except ValueError as e:
        raise ValueError(str(e).replace("train_step: ", "").replace("batch[", "sample_batch[")) from None


def check_optim_params_in_model(model: nn.Module, optim_param_func: Callable[[nn.Module], Any]) -> None:
    """What `optim_param_func(model)` returns are parameters of `model` (checked by identity, on the model as given,
    before any optimization replaces its parameters).

    A tensor from elsewhere (a parameter of a copy of the model, a new nn.Parameter) would be what the
    optimizer updates while the model's weights never change: training would run and learn nothing.
    Accepts what torch optimizers take: tensors, (name, tensor) pairs, or groups {"params": ...}. An empty
    result is left to the optimizer (an optimization such as lora adds the parameters the function may pick),
    and so is a function that fails on the unwrapped model (it is called again on the wrapped one).
    """
    try:
        result = optim_param_func(model)
        returned = [] if isinstance(result, (torch.Tensor, Mapping)) else list(result)
    except Exception:  # noqa: BLE001 - the real call, on the model the strategy built, reports it
        return
    tensors = []
    for item in returned:
        if isinstance(item, Mapping):      # a parameter group
            item = item.get("params", ())
        item = _unnamed(item)
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            continue
        try:
            tensors.extend(_unnamed(member) for member in item)
        except TypeError:
            continue   # not a collection of parameters: the optimizer names it
    own = {id(p) for p in model.parameters()}
    foreign = [t for t in tensors if isinstance(t, torch.Tensor) and id(t) not in own]
    _check_no_parameter_twice(model, optim_param_func, [t for t in tensors if isinstance(t, torch.Tensor)])
    if foreign:
        first = foreign[0]
        raise ValueError(f"optim_param_func={_name(optim_param_func)} returned {len(foreign)} "
                         f"tensor(s) that are not parameters of the model (the first: {type(first).__name__} of shape "
                         f"{tuple(first.shape)}); the optimizer would update them and never the model's weights, so "
                         "the model would not train. Return parameters of the model it is given (e.g. from "
                         "model.parameters() or model.named_parameters())")


def _check_no_parameter_twice(model: nn.Module, optim_param_func: Callable, tensors: List[torch.Tensor]) -> None:
    """ValueError naming a parameter `optim_param_func` returned more than once (twice in one group, or in two
    groups): the optimizer would step it once per occurrence, doubling its update, where torch only warns (one
    group) or names no parameter (two groups)."""
    seen = collections.Counter(id(t) for t in tensors)
    repeated = [(name, seen[id(p)]) for name, p in model.named_parameters() if seen[id(p)] > 1]
    if repeated:
        name, count = repeated[0]
        more = f" (and {len(repeated) - 1} more)" if len(repeated) > 1 else ""
        raise ValueError(f"optim_param_func={_name(optim_param_func)} returned the parameter {name!r} {count} times"
                         f"{more}; the optimizer would update it once per occurrence, {count}x its step. Return each "
                         "parameter once (in one parameter group); to give it another learning rate, put it in a "
                         "group of its own and leave it out of the others")


def check_sequence_length(model: nn.Module, dataset: Any, sample: Any = _UNREAD) -> None:
    """The first sample's `input_ids` fits the model's position embeddings (when both are known); `sample`:
    dataset[0] when the caller has read it."""
    limit = position_limit(getattr(model, "config", None))
    if limit is None or not hasattr(dataset, "__getitem__"):
        return
    if sample is _UNREAD:
        sample = first_sample(dataset)
    ids = sample.get("input_ids") if isinstance(sample, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        length = ids.shape[-1]
    elif isinstance(ids, (list, tuple)):
        length = len(ids)
    else:
        return
    field, value = limit
    if length > value:
        raise ValueError(f"dataset[0]['input_ids'] has {length} tokens, more than the model's {field}={value} "
                         f"({type(model).__name__}); cut the sequences to at most {value} tokens")


# -- helpers -----------------------------------------------------------------------------

def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _unnamed(item: Any) -> Any:
    """The tensor of a (name, tensor) pair (torch optimizers take named parameters), else `item`."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return item[1]
    return item


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {_describe(value)}")


def _check_mapping(name: str, value: Any) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict or None, got {_describe(value)}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{name} keys must be strings, got {bad[:3]}")
    return dict(value)


def _check_takes(name: str, func: Any, how: str, positional: int, keywords: Optional[Dict[str, Any]] = None) -> None:
    """`func` can be called with `positional` positional arguments and `keywords` (as atorch calls it: `how`);
    e.g. an optim_func of no arguments (lambda: SGD(...)) failed while the strategy was applied."""
    if func is None:
        return
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    try:
        signature.bind(*range(positional), **(keywords or {}))
    except TypeError as e:
        raise TypeError(f"{name}={_name(func)}{signature} cannot be called as {name}{how}, which is how atorch "
                        f"calls it: {e}") from e


def _check_factory(name: str, factory: Any, args_name: str, args: Any, skip_first: int) -> None:
    """`factory(first, **args)` can be called: factory is callable and takes every key of `args`."""
    _check_callable(name, factory)
    kwargs = _check_mapping(args_name, args)
    if factory is None or not kwargs:
        return
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params[skip_first:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ValueError(f"{args_name}={kwargs!r} has key(s) {unknown} that {name}={_name(factory)} does not take; "
                         f"it takes {accepted}")
    for p in params[skip_first:]:
        default = p.default
        number = isinstance(default, (int, float)) and not isinstance(default, bool)
        if p.name in kwargs and number and isinstance(kwargs[p.name], (str, bytes)):
            # A number read from a config file as text ('1e-3'): the callee would fail on a comparison.
            raise TypeError(f"{args_name}[{p.name!r}]={kwargs[p.name]!r} is a string; {name}={_name(factory)} takes "
                            f"a number there (its default is {default!r})")


def _check_batch_size(global_batch: Any) -> None:
    if not isinstance(global_batch, int) or isinstance(global_batch, bool):
        raise TypeError(f"dataloader_args['batch_size']={global_batch!r} must be an int (the global batch size)")
    if global_batch < 1:
        raise ValueError(f"dataloader_args['batch_size']={global_batch} must be >= 1 (the global batch size, "
                         "split over the data-parallel ranks)")


def _check_dataloader_keys(args: Dict[str, Any]) -> None:
    from torch.utils.data import DataLoader

    for key in ("shuffle", "drop_last"):
        if key in args and not isinstance(args[key], bool):
            raise TypeError(f"dataloader_args[{key!r}]={args[key]!r} must be True or False")
    for key in ("collate_fn", "worker_init_fn"):
        if args.get(key) is not None and not callable(args[key]):
            raise TypeError(f"dataloader_args[{key!r}]={args[key]!r} must be callable or None")
    seed = args.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"dataloader_args['seed']={seed!r} must be an int (the sampler's shuffling seed)")
    workers = args.get("num_workers", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"dataloader_args['num_workers']={workers!r} must be an int >= 0 (0 loads in this process)")

    reserved = [k for k in args if k in _RESERVED_DATALOADER_KEYS]
    if reserved:
        raise ValueError(f"dataloader_args sets {reserved}, which auto_accelerate builds itself (a "
                         "DistributedSampler over the data-parallel ranks); pass the dataset as dataset= and drop them")
    accepted = set(inspect.signature(DataLoader).parameters) | set(_OWN_DATALOADER_KEYS)
    unknown = sorted(k for k in args if k not in accepted)
    if unknown:
        raise ValueError(f"dataloader_args has key(s) {unknown} that DataLoader does not take; valid keys are "
                         f"{sorted(accepted - set(_RESERVED_DATALOADER_KEYS))}")


def _check_dataset(dataset: Any, global_batch: int, drop_last: bool) -> Any:
    """A map-style dataset that fills one global batch; returns dataset[0] (`first_sample`)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(f"dataset must be a map-style dataset (with __len__ and __getitem__), got "
                        f"{type(dataset).__name__}; auto_accelerate shards it with a DistributedSampler")
    size = len(dataset)
    # Read before the length is judged: a DatasetDict's length is its number of splits.
    sample = first_sample(dataset) if size > 0 else None
    if size == 0 or (drop_last and size < global_batch):
        raise ValueError(f"dataset has {size} samples, fewer than one global batch "
                         f"(dataloader_args['batch_size']={global_batch}): the dataloader would yield no batch")
    return sample


def first_sample(dataset: Any) -> Any:
    """dataset[0]; a TypeError naming the dataset's type and what indexing raised when it cannot be read so.

    The dataloader reads samples as dataset[i] for i in range(len(dataset)). A mapping that is no such dataset
    passed the checks and failed at the first batch (a `datasets.DatasetDict` whose split was not chosen:
    KeyError "Please first select a split"; a tokenizer's BatchEncoding or a dict of columns: KeyError 0), or
    was refused as "dataset has 1 samples" (a DatasetDict's length is its number of splits)."""
    try:
        return dataset[0]
    except Exception as e:  # noqa: BLE001 - any failure of dataset[0] is the dataloader's at the first batch
        raise TypeError(_unindexable(dataset, e)) from e


def _unindexable(dataset: Any, error: Exception) -> str:
    """Why `dataset` cannot be read by index (dataset[0] raised `error`), and what to pass instead."""
    module = type(dataset).__module__
    kind = type(dataset).__qualname__ if module == "builtins" else f"{module}.{type(dataset).__qualname__}"
    raised = f"dataset[0] raised {type(error).__name__}: {str(error)[:200]}"
    if not isinstance(dataset, Mapping):
        return (f"dataset ({kind}) cannot be read by index: {raised}; the dataloader reads samples as dataset[i] for "
                "i in range(len(dataset)), so dataset[0] must return the first sample")
    keys = [str(k) for k in list(dataset)[:8]]
    values = [dataset[k] for k in list(dataset)[:1]]
    columns = bool(values) and (isinstance(values[0], (torch.Tensor, list, tuple)) or hasattr(values[0], "__array__"))
    if columns:
        return (f"dataset is a {kind} of columns {keys}, not a dataset of samples ({raised}); the dataloader reads "
                "one sample as dataset[i]: pass e.g. datasets.Dataset.from_dict(columns).with_format('torch'), or a "
                "list of per-sample dicts [{key: column[i], ...} for i in range(rows)]")
    split = "train" if "train" in dataset else keys[0] if keys else "train"
    return (f"dataset is a {kind} (a mapping with keys {keys}), not a dataset of samples ({raised}); pass one of "
            f"its datasets, e.g. dataset[{split!r}]")


def _check_report_path(path: Any) -> None:
    """The search report goes to a directory (created when missing) or, for a .png path, next to that plot."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"report_path={path!r} must be a directory or a .png file path (str or os.PathLike)")
    if os.fspath(path).lower().endswith(".png"):
        _check_output_path("report_path", path)
    elif os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"report_path={os.fspath(path)!r} is a file; give a directory for the search report (or a "
                         ".png path for the plot)")
    elif not os.path.exists(path) and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"report_path={os.fspath(path)!r}: the directory {os.path.dirname(os.path.abspath(path))!r} "
                         "does not exist; create it first (the report directory itself is created)")


def _report_directory(report_path: Any) -> Optional[str]:
    """The directory `auto_accelerate` creates for the search report (None: none, or a .png path)."""
    if not isinstance(report_path, (str, os.PathLike)) or os.fspath(report_path).lower().endswith(".png"):
        return None
    return os.path.abspath(os.fspath(report_path))


def _check_output_path(name: str, path: Any, created_dir: Optional[str] = None) -> None:
    """A file `path` can be written: a str/PathLike whose directory exists and that is not a directory.

    `created_dir` is a directory atorch itself creates (the report directory): a file inside it
    is fine while it does not exist yet.
    """
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{name}={path!r} must be a file path (str or os.PathLike)")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{name}={path!r} is a directory; give a file name inside it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) and parent == created_dir:
        return   # the report directory, created before anything is written (its own parent was checked)
    if not os.path.isdir(parent):
        raise ValueError(f"{name}={path!r}: the directory {parent!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{name}={path!r}: the directory {parent!r} is not writable")
    _probe_writable(name, path, parent)


def _probe_writable(name: str, path: str, parent: str) -> None:
    """Create and remove a file in `parent`: `os.access` answers for the permission bits only (root is
    allowed in /proc, on a read-only mount, in a full quota), and the file is written after the strategy
    applied, too late to fail on."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".atorch-write-check-", dir=parent)
    except OSError as e:
        raise ValueError(f"{name}={path!r}: cannot create a file in the directory {parent!r} ({e.strerror or e}); "
                         "give a path in a writable directory") from None
    os.close(fd)
    os.remove(probe)
