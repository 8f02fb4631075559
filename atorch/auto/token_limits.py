"""What token ids a model can embed: its vocabulary and the longest sequence its position embeddings cover,
read off a (wrapped) Hugging Face model's config, and the per-batch check against them.

Shared by the arguments check (dataset[0], ATorch's sample_batch), `train_step` (every batch) and the planner
(the longest sequence a search may plan for); below all of them, so none imports another for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Tuple

import torch

from atorch.auto.model_context import users_module
from atorch.auto.user_errors import UserValueError
from atorch.modules.pipeline.batches import IGNORE_INDEX

# Config fields naming the longest sequence, in the order they are looked for (GPT-2 calls it n_positions).
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
# Token ids' dtypes (train_step checks a batch's ids against them too).
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def position_limit(config: Any) -> Optional[Tuple[str, int]]:
    """(field, value): the longest sequence a model config's position embeddings cover, the field named as the
    config names it (GPT-2's n_positions); None where the config declares no limit (e.g. BLOOM's ALiBi)."""
    found = next(((f, getattr(config, f)) for f in _POSITION_FIELDS
                  if isinstance(getattr(config, f, None), int) and getattr(config, f) > 0), None)
    if found is None:
        return None
    field, value = found
    return (getattr(config, "attribute_map", None) or {}).get(field, field), value


def token_limits(model: Any) -> Tuple[Optional[int], Optional[Tuple[str, int]]]:
    """(vocabulary size, (position field, longest sequence)) of a Hugging Face model under atorch's wrappers
    (DDP, DeepSpeed engines: `.module`; peft), read off its (text) config; None for what it does not declare."""
    inner = users_module(model)
    # A native pipeline stage (PipelineStageModule) keeps its model's config as `hf_config`.
    config = getattr(inner, "config", None) or getattr(inner, "hf_config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    # An embedding larger than the config says (padded, or resized without updating it) embeds those ids too;
    # a tensor-parallel shard holds fewer rows than the vocabulary, so the larger of the two.
    embeddings = getattr(inner, "get_input_embeddings", None)
    try:
        rows = getattr(embeddings() if callable(embeddings) else None, "num_embeddings", None)
    except (NotImplementedError, AttributeError):
        rows = None
    if vocab is not None and isinstance(rows, int):
        vocab = max(vocab, rows)
    return vocab, position_limit(text)


def check_token_range(batch: Any, model_name: str, limits: Tuple[Optional[int], Optional[Tuple[str, int]]],
                      labels: bool = False, where: str = "train_step: batch") -> None:
    """ValueError for `input_ids` the model cannot embed: an id outside its vocabulary (torch's "index out of
    range in self" on CPU, a device-side assert that ends the process on a GPU) or a sequence longer than its
    position embeddings (GPT-2's learned positions fail the same way; a rotary model trains silently beyond
    the positions it was trained on). With `labels` (a loss reads them as token ids: a causal LM's forward
    computes its loss from them), also labels that are neither the ignore index -100 nor a token id
    (`check_label_range`). The arguments check reads dataset[0]; train_step every batch. A batch still on the
    host only: on a GPU the reduction would wait for the device every step. `where` names the batch in the
    messages."""
    _check_id_range(batch, model_name, limits, where)
    if labels:
        check_label_range(batch, limits[0], where)


def _check_id_range(batch: Any, model_name: str, limits: Tuple[Optional[int], Optional[Tuple[str, int]]],
                    where: str) -> None:
    """`check_token_range` for `input_ids`."""
    ids = _on_host(batch.get("input_ids") if isinstance(batch, Mapping) else None)
    if ids is None:
        return
    vocab, positions = limits
    if positions is not None and ids.dim() >= 2 and ids.shape[-1] > positions[1]:
        raise UserValueError(f"{where}['input_ids'] has {ids.shape[-1]} tokens per row, more than "
                             f"{model_name}'s {positions[0]}={positions[1]}; cut the sequences to at most "
                             f"{positions[1]} tokens (the dataset or collate_fn)")
    if vocab is None:
        return
    low, high = int(ids.min()), int(ids.max())
    if high >= vocab or low < 0:
        bad = high if high >= vocab else low
        raise UserValueError(f"{where}['input_ids'] holds token id {bad}, outside {model_name}'s vocabulary "
                             f"of {vocab} ids (config.vocab_size); a tokenizer with more tokens than the model needs "
                             "model.resize_token_embeddings(len(tokenizer)) before auto_accelerate, and padding or "
                             "ignored positions belong in labels (-100), not in input_ids")


def check_label_range(batch: Any, vocab: Optional[int], where: str = "train_step: batch") -> None:
    """ValueError for `labels` (and `shift_labels`) holding a value that is neither the ignore index -100 nor an
    id in [0, vocab): padding marked -1 (or the pad id of another tokenizer) is no ignored position.

    Without it the loss went wrong three ways: torch's cross entropy raised a bare IndexError ("Target -1 is out
    of bounds"; a device-side assert on a GPU), the vocabulary-parallel loss of tensor_parallel scored such a
    target as if its logit were 0 (a silently wrong loss), and a pipeline's last stage raised while the first
    waited for it until the collective timeout. On the host only, as the ids are."""
    if not isinstance(batch, Mapping) or vocab is None:
        return
    for key in ("labels", "shift_labels"):
        labels = _on_host(batch.get(key))
        if labels is None:
            continue
        if int(labels.min()) >= 0 and int(labels.max()) < vocab:
            continue
        outside = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))]
        if outside.numel():
            raise UserValueError(f"{where}[{key!r}] holds {int(outside[0])}, outside the vocabulary of {vocab} "
                                 f"(ignored positions must be {IGNORE_INDEX}): every label is a token id in "
                                 f"[0, {vocab}) or {IGNORE_INDEX}, which the loss skips; mark padding and prompt "
                                 f"positions with {IGNORE_INDEX} in the dataset or collate_fn")


def _on_host(value: Any) -> Optional[torch.Tensor]:
    """`value` when it is a non-empty integer tensor on the host (the ids the checks read), else None: a tensor on
    a device is not read (the reduction would wait for the device every step), nor anything not token ids."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.dtype not in INTEGER_DTYPES \
            or value.numel() == 0:
        return None
    return value
