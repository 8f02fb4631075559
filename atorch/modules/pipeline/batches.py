"""Batches and loss shared by the pipeline engines: HF batch dicts in, causal-LM loss out.

The same dataloader (dicts with `input_ids`, `labels`, optional `attention_mask`) serves
every strategy; these helpers turn it into what a pipeline stage consumes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100  # the label value Hugging Face losses skip


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: predict token t+1 from position t, mean over non-ignored labels.

    Logits are upcast to fp32 like the HF loss, so bf16 activations still give an fp32 loss.
    """
    shift_logits = logits[..., :-1, :].contiguous().float()
    shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
    return nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                                       ignore_index=IGNORE_INDEX)


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


def batch_rows(batch: Mapping[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[0]


def split_micro_batches(batch: Mapping[str, torch.Tensor], num: int) -> List[Dict[str, torch.Tensor]]:
    """Split a batch dict into `num` equal micro-batches along dim 0."""
    rows = batch_rows(batch)
    if num < 1 or rows % num != 0:
        raise ValueError(f"a batch of {rows} rows does not split into {num} equal micro-batches")
    size = rows // num
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(num)]
