"""Full logits from a tensor-parallel model, and with them generation.

The LM head is column-parallel over the vocabulary: each rank computes the logits of its
slice, which is all the vocabulary-parallel cross entropy needs. What the model *returns*
is gathered by `gather_output_logits`, a forward hook on the model that runs after the
model's own loss: `output.logits` is then the unsharded model's [..., vocab] tensor (padding
dropped), identical on every rank of the tensor group. Because the ranks hold identical
logits, `model.generate(...)` (greedy, beam search, sampling with the same seed on every
rank, with the KV cache of this rank's heads) picks the same tokens on every rank, and the
same tokens as the unsharded model.

With `gather_logits=False` the model returns this rank's slice, for the vocabulary-parallel loss,
except inside its own `generate(...)`: a slice's argmax is a different token on every rank (and
ranks stopping at different steps would leave collectives unmatched), so the root's class gains a
`generate` that gathers for its duration (`GathersLogitsWhileGenerating`).

Cost: one all-gather of the logits per forward (B x S x V_local elements per rank in, B x S x V
out) and the full logits' memory while the output is alive; the loss path itself neither
gathers nor backpropagates through the gather unless the caller's loss reads the gathered
logits (the gather is differentiable). `benchmarks/tp_logits.py` measures it against
`gather_logits=False`, which returns the slice.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
from torch import nn

from atorch.tensor_parallel.layers import ColumnParallelLinear
from atorch.tensor_parallel.mappings import gather_from_group
from atorch.tensor_parallel.plan import output_embedding
from atorch.utils.module_utils import derived_class

_GENERATING = "_atorch_tp_generating"   # set in the root's __dict__ while its generate() runs


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module under DistributedDataParallel / DataParallel wrappers."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module) and (
            type(model).__name__ in ("DistributedDataParallel", "DataParallel")):
        model = cast(nn.Module, model.module)
    return model


def _split_head(model: nn.Module) -> Optional[ColumnParallelLinear]:
    head = output_embedding(unwrap_data_parallel(model))
    if not isinstance(head, ColumnParallelLinear) or head.gather_output or head.tp_size == 1:
        return None
    return head


def gather_tp_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this rank's slice (differentiable); full logits are returned unchanged."""
    head = _split_head(model)
    if head is None or logits.shape[-1] != head.out_spec.local_size:
        return logits
    full = gather_from_group(logits, head.group)
    if full.shape[-1] == head.out_features:
        return full
    # The vocabulary was padded to a multiple of the tensor size: drop the padding into a tensor
    # of its own. A view of the gathered one, returned by an FSDP2 root, would lose FSDP's
    # pre-backward hook to any in-place op on it (torch warns on every forward).
    return full[..., :head.out_features].contiguous()


def gather_output_logits(model: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: replace `output.logits` (a transformers ModelOutput) by the gathered full logits."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output.logits = gather_tp_logits(model, logits)
    return output


def gather_output_logits_while_generating(model: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a model returning vocabulary slices (`gather_logits=False`): full logits while its
    `generate` runs, the slices otherwise."""
    return gather_output_logits(model, args, output) if model.__dict__.get(_GENERATING) else output


class GathersLogitsWhileGenerating(nn.Module):
    """Mixin of a root that returns vocabulary slices: its `generate` sees full logits (the hook above)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        outer = self.__dict__.get(_GENERATING, False)
        self.__dict__[_GENERATING] = True
        try:
            return super().generate(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__[_GENERATING] = outer


def gather_logits_for_generate(model: nn.Module) -> None:
    """Give a root returning vocabulary slices full logits inside its `generate` (a no-op without one)."""
    if callable(getattr(type(model), "generate", None)) and not isinstance(model, GathersLogitsWhileGenerating):
        model.__class__ = derived_class(type(model), GathersLogitsWhileGenerating, "SliceLogits", __name__)
        model.register_forward_hook(gather_output_logits_while_generating)
