"""Batches and loss shared by the pipeline engines: HF batch dicts in, causal-LM loss out.

The same dataloader (dicts with `input_ids`, `labels`, optional `attention_mask`) serves
every strategy; these helpers turn it into what a pipeline stage consumes. The rows of a batch
and its split into micro-batches (`find_batch_rows`, `cut_rows`) are also `atorch.auto.train_step`'s.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100  # the label value Hugging Face losses skip


def check_labels_fit_logits(logits: torch.Tensor, labels: torch.Tensor, hint: str = "") -> None:
    """ValueError naming both shapes unless `labels` has the shape of `logits` without its vocabulary dimension.

    Without it, labels of another sequence length reached cross_entropy flattened and failed with
    "Expected input batch_size (30) to match target batch_size (62)": token counts, not batch sizes.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"the labels of shape {tuple(labels.shape)} do not fit the logits of shape "
                         f"{tuple(logits.shape)}: a causal-LM loss needs labels of shape {tuple(logits.shape[:-1])} "
                         f"(the logits' without the vocabulary dimension, i.e. input_ids' shape){hint}")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Hugging Face's causal-LM loss: predict token t+1 from position t, mean (or with reduction="sum",
    sum) over non-ignored labels.

    Logits are upcast to fp32 like the HF loss, so bf16 activations still give an fp32 loss. Labels of
    another shape than the logits' leading dims raise ValueError (`check_labels_fit_logits`).
    """
    check_labels_fit_logits(logits, labels)
    shift_logits = logits[..., :-1, :].contiguous().float()
    shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
    return nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                                       ignore_index=IGNORE_INDEX, reduction=reduction)


class CausalLMLoss:
    """`loss_fn(logits, labels)` of a pipeline's last stage, for full or vocabulary-split logits.

    Under tensor parallelism the LM head may keep its output split over the vocabulary (the
    presets do: no rank then holds [tokens, vocab] logits); the loss is then the
    vocabulary-parallel cross entropy over `group`. Logits whose last dimension is the whole
    vocabulary (a gathering head, or a `logit_helper` that gathered them) take the plain loss.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, vocab_size: Optional[int] = None):
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.group is None or self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return causal_lm_loss(logits, labels)
        from atorch.modules.distributed_modules.cross_entropy import vocab_parallel_cross_entropy

        check_labels_fit_logits(logits, labels)
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
        return vocab_parallel_cross_entropy(shift_logits, shift_labels, group=self.group, vocab_size=self.vocab_size,
                                            ignore_index=IGNORE_INDEX, reduction="mean")


