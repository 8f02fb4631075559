"""`train_step`: one optimizer step of any strategy, with gradient accumulation and clipping.

Gradient accumulation splits the per-rank batch the dataloader yields into `k` equal
micro-batches (rather than consuming `k` consecutive batches), so the *global* batch per
optimizer step stays `dataloader_args["batch_size"]` whatever `k` is: the search can trade
micro-batch size (activation memory) against steps without changing the training, and the
dry runner's throughput (global batch x steps / seconds) means the same for every `k`.
Each micro-batch loss is divided by `k`, so the accumulated gradient is the mean of the
micro-batch means, which is the full-batch mean when the loss is a mean over equally many
rows or tokens per micro-batch (the same convention as DeepSpeed and accelerate). The epoch's
last, smaller batch (dataloader_args['drop_last']=False) is split as evenly as it goes, each
micro-batch loss weighted by its share of the rows (`micro_batches`).

`loss_weighting="tokens"` weights each micro-batch's token-mean loss by its share of the label
tokens of the whole global batch instead, counted over the data ranks with one all-reduce per step
(`_TokenShares`), so that padded batches of unequal lengths train exactly as single-process
training on the global batch's token mean (Hugging Face Trainer's `average_tokens_across_devices`).

Gradient sync follows `result.sync_each_micro_step` (the `gradient_accumulation` option): by default
FSDP2 reduce-scatters every micro-step (its gradients stay sharded) and DDP skips the non-final
micro-steps' sync (`no_sync()`; its gradients are whole either way); False skips FSDP2's too
(`set_requires_gradient_sync(False)`: unsharded gradients, one reduce-scatter per step), True keeps
DDP's. DeepSpeed engines get their accumulation boundary set explicitly (ZeRO-1 then reduces once
per step; ZeRO-2/3 reduce into partitions as they go, which is DeepSpeed's own design). The native
pipeline averages over "data" inside each schedule step, so it syncs every micro-step.

Clipping (`max_grad_norm`) uses the true global norm: each gradient's local square sum is
reduced over exactly the groups it is sharded over (FSDP2/DTensor shard dims, atorch's
tensor-parallel layers, pipeline stages) and counted once where it is replicated (DDP, the
replicated norms of tensor parallelism, the second copy of a tied embedding/head), then every
local gradient is scaled as `torch.nn.utils.clip_grad_norm_` would. DeepSpeed engines clip in
their own `step()` with the value set here.

Both options decide which collectives a step runs (a clipping all-reduce, a gradient sync skipped
or not), so every rank must pass the same ones: the first call on each result compares them across
ranks (`_agree_on_first_call`) and later calls trust them (see `train_step`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.model_context import call_model, default_loss_func, users_module
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.token_limits import INTEGER_DTYPES, check_token_range, token_limits
from atorch.auto.user_errors import UserValueError
from atorch.distributed.agreement import agree_on_error, agree_on_values
from atorch.modules.pipeline.batches import (
    IGNORE_INDEX,
    causal_lm_loss,
    check_labels_fit_logits,
    cut_rows,
    find_batch_rows,
)

logger = logging.getLogger(__name__)

__all__ = ["LOSS_WEIGHTINGS", "StepStats", "check_batch", "clip_grad_norm_", "split_batch", "train_step",
           "train_step_stats"]

# How train_step weights the micro-batch losses of one global batch (see `train_step`).
LOSS_WEIGHTINGS = ("rows", "tokens")


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did."""

    loss: torch.Tensor                  # "rows": mean of this rank's micro-batch losses; "tokens": the global
                                        # batch's token mean, the same on every rank (detached)
    grad_norm: Optional[torch.Tensor]   # global gradient norm before clipping; None when not clipped
    micro_batches: int


def train_step(result: AutoAccelerateResult, batch: Any, *, gradient_accumulation_steps: Optional[int] = None,
               max_grad_norm: Optional[float] = None, loss_weighting: str = "rows") -> torch.Tensor:
    """One optimizer step on `batch` for any strategy; returns the (detached) loss.

    `gradient_accumulation_steps`: micro-batches the per-rank `batch` is split into (default:
    what the `gradient_accumulation` optimization chose, else 1). `max_grad_norm`: clip the
    global gradient norm to this value before the step (default: no clipping). Plain loops
    (`loss.backward(); optim.step()`) work too; this helper also drives DeepSpeed engines and
    pipeline schedules, which step themselves. It also steps `result.lr_scheduler` once per call,
    after the optimizer (DeepSpeed engines: inside `engine.step()`): do not step it again in the loop.

    `loss_weighting`: how the losses of the global batch's micro-batches are combined.
    "rows" (default): each micro-batch's loss counts by its rows and data ranks count alike (as DDP
    and DeepSpeed average them); the global batch's mean when every row weighs alike (a row mean,
    or as many label tokens in every micro-batch). Returns this rank's mean of its micro-batch losses.
    "tokens": each micro-batch's loss, a Hugging Face causal LM's own token mean over its label
    tokens (`labels[..., 1:] != -100`, or `shift_labels != -100` where the batch has them), is
    weighted by its share of the label tokens of the whole global batch, counted over the data ranks
    (one all-reduce per step), so the gradient is single-process training's gradient of the global
    batch's token mean, however unequal the rows' lengths. Returns that global token mean, the same
    on every rank (one more all-reduce). Needs `labels` in every batch and a causal LM computing
    its own loss (no loss_func); not available under deepspeed_3d_parallel, whose engine averages
    its micro-batch losses itself (ValueError on every rank).

    Every rank must pass the same `gradient_accumulation_steps`, `max_grad_norm` and `loss_weighting` at
    every call: they decide the step's collectives, so ranks given different ones wait for each other until the
    collective timeout (FSDP, tensor and pipeline parallelism) or train on silently with replicas that
    drift apart (DDP). The first call on each `result` compares them across ranks (one small vote) and
    raises the same ValueError on every rank when they differ; later calls are not compared, as a vote
    at every step would cost a round trip between all ranks per step. Change them, if at all, on every
    rank at the same step (e.g. from the step count, never from something only one rank reads).
    """
    return train_step_stats(result, batch, gradient_accumulation_steps=gradient_accumulation_steps,
                            max_grad_norm=max_grad_norm, loss_weighting=loss_weighting).loss


