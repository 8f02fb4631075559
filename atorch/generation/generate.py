"""The `fused_no_repeat_ngram_blocking=True` keyword of `generate` on models prepared by atorch.

`enable_fused_generate(model)` gives one model (not its class) a `generate` that accepts the
keyword. With it, every `NoRepeatNGramLogitsProcessor` that transformers builds for the call
(from `no_repeat_ngram_size`, or passed in `logits_processor`) is swapped, at the same position
in the processor list, for `FusedNoRepeatNGramLogitsProcessor`. Keeping the position keeps the
order relative to the other processors and warpers (top-k after a ban is not a ban after top-k),
so the result is exactly the one transformers' processor gives.

The switch is a context variable read by the model's `_get_logits_processor`, so concurrent
`generate` calls from several threads, with and without the keyword, do not see each other's.
"""

from __future__ import annotations

import contextvars
import types
from typing import Any, Optional, cast

from torch import nn
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from atorch.generation.ngram import FusedNoRepeatNGramLogitsProcessor

FUSED_NGRAM_KEYWORD = "fused_no_repeat_ngram_blocking"
_fused_ngram: contextvars.ContextVar[bool] = contextvars.ContextVar("atorch_fused_ngram", default=False)


def fuse_ngram_processors(processors: LogitsProcessorList, inplace: bool = False) -> LogitsProcessorList:
    """`processors` with every transformers `NoRepeatNGramLogitsProcessor` replaced in place by the fused one."""
    for i, processor in enumerate(processors):
        if type(processor) is NoRepeatNGramLogitsProcessor:
            processors[i] = FusedNoRepeatNGramLogitsProcessor(processor.ngram_size, inplace=inplace)
    return processors


def _get_logits_processor(model: nn.Module, generation_config: GenerationConfig, *args: Any,
                          **kwargs: Any) -> LogitsProcessorList:
    # transformers' GenerationMixin methods of the model's class, unseen through nn.Module's type.
    processors = cast(Any, type(model))._get_logits_processor(model, generation_config, *args, **kwargs)
    if not _fused_ngram.get():
        return processors
    # Inside generate the scores passed to the processors are a fresh copy of the logits, kept
    # afterwards only when output_logits is on: otherwise ban in place and skip a full copy.
    return fuse_ngram_processors(processors, inplace=not getattr(generation_config, "output_logits", False))


def _generate(model: nn.Module, *args: Any, fused_no_repeat_ngram_blocking: bool = False, **kwargs: Any) -> Any:
    if not isinstance(fused_no_repeat_ngram_blocking, bool):
        raise ValueError(f"generate: {FUSED_NGRAM_KEYWORD} must be True or False, got "
                         f"{fused_no_repeat_ngram_blocking!r}")
    token = _fused_ngram.set(fused_no_repeat_ngram_blocking)
    try:
        return cast(Any, type(model)).generate(model, *args, **kwargs)
    finally:
        _fused_ngram.reset(token)


def _generation_module(model: nn.Module) -> Optional[nn.Module]:
    """The module that owns `generate`: the model, or the model a DDP/FSDP-style wrapper holds in `.module`."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, nn.Module) and hasattr(type(candidate), "_get_logits_processor"):
            return candidate
    return None


def enable_fused_generate(model: nn.Module) -> nn.Module:
    """Let `model.generate(...)` take `fused_no_repeat_ngram_blocking=True`; returns `model`.

    Instance attributes bound with `types.MethodType` (not a subclass): the model keeps its
    type (and so its `save_pretrained` architecture name), and `copy.deepcopy` rebinds them to
    the copy. Models without transformers' generation machinery are returned unchanged.
    """
    target = _generation_module(model)
    if target is not None:
        object.__setattr__(target, "generate", types.MethodType(_generate, target))
        object.__setattr__(target, "_get_logits_processor", types.MethodType(_get_logits_processor, target))
    return model
