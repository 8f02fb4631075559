"""ATorch's manual tensor-parallel API at its import path: `TPInfo`, `tp_manual_shard_custom_fn`, helpers.

The implementation is `atorch.utils.manual_tp_utils` (imported from there, so both paths give
the same objects). Differences from ATorch, on purpose:
- `tp_manual_shard_custom_fn(model, tpinfo)` returns the model (marked when on meta, sharded
  when real) instead of None; ATorch's in-place use, ignoring the result, still works for a
  meta model, which is marked in place.
- `hf_init_weights_custom_fn` changes nothing: materialization replays the whole model's
  recorded construction (`torch.manual_seed(seed); Model(config)`), which already runs
  Hugging Face's `_init_weights`, and per-block materialization applies it to each block.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from atorch.utils.manual_tp_utils import TPInfo, tp_manual_shard_custom_fn

__all__ = ["TPInfo", "hf_init_weights_custom_fn", "tp_manual_shard_custom_fn", "vocab_parallel_logit_helper"]


def hf_init_weights_custom_fn(meta_model: nn.Module) -> nn.Module:
    """Check that `meta_model` is a Hugging Face model (has `_init_weights`) and return it unchanged."""
    if not hasattr(meta_model, "_init_weights"):
        raise ValueError(f"hf_init_weights_custom_fn: {type(meta_model).__name__} has no `_init_weights`; it "
                         "applies to Hugging Face PreTrainedModel instances only")
    return meta_model


def vocab_parallel_logit_helper(embed: nn.Module, lm_output: Any) -> torch.Tensor:
    """Logits of this rank's vocabulary slice from a vocabulary-parallel (tied) embedding.

    The hidden states go through `copy_to_group` over atorch's "tensor" group, so their
    gradient sums the contributions of all vocabulary slices.
    """
    from atorch.distributed.distributed import parallel_group
    from atorch.modules.distributed_modules.mappings import copy_to_group

    if isinstance(lm_output, tuple):
        lm_output = lm_output[0]
    if not isinstance(lm_output, torch.Tensor):
        raise ValueError(f"vocab_parallel_logit_helper: lm_output must be a tensor or a tuple starting with one, got "
                         f"{type(lm_output).__name__}")
    return F.linear(copy_to_group(lm_output, parallel_group("tensor")), cast(torch.Tensor, embed.weight))