def train_step_stats(result: AutoAccelerateResult, batch: Any, *, gradient_accumulation_steps: Optional[int] = None,
                     max_grad_norm: Optional[float] = None, loss_weighting: str = "rows") -> StepStats:
    """`train_step`, also returning the gradient norm it clipped (see `StepStats`)."""
    _check_result("train_step", result)
    _agree_on_first_call(result, gradient_accumulation_steps, max_grad_norm, batch, loss_weighting)
    steps = _accumulation_steps(result, gradient_accumulation_steps)
    if max_grad_norm is not None:
        _check_max_norm("train_step: max_grad_norm", max_grad_norm)
    by_tokens = _weights_by_tokens(result, loss_weighting)
    if result.optim is None and result.engine is None and result.custom_train_step is None:
        # Before the forward: failing at optim.step() left this step's gradients in every .grad.
        raise ValueError("train_step needs an optimizer, and auto_accelerate was called without optim_func: pass "
                         "optim_func (e.g. torch.optim.AdamW) to auto_accelerate, or run forward and backward on "
                         "result.model yourself")
    if result.pipeline is not None:
        stats = _pipeline_step(result, result.pipeline, batch, steps, max_grad_norm, by_tokens)
    elif result.custom_train_step is not None:  # engines with their own schedule (deepspeed_3d_parallel)
        stats = _custom_step(result, result.custom_train_step, batch, steps, max_grad_norm)
    elif result.engine is not None:
        stats = _deepspeed_step(result, result.engine, batch, steps, max_grad_norm, by_tokens)
    else:
        stats = _plain_step(result, batch, steps, max_grad_norm, by_tokens)
    _warn_if_the_loss_is_not_finite(result, batch, stats, by_tokens)
    return stats


def _check_result(who: str, result: Any) -> None:
    if not isinstance(result, AutoAccelerateResult):
        raise TypeError(f"{who}: result must be the AutoAccelerateResult that auto_accelerate returned, got "
                        f"{type(result).__name__}")


# ids of the results whose first train_step call has compared the options across ranks (`_remember`).
_agreed_results: Set[int] = set()


def _remember(registry: Set[int], result: AutoAccelerateResult) -> None:
    """Put `result`'s id in `registry` until the result is collected (so a new result reusing the id is new)."""
    key = id(result)
    registry.add(key)
    weakref.finalize(result, registry.discard, key)


def _agree_on_first_call(result: AutoAccelerateResult, gradient_accumulation_steps: Any,
                         max_grad_norm: Any, batch: Any, loss_weighting: Any = "rows") -> None:
    """At the first call on `result`, the ranks compare the options they were given (before checking
    them, so that a bad value on one rank is named as a difference instead of raising on that rank
    alone), and the batches of the ranks that hold one model replica together
    (`_check_replica_peers_share_the_batch`); the same ValueError on every rank when they differ.

    Only the first call: every rank calls train_step equally often, so "the first call" is the same
    call everywhere, while "a call whose options changed on this rank" is not (a rank cannot know
    that another's changed, and a vote only some ranks join is itself a hang)."""
    if id(result) in _agreed_results:
        return
    steps = result.gradient_accumulation_steps if gradient_accumulation_steps is None else gradient_accumulation_steps
    norm = max_grad_norm
    if isinstance(norm, (int, float)) and not isinstance(norm, bool):
        norm = float(norm)    # 1 and 1.0 clip alike
    values = {"gradient_accumulation_steps": repr(steps), "max_grad_norm": repr(norm)}
    if loss_weighting != "rows":
        # Only where not the default, so the vote is the one it always was; a rank with the default shows as
        # "(not given)" beside another's "'tokens'", which runs an all-reduce that the first would never join.
        values["loss_weighting"] = repr(loss_weighting)
    agree_on_values("train_step", values)
    _check_replica_peers_share_the_batch(result, batch)
    _remember(_agreed_results, result)


# ids of the results whose first batch's checks were voted on (`_checks_agreed_at_the_first_call`).
_first_batches_checked: Set[int] = set()


@contextlib.contextmanager
def _checks_agreed_at_the_first_call(result: AutoAccelerateResult) -> Iterator[None]:
    """At the first call on `result`, the batch checks in the block (local: no collective inside) are voted on,
    so a bad first batch on one rank (token ids beyond the vocabulary, rows too long, a prepare_input that raises)
    is the same error on every rank instead of one rank's error and the others waiting in the forward's first
    collective until the collective timeout. Later batches are checked locally only: a vote at every step would
    cost a round trip between all ranks per step (the launcher ends the others when one fails). A first batch
    refused on every rank leaves the next call voted on too, as `_agree_on_first_call` does."""
    if id(result) in _first_batches_checked:
        yield
        return
    with agree_on_error("train_step: checking the first batch"):
        yield
    _remember(_first_batches_checked, result)


# Dimensions whose ranks hold one model replica together: they must be fed the same batch.
_REPLICA_SPLIT_DIMS = ("tensor", "pipeline")


def _check_replica_peers_share_the_batch(result: AutoAccelerateResult, batch: Any) -> None:
    """The ranks that hold one model replica together (tensor and pipeline peers) must be fed the same
    batch; compared once, at the first call, by a digest of the batch (one all_gather_object).

    `result.dataloader` does so (its sampler splits the data over the "data" dimension only). A loop
    of the user's own with a `DistributedSampler` over the whole world feeds each tensor peer other
    rows, and nothing fails: the tensor-parallel layers sum partial results computed from different
    samples, and the model trains on that mix silently (a pipeline's last stage scores one rank's
    logits against another's labels). Where the shapes differ it fails inside the backend instead,
    with "Received data size doesn't match expected size" on one rank and a wait on the others."""
    parallel = result.parallel
    if parallel is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    split = [name for name in _REPLICA_SPLIT_DIMS if parallel.size_or_one(name) > 1]
    replicas = dist.get_world_size() // max(1, math.prod(parallel.size_or_one(name) for name in _REPLICA_SPLIT_DIMS))
    if not split and replicas < 2:
        return
    coords = parallel.layout.coords(dist.get_rank())
    replica = tuple(sorted((name, c) for name, c in coords.items() if name not in _REPLICA_SPLIT_DIMS))
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (replica, batch_digest(batch)))
    by_replica = _replicas_by_batch(gathered)
    if not _repeats_one_sample(result):
        _warn_if_every_replica_has_one_batch(by_replica)
    for members in by_replica.values():
        if len(members) > 1:
            ranks = sorted(r for group in members.values() for r in group)
            fed = "; ".join(f"ranks {group}" for group in members.values())
            raise ValueError(
                f"train_step: ranks {ranks} hold one model replica together ({' and '.join(split)} peers) but were "
                f"given different batches (the same batch went to {fed}); feed every rank of a replica the same "
                "batch: iterate result.dataloader, or shard your data over the 'data' dimension "
                "(result.parallel.size('data') and the rank's 'data' coordinate), not over the world")