def hf_inputs(batch: Mapping[str, torch.Tensor]) -> tuple:
    """`(input_ids, attention_mask)` of a HF batch; the mask is all ones when absent.

    The mask is always present so every micro-batch has the same tuple structure, which the
    pipeline's fixed send/receive buffers require.
    """
    if "input_ids" not in batch:
        raise ValueError(f"a pipeline batch needs 'input_ids' (and 'labels'); got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(input_ids.dtype)
    return input_ids, mask


# What a native pipeline passes on from a batch dict: `input_ids` and `attention_mask` to the first
# stage, `labels` to the loss on the last one, and `position_ids` to the first stage when its first
# piece takes them (`takes_position_ids`). Any other key would be dropped, so it is refused.
PIPELINE_INPUT_KEYS = ("input_ids", "attention_mask")
PIPELINE_LABEL_KEY = "labels"
POSITION_IDS_KEY = "position_ids"


def pipeline_batch_keys(takes_position_ids: bool) -> Tuple[str, ...]:
    """The batch keys a native pipeline passes on (the others are refused by `check_pipeline_batch`)."""
    return PIPELINE_INPUT_KEYS + ((POSITION_IDS_KEY,) if takes_position_ids else ()) + (PIPELINE_LABEL_KEY,)


def check_no_router_aux_loss(who: str, model_config: Any) -> None:
    """Refuse a mixture-of-experts model set to add the router's load-balancing loss to its loss.

    A pipeline's loss is the causal-LM loss of the last stage's logits (`CausalLMLoss`); the
    router loss is computed from every layer's router logits at once, which no stage holds, so
    the pipeline would silently train without it. A coefficient of 0 adds nothing: accepted.
    """
    if not getattr(model_config, "output_router_logits", False):
        return
    coef = getattr(model_config, "router_aux_loss_coef", None)
    if coef is not None and not coef:
        return
    raise ValueError(f"{who} cannot train {getattr(model_config, 'model_type', 'this model')} with "
                     f"output_router_logits=True (router_aux_loss_coef={coef!r}): the router's load-balancing "
                     "loss is computed from the router logits of all layers together, which no pipeline stage "
                     "has, so the pipeline would silently leave it out; set model.config.output_router_logits = "
                     "False to train without it, or use tensor_parallel or fsdp, which add it as the model does")


def check_pipeline_batch(batch: Any, takes_position_ids: bool, what: str = "the batch", shapes: bool = True,
                         who: str = "pipeline_parallel") -> None:
    """ValueError unless `batch` is a dict with `input_ids` whose every key the pipeline passes on
    (and, with `shapes`, 2-D input_ids with a mask and position ids to match; False for one sample).

    Local and cheap: run on every rank before the schedule's first send, so a batch the pipeline
    would train on wrongly (a dropped key) or crash on (a tuple) is refused everywhere alike.
    """
    keys = pipeline_batch_keys(takes_position_ids)
    if not isinstance(batch, Mapping):
        raise ValueError(f"{who} needs dict batches with 'input_ids' and 'labels' (labels default to "
                         f"input_ids), but {what} is a {type(batch).__name__}; return a dict such as "
                         "{'input_ids': ..., 'labels': ...} from the dataset (model_input_format='unpack_dict'), "
                         "or pass a collate_fn in dataloader_args or a prepare_input that builds one")
    if "input_ids" not in batch:
        raise ValueError(f"{who} needs 'input_ids' (and 'labels') in every batch; {what} has keys "
                         f"{sorted(map(str, batch))}")
    unknown = [str(k) for k in batch if k not in keys]
    if unknown:
        why = ""
        if POSITION_IDS_KEY in unknown:
            why = (" (position_ids: the custom_patcher's first piece does not take them; a patch_fn with "
                   "`patch_fn.takes_position_ids = True` receives (input_ids, attention_mask, position_ids))")
        raise ValueError(f"{who} passes only {list(keys)} of a batch on to the model (input_ids, "
                         f"attention_mask{', position_ids' if takes_position_ids else ''} to the first stage, labels "
                         f"to the loss on the last), but {what} also has {unknown}, which the stages would never "
                         f"see{why}; drop {'it' if len(unknown) == 1 else 'them'} from the batch (dataset, "
                         "collate_fn or prepare_input), or train with tensor_parallel or fsdp, which pass every "
                         "key to the model")
    if not shapes:
        return
    ids, positions = batch["input_ids"], batch.get(POSITION_IDS_KEY)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"{who} takes input_ids as a 2-D tensor [rows, tokens]; {what} has input_ids "
                         f"{_shape(ids)}")
    if positions is not None and (not isinstance(positions, torch.Tensor) or positions.is_floating_point()
                                  or not _broadcasts(tuple(positions.shape), tuple(ids.shape))):
        raise ValueError(f"{who} takes integer position_ids shaped like input_ids {_shape(ids)} (or "
                         f"[1, tokens]); {what} has position_ids {_shape(positions)}")
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        raise ValueError(f"{who} takes a 2-D attention_mask [rows, tokens] shaped like input_ids "
                         f"{_shape(ids)}; {what} has attention_mask {_shape(mask)}")


def check_dataset_sample(dataset: Any, takes_position_ids: bool, who: str = "pipeline_parallel",
                         tuples_pass: bool = False) -> None:
    """`dataset[0]` checked as `check_pipeline_batch` checks a batch (its keys; no shapes: one sample),
    so a dataset the pipeline cannot take is refused when the strategy is applied, before its first step.
    Callers skip it where a collate_fn or prepare_input may reshape the samples. A dataset that cannot
    index 0 (iterable) is left to the per-batch check; `tuples_pass`: a non-dict sample is the user's own
    (DeepSpeed's `batch_fn` passes tuples through)."""
    if dataset is None:
        return
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot index 0: its batches are checked instead
        return
    if tuples_pass and not isinstance(sample, Mapping):
        return
    check_pipeline_batch(sample, takes_position_ids, what="dataset[0]", shapes=False, who=who)


def _broadcasts(shape: Tuple[int, ...], to: Tuple[int, ...]) -> bool:
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(shape[::-1], to[::-1])) and (not to or shape[-1:] == to[-1:])


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def no_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """What a pipeline sends for a batch without attention_mask when it sends position_ids: a mask with
    no columns. The pieces then build the mask Hugging Face builds from `attention_mask=None` (which,
    without a cache, keeps the documents packed into one row apart: `patchers._mask_or_none`)."""
    return input_ids.new_ones((input_ids.shape[0], 0))


def pipeline_inputs(batch: Mapping[str, torch.Tensor], takes_position_ids: bool = False) -> tuple:
    """What the first stage of a native pipeline receives from a batch dict.

    `(input_ids, attention_mask)` as `hf_inputs`, or `(input_ids, attention_mask, position_ids)` when
    the batch has position_ids (refused unless `takes_position_ids`, see `check_pipeline_batch`):
    position ids of shape [1, tokens] are repeated for every row (a pipeline splits each input into
    micro-batches along its rows), and an absent attention_mask is `no_mask`.
    """
    check_pipeline_batch(batch, takes_position_ids)
    positions = batch.get(POSITION_IDS_KEY)
    if positions is None:
        return hf_inputs(batch)
    input_ids = batch["input_ids"]
    positions = positions.to(device=input_ids.device, dtype=torch.long).expand(input_ids.shape).contiguous()
    mask = batch.get("attention_mask")
    mask = no_mask(input_ids) if mask is None else mask.to(input_ids.dtype)
    return input_ids, mask, positions


def hf_labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    labels = batch.get("labels")
    return batch["input_ids"] if labels is None else labels


def hf_batch_fn(batch: Any) -> Any:
    """HF batch dict -> DeepSpeed pipeline micro-batch `((input_ids, attention_mask), labels)`.

    Anything else (already `(inputs, labels)`) passes through unchanged.
    """
    if not isinstance(batch, Mapping):
        return batch
    return hf_inputs(batch), hf_labels(batch)


def find_batch_rows(batch: Any) -> Optional[int]:
    """Rows of the first tensor (dim >= 1) found in a (nested) batch; None when it holds none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() >= 1 else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        rows = find_batch_rows(value)
        if rows is not None:
            return rows
    return None


def batch_rows(batch: Any) -> int:
    """`find_batch_rows`, refusing a batch that holds no tensor with rows."""
    rows = find_batch_rows(batch)
    if rows is None:
        raise ValueError(f"a batch of {type(batch).__name__} holds no tensor with rows (dim >= 1) to count or split")
    return rows


def cut_rows(batch: Any, rows: int, sizes: Sequence[int]) -> List[Any]:
    """`batch` cut along its `rows` into consecutive pieces of `sizes` rows: tensors whose first dimension is
    `rows` are sliced; anything else (scalars, strings, per-batch settings) is shared by every piece."""
    starts = [0, *itertools.accumulate(sizes)]
    return [_slice_rows(batch, rows, start, stop) for start, stop in zip(starts, starts[1:])]


def _slice_rows(batch: Any, rows: int, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() >= 1 and batch.shape[0] == rows else batch
    if isinstance(batch, dict):
        return type(batch)({k: _slice_rows(v, rows, start, stop) for k, v in batch.items()})
    if isinstance(batch, Mapping):   # another mapping (e.g. transformers' BatchEncoding): a plain dict
        return {k: _slice_rows(v, rows, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice_rows(v, rows, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice_rows(v, rows, start, stop) for v in batch)
    return batch


def split_micro_batches(batch: Any, num: int) -> List[Any]:
    """Split a (nested) batch into `num` equal micro-batches along the rows of its tensors (`cut_rows`)."""
    rows = batch_rows(batch)
    if num < 1 or rows % num != 0:
        raise ValueError(f"a batch of {rows} rows does not split into {num} equal micro-batches")
    return cut_rows(batch, rows, [rows // num] * num)