def _repeats_one_sample(result: AutoAccelerateResult) -> bool:
    """Whether the result's loader reads ATorch's `sample_batch`, whose rows are the same everywhere on purpose."""
    from atorch.auto.compat import SampleBatchDataset

    return isinstance(getattr(result.dataloader, "dataset", None), SampleBatchDataset)


def _warn_if_every_replica_has_one_batch(by_replica: Dict[Any, Dict[str, List[int]]]) -> None:
    """Warn (rank 0) when every data-parallel replica was given the same batch at the first step: a loader of
    the user's own that yields the whole global batch on every rank trains like one replica at the cost of
    all of them, and its resume position counts rows no rank skipped. A warning, not an error: a synthetic
    constant batch (a throughput test) is the same everywhere on purpose."""
    digests = {digest for members in by_replica.values() for digest in members}
    if len(by_replica) < 2 or len(digests) != 1 or dist.get_rank() != 0:
        return
    logger.warning("train_step: all %d data-parallel replicas were given the same batch at the first step, so they "
                   "compute the same gradients: each should get its own rows (result.dataloader does; a loader of "
                   "your own needs a DistributedSampler over the data dimension: num_replicas="
                   "result.data_parallel_size and the rank's 'data' coordinate, with the per-rank batch size "
                   "global batch / data_parallel_size)", len(by_replica))


def _replicas_by_batch(gathered: Sequence[Tuple[Any, str]]) -> Dict[Any, Dict[str, List[int]]]:
    """{replica: {batch digest: [ranks]}} from each rank's (replica coordinates, batch digest)."""
    out: Dict[Any, Dict[str, List[int]]] = {}
    for rank, (replica, digest) in enumerate(gathered):
        out.setdefault(replica, {}).setdefault(digest, []).append(rank)
    return out


def batch_digest(batch: Any) -> str:
    """A digest of a batch: every tensor's place in it, shape, dtype and bytes, and the other values'
    types (their text for plain scalars and strings). Tensors whose bytes cannot be read here (on
    the meta device) count by their shape and dtype."""
    digest = hashlib.blake2b(digest_size=16)

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"{path}:{tuple(value.shape)}:{value.dtype};".encode())
            if value.device.type != "meta":
                digest.update(value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                visit(value[key], f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]")
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(f"{path}={value!r};".encode())
        else:
            digest.update(f"{path}:{type(value).__qualname__};".encode())

    visit(batch, "batch")
    return digest.hexdigest()


def _check_max_norm(what: str, value: Any) -> None:
    # A negative norm would scale every gradient by a negative factor: a silent step uphill.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}={value!r} must be a number > 0, or None for no clipping")


# -- the batch ----------------------------------------------------------------------------------

# Causal language models by the names of their classes (Hugging Face's `*ForCausalLM` and the older
# `*LMHeadModel`s that are causal): their loss takes token ids as labels. Not every `*LMHeadModel` is
# (XLNet's labels are the `target_mapping` positions' tokens, [batch, num_predict]); other models' labels
# may be anything (a class per row, float regression targets, a decoder's tokens).
_CAUSAL_LM_SUFFIX = "ForCausalLM"
_CAUSAL_LM_HEADS = frozenset({"GPT2LMHeadModel", "OpenAIGPTLMHeadModel", "CTRLLMHeadModel"})
# The libraries whose models take `input_ids` as integer token ids of [batch, sequence, ...].
_TOKEN_ID_LIBRARIES = ("transformers.", "peft.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _classes(model: Any) -> List[type]:
    """The classes of `model` and of the modules atorch's wrappers hold it as (DDP and DeepSpeed engines:
    `.module`; FSDP2 subclasses the model's own class in place)."""
    classes: List[type] = []
    inner = model
    for _ in range(4):
        classes += type(inner).__mro__
        wrapped = getattr(inner, "module", None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return classes


def _model_name(model: Any) -> str:
    """The user's model class under atorch's wrappers (`users_module`), e.g. LlamaForCausalLM."""
    return type(users_module(model)).__name__


def is_causal_lm(model: Any) -> bool:
    """Whether `model` (under atorch's wrappers) is a Hugging Face causal LM (see `_CAUSAL_LM_SUFFIX`)."""
    return any(cls.__name__.endswith(_CAUSAL_LM_SUFFIX) or cls.__name__ in _CAUSAL_LM_HEADS
               for cls in _classes(model))


def takes_token_ids(model: Any) -> bool:
    """Whether `model` (under atorch's wrappers) is a Hugging Face (or PEFT) model, whose `input_ids` are
    integer token ids of at least 2 dims; a model of the user's own may mean anything by that key
    (flat ids with `offsets` for an `EmbeddingBag`)."""
    return any(cls.__module__.startswith(_TOKEN_ID_LIBRARIES) for cls in _classes(model))


def _check_token_tensor(key: str, value: Any) -> None:
    """ValueError unless batch[key] holds token ids as an integer tensor of [rows, tokens]."""
    if not isinstance(value, torch.Tensor) or value.dtype not in INTEGER_DTYPES or value.dim() < 2:
        # A Hugging Face datasets.Dataset yields lists until told otherwise, the commonest source of a list here.
        lists = (" (a Hugging Face datasets.Dataset yields lists: use dataset.with_format('torch'), or a collate_fn "
                 "that builds tensors)" if isinstance(value, (list, tuple)) else "")
        raise ValueError(f"train_step: batch[{key!r}] is {_describe(value)}{lists}; {key} must be an integer tensor "
                         f"(token ids, e.g. torch.long) of shape [rows, tokens]: return tensors from the dataset or "
                         f"collate_fn (the result's dataloader stacks a dataset's tensors), with .long() for ids "
                         f"stored as floats, and a row dimension for a single sample (ids[None])")
    # Integer, but of a type the model cannot take: an embedding indexes with int64 or int32 only, and cross
    # entropy's targets are int64 ("Expected tensor for argument #1 'indices' to have one of the following
    # scalar types: Long, Int; but got torch.ByteTensor", "expected target dtype to be Long or Byte, but got Int").
    taken, why = ((torch.int64,), "the loss takes int64 targets") if key == "labels" else \
        ((torch.int64, torch.int32), "an embedding takes int64 or int32 ids")
    if value.dtype not in taken:
        names = " or ".join(str(t).replace("torch.", "") for t in taken)
        raise ValueError(f"train_step: batch[{key!r}] is {_describe(value)}; {key} must be {names} ({why}): "
                         "convert it with .long() in the dataset or collate_fn (token ids stored as uint8 or int16 "
                         "to save memory included)")


def check_batch(batch: Any, causal_lm: bool, token_ids: bool = True) -> None:
    """ValueError naming the key, its shape or type and what is expected, for a batch the model cannot train on.

    Local and cheap (no collective, microseconds), before each forward: without it these failed deep
    inside torch or transformers ("Expected tensor for argument #1 'indices' to have one of the following
    scalar types", "cannot reshape tensor of 0 elements", "Expected input batch_size (32) to match target
    batch_size (16)"). Checked: at least one row in any batch of tensors; for a model that takes token ids
    (`token_ids`: Hugging Face's), a dict's `input_ids` an integer tensor of >= 2 dims; for a causal LM
    (`causal_lm`) also `labels` integer, and shaped like input_ids when both are [batch, sequence]
    (a model with codebooks has labels of its own shape). Every other key and batch form (inputs_embeds,
    attention_mask, position_ids, a custom loss's keys, tuples) is the model's.
    """
    rows = find_batch_rows(batch)
    if rows == 0:
        raise ValueError("train_step: the batch has 0 rows (its first tensor's first dimension is 0); every "
                         "rank needs at least one row per step: check the dataset's length and the dataloader's "
                         "batch size, or skip empty batches before train_step on every rank alike")
    if not isinstance(batch, Mapping):
        return
    ids = batch.get("input_ids") if token_ids or causal_lm else None
    if ids is not None:
        _check_token_tensor("input_ids", ids)
    labels = batch.get("labels")
    if not causal_lm or labels is None:
        return
    _check_token_tensor("labels", labels)
    if ids is not None and labels.dim() == ids.dim() == 2 and tuple(labels.shape) != tuple(ids.shape):
        raise ValueError(f"train_step: batch['labels'] has shape {tuple(labels.shape)} but batch['input_ids'] has "
                         f"shape {tuple(ids.shape)}; a causal LM predicts each next token of its input, so labels "
                         "must have input_ids' shape (the same ids, with -100 where no token is predicted)")


# -- micro-batches ----------------------------------------------------------------------------

def _accumulation_steps(result: AutoAccelerateResult, requested: Optional[int]) -> int:
    if requested is None:
        requested = result.gradient_accumulation_steps
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"train_step: gradient_accumulation_steps={requested!r} must be an integer >= 1")
    return requested


def split_batch(batch: Any, num: int) -> List[Any]:
    """Split a (nested) batch into `num` equal micro-batches along dim 0 of its tensors.

    Tensors whose first dimension is the batch's row count are split; anything else
    (scalars, strings, per-batch settings) is shared by every micro-batch
    (`atorch.modules.pipeline.batches.cut_rows`, which DeepSpeed 3D's step splits with too).
    """
    if num == 1:
        return [batch]
    rows = find_batch_rows(batch)
    if rows is None:
        raise ValueError(f"train_step: gradient_accumulation_steps={num} needs a batch of tensors to split, got "
                         f"{type(batch).__name__} without any")
    if rows % num != 0:
        raise ValueError(f"train_step: the per-rank batch of {rows} rows does not split into "
                         f"gradient_accumulation_steps={num} equal micro-batches; use a global batch size that is a "
                         f"multiple of {num} x the data-parallel size")
    return cut_rows(batch, rows, [rows // num] * num)


def micro_batches(result: AutoAccelerateResult, batch: Any, steps: int) -> Tuple[List[Any], Optional[List[float]]]:
    """The micro-batches of one step, and each one's weight when they are not all the same size (else None).

    A per-rank batch smaller than the dataloader's (the last batch of an epoch with
    dataloader_args['drop_last']=False) need not split into `steps` equal parts: it is split as
    evenly as it goes (into fewer micro-batches when it has fewer rows than `steps`) and each
    micro-batch's loss is weighted by its share of the rows, so the accumulated gradient is still
    the batch mean. Every data rank gets the same number of rows (the sampler pads), so all ranks
    run the same micro-steps. Any other batch must split evenly (`split_batch`).
    """
    rows = find_batch_rows(batch) if steps > 1 else None
    full = (result.global_batch_size // result.data_parallel_size
            if result.global_batch_size and result.data_parallel_size else None)
    if rows is None or rows % steps == 0 or full is None or rows >= full:
        return split_batch(batch, steps), None
    parts = min(steps, rows)
    sizes = [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    return cut_rows(batch, rows, sizes), [size / rows for size in sizes]


def _scaled(loss: torch.Tensor, steps: int, weights: Optional[List[float]], i: int) -> torch.Tensor:
    """The micro-batch loss to backpropagate: divided by the number of equal micro-batches, or weighted
    by its share of the rows."""
    if weights is not None:
        return loss * weights[i]
    return loss / steps if steps > 1 else loss


# -- weighting by tokens ----------------------------------------------------------------------

def _weights_by_tokens(result: AutoAccelerateResult, loss_weighting: Any) -> bool:
    """Whether this step weights its micro-batch losses by label tokens (`loss_weighting="tokens"`).

    ValueError for an unknown value, and for "tokens" where the loss is not one train_step can weight
    by its tokens. These depend on the options, the strategy and the model only, the same on every
    rank (the options were compared at the first call), so every rank raises before the step's collectives."""
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"train_step: loss_weighting={loss_weighting!r} must be one of {list(LOSS_WEIGHTINGS)}")
    if loss_weighting == "rows":
        return False
    if result.pipeline is not None:
        # pipeline_parallel always computes the causal-LM loss on its last stage (it refuses a loss_func).
        if getattr(result.pipeline, "loss_fn", None) is not None:
            raise ValueError("train_step: loss_weighting='tokens' needs the native pipeline's own causal-LM loss, but "
                             "this pipeline has a loss_fn of its own; use loss_weighting='rows'")
        return True
    if result.custom_train_step is not None:
        raise ValueError("train_step: loss_weighting='tokens' is not available under deepspeed_3d_parallel: its "
                         "engine (train_batch) averages each micro-batch's loss itself, which train_step cannot "
                         "reweight; use loss_weighting='rows', or pipeline_parallel (the native pipeline) with "
                         "loss_weighting='tokens'")
    model = result.model
    if not is_causal_lm(model):
        raise ValueError(f"train_step: loss_weighting='tokens' weights a causal language model's token-mean loss, but "
                         f"the model is a {type(model).__name__}, not a Hugging Face causal LM (*ForCausalLM); use "
                         "loss_weighting='rows', or weight the tokens in a loss_func of your own")
    if not uses_the_models_loss(result):
        raise ValueError("train_step: loss_weighting='tokens' weights the model's own causal-LM loss by its label "
                         "tokens, but auto_accelerate was given a loss_func, whose loss train_step cannot count "
                         "tokens for; drop loss_func (the model computes its loss from batch['labels']), or use "
                         "loss_weighting='rows'")
    return True


def uses_the_models_loss(result: AutoAccelerateResult) -> bool:
    """Whether `result.loss_func` returns the model output's own `.loss` (auto_accelerate got no loss_func)."""
    return not result.user_loss_func


def label_tokens(batch: Any) -> Optional[torch.Tensor]:
    """The label tokens a Hugging Face causal LM's loss averages over in `batch`: `shift_labels != -100`
    where the batch has them (transformers' ForCausalLMLoss then takes them as they are), else
    `labels[..., 1:] != -100` (each position predicts the next token); None without labels."""
    if not isinstance(batch, Mapping):
        return None
    shifted = batch.get("shift_labels")
    if isinstance(shifted, torch.Tensor):
        return (shifted != IGNORE_INDEX).sum()
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        return None
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def _data_group(result: AutoAccelerateResult) -> Tuple[Any, int]:
    """The group the gradients are averaged over ("data"; tensor and pipeline peers share the batch, so
    they are not counted again) and its size; (None, 1) without data parallelism."""
    size = result.data_parallel_size
    if result.parallel is None or size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None, 1
    return result.parallel.group("data"), size


@dataclass(frozen=True)
class _TokenShares:
    """`loss_weighting="tokens"` for one step: each micro-batch's weight is its label tokens x the data
    ranks / the global batch's label tokens. Its token-mean loss times that weight is its summed token
    loss over the global count, times the data ranks that the gradient average (DDP, FSDP2, DeepSpeed
    ZeRO, the native pipeline) divides by again: the gradients add up to the global token mean's."""

    weights: List[torch.Tensor]
    per_token: torch.Tensor   # data ranks / the global batch's label tokens: each label token's weight
    group: Any
    data_size: int

    @classmethod
    def count(cls, result: AutoAccelerateResult, micros: Sequence[Any]) -> "_TokenShares":
        """Count the micro-batches' label tokens and their sum over the data ranks (one all-reduce, which
        also carries whether any rank's batch lacks labels, so that every rank raises alike)."""
        counts = [label_tokens(micro) for micro in micros]
        device = result.device
        local = torch.zeros(2, dtype=torch.int64, device=device)
        for c in counts:
            if c is None:
                local[1] += 1
            else:
                local[0] += c.to(device)
        group, size = _data_group(result)
        if size > 1:
            dist.all_reduce(local, group=group)
        if int(local[1]) > 0:
            raise ValueError("train_step: loss_weighting='tokens' counts the label tokens of every batch, but a "
                             "batch has no 'labels' (on some rank); give each batch its labels (the token ids, with "
                             "-100 where no token is predicted), or use loss_weighting='rows'")
        per_token = size / local[0].clamp(min=1).double()   # no label token anywhere: every weight 0, no gradient
        weights = [(c.to(device).double() * per_token).float() for c in counts if c is not None]
        return cls(weights, per_token.float(), group, size)

    def scale(self, loss: torch.Tensor, i: int) -> torch.Tensor:
        """Micro-batch `i`'s token-mean loss times its weight. A micro-batch without label tokens has a
        token mean of 0/0 (nan) and weight 0: it backpropagates zeros instead of nan * 0."""
        weight = self.weights[i].to(loss.device)
        return torch.where(weight > 0, loss * weight.to(loss.dtype), torch.zeros_like(loss))

    def global_mean(self, scaled: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global batch's token mean from this rank's scaled micro-batch losses (one all-reduce)."""
        local = torch.stack([s.detach().float() for s in scaled]).sum() / self.data_size
        if self.data_size > 1:
            dist.all_reduce(local, group=self.group)
        return local


# -- plain models, DDP, FSDP2, tensor parallel ------------------------------------------------

def _no_sync(model: nn.Module, final: bool, sync_each: Optional[bool]) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction of a non-final micro-step where the wrapper allows it and the
    strategy asks for it (`sync_each`: gradient_accumulation's `sync_each_micro_step`; None: FSDP2
    reduces every micro-step, keeping its gradients sharded, DDP only in the last)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(final or sync_each is not False)   # recursive: every unit below the root
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel) and not final and not sync_each:
        return model.no_sync()
    return contextlib.nullcontext()


def _prepared_micro_batches(result: AutoAccelerateResult, model: Any, batch: Any, steps: int,
                            by_tokens: bool) -> Tuple[List[Any], Optional[List[float]], Optional[_TokenShares]]:
    """The step's micro-batches, prepared and checked before any forward; their row weights (`micro_batches`),
    and under `by_tokens` their token shares (which need every micro-batch's labels before the first backward)."""
    micros, weights = micro_batches(result, batch, steps)
    causal_lm, token_ids = is_causal_lm(model), takes_token_ids(model)
    limits, name = token_limits(model) if token_ids else (None, None), _model_name(model)
    # A causal LM's forward computes its loss from labels whenever the batch holds them, a loss_func given or not.
    labels = causal_lm and token_ids
    prepared = []
    with _checks_agreed_at_the_first_call(result):
        for micro in micros:
            check_token_range(micro, name, limits, labels=labels)
            micro = result.prepare_input(micro)
            check_batch(micro, causal_lm, token_ids)
            prepared.append(micro)
    return prepared, weights, _TokenShares.count(result, prepared) if by_tokens else None


def _micro_losses(result: AutoAccelerateResult, model: Any, micro: Any, steps: int, weights: Optional[List[float]],
                  shares: Optional[_TokenShares], i: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(micro-batch `i`'s loss to backpropagate, what it reports: its loss, or under tokens its scaled
    own loss, before any fp16 loss scaling)."""
    try:
        output = call_model(model, micro, result.model_input_format)
    except RuntimeError as e:
        if "find_unused_parameters=True" not in str(e):
            raise
        raise _unused_parameters_error(model, str(e)) from e
    loss = result.loss_func(micro, output)
    if not loss.requires_grad and torch.is_grad_enabled():
        # Else autograd's "element 0 of tensors does not require grad and does not have a grad_fn" at backward.
        who = "loss_func" if result.user_loss_func else "the model output's .loss"
        raise UserValueError(f"train_step: {who} returned a loss that does not require grad (detached, computed under "
                             "torch.no_grad, or from .item() / .data), so backward cannot reach the model: compute it "
                             "from the model output's tensors")
    if shares is None:
        return _scaled(loss, steps, weights, i), loss.detach()
    return shares.scale(loss, i), shares.scale(default_loss_func(micro, output).detach(), i)


def _unused_parameters_error(model: Any, message: str) -> RuntimeError:
    """DDP's "parameters that were not used in producing loss" error, said for atorch: torch's advice names
    DDP's constructor argument, which atorch passes, and the parameters only by index."""
    names = [n for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
    indices = [int(i) for i in found.group(1).split()] if found else []
    unused = [names[i] for i in indices if 0 <= i < len(names)]
    which = (f"{len(unused)} parameters took no part in the last step's loss ({', '.join(unused[:6])}"
             f"{', ...' if len(unused) > 6 else ''})" if unused else "some parameters took no part in the last "
             "step's loss")
    return RuntimeError(f"DistributedDataParallel: {which}, so their gradients were never reduced. Make every "
                        "parameter take part in the loss, freeze the unused ones (requires_grad=False) before "
                        "auto_accelerate, or add ('ddp', {'find_unused_parameters': True}) to the strategy "
                        "(atorch builds the DDP wrapper; slower: it walks the graph every step)")


def _reported(losses: Sequence[torch.Tensor], weights: Optional[List[float]],
              shares: Optional[_TokenShares]) -> torch.Tensor:
    return _mean(losses, weights) if shares is None else shares.global_mean(losses)


def _plain_step(result: AutoAccelerateResult, batch: Any, steps: int, max_grad_norm: Optional[float],
                by_tokens: bool = False) -> StepStats:
    model = result.model
    losses: List[torch.Tensor] = []
    micros, weights, shares = _prepared_micro_batches(result, model, batch, steps, by_tokens)
    for i, micro in enumerate(micros):
        with _no_sync(model, final=i == len(micros) - 1, sync_each=result.sync_each_micro_step):
            loss, reported = _micro_losses(result, model, micro, steps, weights, shares, i)
            loss.backward()
        losses.append(reported)
    optim = cast(torch.optim.Optimizer, result.optim)      # checked by train_step_stats
    norm = None
    if max_grad_norm is not None:
        norm = clip_grad_norm_(result, max_grad_norm)   # unscales fp16 gradients first
        _refuse_a_step_on_a_nonfinite_norm(result, norm, _reported(losses, weights, shares))
    optim.step()
    optim.zero_grad(set_to_none=True)
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    return StepStats(_reported(losses, weights, shares), norm, len(micros))


def _fp16_scaler_enabled(optim: Any) -> bool:
    """Whether `optim` is amp_native's fp16 wrapper with an enabled GradScaler (which skips a step whose
    gradients hold inf or nan and lowers the scale: how fp16 training finds its scale)."""
    scaler = getattr(optim, "scaler", None)
    return scaler is not None and bool(scaler.is_enabled())


def _refuse_a_step_on_a_nonfinite_norm(result: AutoAccelerateResult, norm: torch.Tensor,
                                       loss: Optional[torch.Tensor]) -> None:
    """Clipping reduces the global gradient norm to one value on every rank, so a nan or inf there refuses
    the step on every rank alike (no rank is left in a collective): the gradients are cleared and the
    parameters, optimizer state and schedule stay as they were, where `optim.step()` would have made every
    parameter nan (Megatron's check_for_nan_in_loss_and_grad makes the same choice). Not under fp16
    amp_native: its GradScaler skips such a step itself and lowers its scale. `loss`: this rank's, to name."""
    if bool(torch.isfinite(norm)) or _fp16_scaler_enabled(result.optim):
        return
    cast(torch.optim.Optimizer, result.optim).zero_grad(set_to_none=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    said = "" if loss is None else f" (rank {rank}'s loss: {float(loss):.6g})"
    raise FloatingPointError(
        f"train_step: the global gradient norm is {float(norm)}{said}, so the step was not taken: the gradients "
        "were cleared and the parameters, optimizer state and learning-rate schedule are unchanged on every rank. "
        "Catch FloatingPointError around train_step to skip this batch, or find the cause: a learning rate too "
        "high (the loss diverged), a half-precision overflow (fp16 without amp_native's loss scaling), bad inputs, "
        "or a loss_func that divides by something that can be 0")


def _warn_if_the_loss_is_not_finite(result: AutoAccelerateResult, batch: Any, stats: StepStats,
                                    by_tokens: bool) -> None:
    """Warn, on the rank that sees it, when a step's loss is nan or inf: without `max_grad_norm` (whose global
    norm lets every rank refuse the step together, `_refuse_a_step_on_a_nonfinite_norm`) nothing agreed stops
    the optimizer, and where the gradients are not finite either its update makes the parameters nan on every
    rank (a local look at them would not be agreed: each rank holds other shards). Silent under fp16
    amp_native, whose GradScaler skips such steps. Warns at every such step: each is worth a line in the log.

    One nan is harmless and common enough to name: a Hugging Face causal LM's token mean over a micro-batch
    whose labels are all -100 is 0/0 = nan, with a zero gradient (so the step trains on the other rows).

    A loss on the host only, as `check_token_range` reads ids: on a GPU, reading it would make every step wait
    for the device (there, `max_grad_norm`'s refusal is the check, at one read of the norm a step)."""
    loss = stats.loss
    if not isinstance(loss, torch.Tensor) or loss.device.type != "cpu" or bool(torch.isfinite(loss).all()) \
            or _fp16_scaler_enabled(result.optim):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not by_tokens and uses_the_models_loss(result) and result.pipeline is None and result.custom_train_step is None:
        counts = [label_tokens(m) for m in split_batch(batch, stats.micro_batches)]
        if any(c is not None and int(c) == 0 for c in counts):
            logger.warning("train_step: rank %d's loss is nan at this step because a micro-batch of its batch has no "
                           "label token (its labels are all -100 after the shift): the model's token mean over no "
                           "tokens is 0/0, with a zero gradient, so the step trained on the other rows. "
                           "loss_weighting='tokens' weighs each micro-batch by its label tokens (and reports the "
                           "global batch's token mean); or leave such rows out of the data", rank)
            return
    logger.warning("train_step: rank %d's loss is %s at this step. Without max_grad_norm nothing stops the "
                   "optimizer: where the gradients are nan or inf too, its step has made the parameters nan on every "
                   "rank. Pass max_grad_norm to have train_step refuse, on every rank, a step whose gradient norm "
                   "is not finite", rank, float(loss))


def _unscale_for_clipping(optim: Any) -> None:
    """fp16 amp: divide the gradients by the loss scale before measuring them (once per step: a second
    call in the same step does nothing)."""
    scaler = getattr(optim, "scaler", None)
    inner = getattr(optim, "optimizer", None)
    if scaler is None or inner is None or not scaler.is_enabled():
        return
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(inner)]   # torch's own record of what this step did (no public query)
    if state["stage"] is OptState.READY:
        scaler.unscale_(inner)   # the scaler remembers it, so its step() does not unscale twice


def _mean(losses: Sequence[torch.Tensor], weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    if len(losses) == 1:
        return losses[0]
    stacked = torch.stack([l.float() for l in losses])
    return stacked.mean() if weights is None else (stacked * torch.tensor(weights, device=stacked.device)).sum()


# -- DeepSpeed engines (use_ds_zero) ----------------------------------------------------------

def set_deepspeed_clipping(engine: Any, max_grad_norm: Optional[float]) -> None:
    """Make the engine clip at `max_grad_norm` (0: off) in its own `step()`.

    DeepSpeed reads `gradient_clipping` from its config when it builds its optimizer wrapper
    (ZeRO-1/2/3, bf16, pipeline engines keep it as `clip_grad`) and from the config for plain
    fp32 steps; both are read at every step, so setting both takes effect at the next step.
    """
    value = float(max_grad_norm or 0.0)
    engine._config.gradient_clipping = value
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = value


def _deepspeed_norm(engine: Any) -> Optional[torch.Tensor]:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return norm.detach().float() if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def _deepspeed_step(result: AutoAccelerateResult, engine: Any, batch: Any, steps: int,
                    max_grad_norm: Optional[float], by_tokens: bool = False) -> StepStats:
    set_deepspeed_clipping(engine, max_grad_norm)
    losses: List[torch.Tensor] = []
    try:
        micros, weights, shares = _prepared_micro_batches(result, engine, batch, steps, by_tokens)
        for i, micro in enumerate(micros):
            # The boundary is set explicitly, so a step is one optimizer update whatever the engine's
            # configured gradient_accumulation_steps and its micro-step counter say.
            engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
            loss, reported = _micro_losses(result, engine, micro, steps, weights, shares, i)
            # scale_wrt_gas=False: the weights above already make the micro-batches add up to the step's loss.
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()          # a no-op update off the boundary (DeepSpeed's own accumulation)
            losses.append(reported)
    finally:
        engine.set_gradient_accumulation_boundary(None)   # back to DeepSpeed's counter
    return StepStats(_reported(losses, weights, shares),
                     _deepspeed_norm(engine) if max_grad_norm is not None else None, len(losses))


def _custom_step(result: AutoAccelerateResult, custom_step: Callable, batch: Any, steps: int,
                 max_grad_norm: Optional[float]) -> StepStats:
    """Engines that run their own accumulation (DeepSpeed 3D's `train_batch`)."""
    engine_steps = result.gradient_accumulation_steps
    if steps != engine_steps:
        raise ValueError(f"train_step: gradient_accumulation_steps={steps}, but this strategy's engine accumulates "
                         f"over {engine_steps} micro-batches per step (deepspeed_3d_parallel: set "
                         "gradient_accumulation_steps in its ds_config instead)")
    engine = result.engine or result.model
    # Set at every call: a max_grad_norm of an earlier call must not go on clipping. Without one, the
    # clipping of the engine's ds_config (DeepSpeed 3D keeps a user's gradient_clipping).
    configured = float((result.deepspeed_config or {}).get("gradient_clipping") or 0.0)
    set_deepspeed_clipping(engine, max_grad_norm if max_grad_norm is not None else configured)
    # DeepSpeed 3D takes a batch dict or the list of its micro-batch dicts of a Hugging Face model's token
    # ids. Its labels are left to its stages: a loss_func of the user's may take labels of any shape.
    with _checks_agreed_at_the_first_call(result):
        for part in (batch if isinstance(batch, (list, tuple)) and all(isinstance(b, Mapping) for b in batch)
                     else [batch]):
            check_batch(part, causal_lm=False, token_ids=True)
            # Without a loss_func the stages compute the causal-LM loss, over the vocabulary.
            check_token_range(part, _model_name(engine), token_limits(engine), labels=not result.user_loss_func)
    loss = custom_step(result, batch)
    norm = _deepspeed_norm(engine) if max_grad_norm is not None else None
    return StepStats(loss, norm, steps)


# -- the native pipeline ----------------------------------------------------------------------

def _pipeline_step(result: AutoAccelerateResult, pipeline: Any, batch: Any, steps: int,
                   max_grad_norm: Optional[float], by_tokens: bool = False) -> StepStats:
    """`k` schedule steps on micro-batches, their gradients summed and divided by `k` (under
    `by_tokens`: each schedule step's loss is already its share of the global token mean, so summed only).

    Each schedule step computes its micro-batch's gradients from zero; the gradients of earlier
    micro-steps are set aside while it runs and added back after, so no schedule ever sees (or
    scales) another micro-step's gradients.
    """
    params = [p for p in pipeline.stage_module.parameters() if p.requires_grad]
    losses: List[torch.Tensor] = []
    micros = []
    limits, name = token_limits(pipeline.stage_module), _model_name(pipeline.stage_module)
    # The native pipeline's default loss is the causal-LM loss (a loss_fn of the user's takes its own labels).
    own_loss = getattr(pipeline, "loss_fn", None) is None
    with _checks_agreed_at_the_first_call(result):
        for micro in split_batch(batch, steps):
            check_token_range(micro, name, limits, labels=own_loss)
            micro = result.prepare_input(micro)
            check_batch(micro, causal_lm=own_loss)
            micros.append(micro)
    shares = _TokenShares.count(result, micros) if by_tokens else None
    with _pipeline_loss_over_global_tokens(pipeline, shares):
        for micro in micros:
            stash = [p.grad for p in params]
            for p in params:
                p.grad = None
            losses.append(pipeline.forward_backward(micro))
            with torch.no_grad():
                for p, old in zip(params, stash):
                    if old is not None:
                        p.grad = old if p.grad is None else p.grad.add_(old)
    if steps > 1 and shares is None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.div_(steps)
    norm = None
    if max_grad_norm is not None:
        norm = clip_grad_norm_(result, max_grad_norm)
        _refuse_a_step_on_a_nonfinite_norm(result, norm, _mean(losses))   # the last stage's, on every stage
    optim = cast(torch.optim.Optimizer, result.optim)  # as in train_step: a step needs the optimizer
    optim.step()
    optim.zero_grad(set_to_none=True)
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    return StepStats(_mean(losses) if shares is None else shares.global_mean(losses), norm, steps)


@contextlib.contextmanager
def _pipeline_loss_over_global_tokens(pipeline: Any, shares: Optional[_TokenShares]) -> Iterator[None]:
    """Under `shares`, the pipeline's loss for the step: each chunk's summed token loss over the global
    batch's label tokens / the data ranks (which its gradient average divides by again), instead of
    over the per-rank batch's tokens.

    The native pipeline divides by its own batch's count and has no argument for another, so its
    `loss_fn` (None: its causal-LM loss, which `_weights_by_tokens` requires) is set for the step; the
    pipeline divides a loss_fn's value by its chunks, which the scale multiplies back."""
    if shares is None:
        yield
        return
    scale = shares.per_token * pipeline.chunks

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_labels_fit_logits(logits, labels)
        return causal_lm_loss(logits, labels, reduction="sum") * scale.to(logits.device)

    pipeline.loss_fn = loss_fn
    try:
        yield
    finally:
        pipeline.loss_fn = None


# -- the global gradient norm -----------------------------------------------------------------

def _shard_roles(result: AutoAccelerateResult) -> Tuple[List[Tuple[torch.Tensor, Tuple[str, ...]]], Dict[str, Any],
                                                        List[torch.Tensor]]:
    """[(local gradient, roles it is sharded over)], {role: process group}, and the gradients to scale
    without counting them (the last pipeline stage's copy of a tied weight: the first stage counts it).

    Roles: "mesh:<dim>" for a DTensor sharded over that mesh dimension (FSDP2), "tensor" for
    a slice of atorch's tensor-parallel layers, "pipeline" for a stage's own parameters.
    """
    from torch.distributed.tensor import DTensor

    pipeline = result.pipeline
    model = pipeline.stage_module if pipeline is not None else result.model
    groups: Dict[str, Any] = {}
    tp_slices = _tensor_parallel_slices(model, groups)
    skip = set()
    if pipeline is not None:
        if pipeline.num_stages > 1:
            groups["pipeline"] = pipeline.group
        if pipeline.tied_param is not None and pipeline.is_last:   # the first stage counts the tied weight
            skip.add(id(pipeline.tied_param))
    out: List[Tuple[torch.Tensor, Tuple[str, ...]]] = []
    uncounted: List[torch.Tensor] = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in skip:
            uncounted.append(p.grad)
            continue
        grad = p.grad
        roles: List[str] = []
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
            for dim, placement in enumerate(grad.placements):
                if placement.is_shard() and mesh.size(dim) > 1:
                    role = f"mesh:{names[dim]}"
                    groups.setdefault(role, mesh.get_group(dim))
                    roles.append(role)
            grad = grad.to_local()
        if id(p) in tp_slices:
            roles.append("tensor")
        if "pipeline" in groups:
            roles.append("pipeline")
        out.append((grad, tuple(roles)))
    return out, groups, uncounted


def _tensor_parallel_slices(model: nn.Module, groups: Dict[str, Any]) -> set:
    """ids of the parameters that are slices of atorch's tensor-parallel layers (looked up by name,
    so FSDP2's DTensor parameters, which replace the originals, are found too)."""
    from atorch.modules.distributed_modules.layers import TensorParallelModule

    ids = set()
    for sub in model.modules():
        if isinstance(sub, TensorParallelModule) and sub.tp_size > 1:
            groups.setdefault("tensor", sub.group)
            for name in sub.shard_specs():
                param = getattr(sub, name, None)
                if param is not None:
                    ids.add(id(param))
    return ids


@torch.no_grad()
def clip_grad_norm_(result: AutoAccelerateResult, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of `result.model` to a global norm of `max_norm`; return the norm before clipping.

    Collective over the groups the gradients are sharded over (every rank of them must call
    it). Equal to `torch.nn.utils.clip_grad_norm_` on the gradients of the unsharded model; under fp16
    `amp_native` the gradients are unscaled first (the optimizer's step then does not unscale them again).
    For DeepSpeed engines, which clip inside `engine.step()`, use `train_step(max_grad_norm=)`.
    """
    _check_result("clip_grad_norm_", result)
    _check_max_norm("clip_grad_norm_: max_norm", max_norm)
    if result.engine is not None:
        raise ValueError("clip_grad_norm_: a DeepSpeed engine clips in engine.step(); pass max_grad_norm to "
                         "atorch.auto.train_step instead")
    norm_type = float(norm_type)
    # fp16 amp_native: the gradients carry the loss scale until the optimizer's step; a hand-written loop
    # clipping them as they are measured the norm x 65536 and clipped 65536-fold too hard.
    _unscale_for_clipping(result.optim)
    grads, groups, uncounted = _shard_roles(result)
    roles = sorted(groups)          # the same order on every rank: every rank holds the same kinds of shards
    device = grads[0][0].device if grads else torch.device("cpu")
    partial = torch.zeros(1 << len(roles), dtype=torch.float64, device=device)
    for grad, grad_roles in grads:
        key = sum(1 << roles.index(r) for r in grad_roles)
        g = grad.detach().double()
        if math.isinf(norm_type):
            partial[key] = torch.maximum(partial[key], g.abs().max()) if g.numel() else partial[key]
        else:
            partial[key] += g.abs().pow(norm_type).sum()
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for bit, role in enumerate(roles):
        group = groups[role]
        if dist.get_world_size(group) == 1:
            continue
        mask = torch.tensor([(k >> bit) & 1 for k in range(partial.numel())], dtype=torch.bool, device=device)
        reduced = torch.where(mask, partial, torch.zeros_like(partial))
        dist.all_reduce(reduced, op=op, group=group)
        partial = torch.where(mask, reduced, partial)
    total = partial.max() if math.isinf(norm_type) else partial.sum().pow(1.0 / norm_type)
    total = total.float()
    # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never up.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # Both copies of a tied weight are scaled alike, or the stages' copies drift apart.
    for grad in itertools.chain((g for g, _ in grads), uncounted):
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
