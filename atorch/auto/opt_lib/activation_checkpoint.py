"""`checkpoint`: non-reentrant activation checkpointing of transformer blocks, on any device.

Each block keeps only its inputs during the forward pass and recomputes its activations in
backward. The block's `forward` is wrapped in place, so module structure, parameter names,
state-dict keys and module hooks (FSDP2's unshard/reshard among them) stay exactly as they
were: hooks run outside the recomputed region, once per forward and once per backward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._sharding import ClassSpec, normalize_wrap_cls
from atorch.auto.opt_lib.base import ConfigAlias, CostContext, Optimization, Order, ValidationContext, is_true, register
from atorch.utils.module_utils import modules_of_classes, resolve_module_classes

logger = logging.getLogger(__name__)

# Where the forward that ran before checkpointing was enabled is kept, when it was itself an
# instance attribute (another wrapper); otherwise the class's forward is called.
_INNER_FORWARD_ATTR = "_atorch_forward_before_checkpoint"
# Keyword arguments through which Hugging Face blocks read and *write* a KV cache. Recomputing
# the block in backward would write the cache a second time and change the recomputed shapes,
# and training never reuses the cache, so checkpointed blocks run without one while training.
# Besides these names (which transformers renames between releases: `cache` in 5.24), any argument
# holding a transformers `Cache` object is dropped too.
_CACHE_KWARGS = {"use_cache": False, "past_key_values": None, "past_key_value": None, "layer_past": None,
                 "cache": None}


def _is_kv_cache(value: Any) -> bool:
    """A transformers KV cache object (looked up lazily: transformers may not be imported at all)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_cls = getattr(cache_utils, "Cache", None) if cache_utils is not None else None
    return cache_cls is not None and isinstance(value, cache_cls)


def _disabled(name: str, value: Any) -> Any:
    if name in _CACHE_KWARGS:
        return _CACHE_KWARGS[name]
    return None if _is_kv_cache(value) else value


@dataclass(frozen=True)
class CheckpointConfig:
    """Which blocks to recompute in backward."""

    wrap_cls: Optional[Tuple[ClassSpec, ...]] = None
    """Block classes, or their class names; None: the model's transformer block (e.g. LlamaDecoderLayer)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls("checkpoint", self.wrap_cls))


# A plain dict, not functools.lru_cache: the lookup runs inside compiled blocks too, and Dynamo
# warns on every lru_cache-wrapped call it traces (it traces the function, ignoring the cache).
_FORWARD_SIGNATURES: Dict[type, Optional[inspect.Signature]] = {}


def _class_forward_signature(cls: Type[nn.Module]) -> Optional[inspect.Signature]:
    if cls not in _FORWARD_SIGNATURES:
        try:
            _FORWARD_SIGNATURES[cls] = inspect.signature(cls.forward)
        except (TypeError, ValueError):  # a forward without an introspectable signature
            _FORWARD_SIGNATURES[cls] = None
    return _FORWARD_SIGNATURES[cls]


def _without_cache(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                   ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """`args, kwargs` with the KV-cache arguments of `_CACHE_KWARGS` disabled, wherever they are passed.

    Blocks receive the cache positionally too (GPT-2 passes `past_key_values` second), so the
    call is bound to the class forward's signature to find it.
    """
    # A class is hashable; mypy checks nn.Module's instance __hash__ instead.
    sig = _class_forward_signature(type(module))  # type: ignore[arg-type]
    if sig is None or _INNER_FORWARD_ATTR in module.__dict__:
        return args, {k: _disabled(k, v) for k, v in kwargs.items()}
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:  # let the real forward raise its own error
        return args, kwargs
    for name, param in sig.parameters.items():
        if name not in bound.arguments:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = bound.arguments[name]
            bound.arguments[name] = {k: _disabled(k, v) for k, v in extra.items()}
        elif param.kind is not inspect.Parameter.VAR_POSITIONAL:
            bound.arguments[name] = _disabled(name, bound.arguments[name])
    return bound.args[1:], bound.kwargs


def _parallel_randomizer_of(block: nn.Module) -> Any:
    """The tensor-parallel dropout randomizer that `block`'s dropouts draw from, else None.

    Looked up through sys.modules: if its module was never imported, nothing was forked. Only
    the block's own forked modules count, so a randomizer left by another model in this process
    (an earlier dry-run candidate) changes nothing here.
    """
    module = sys.modules.get("atorch.tensor_parallel.randomizer")
    if module is None:
        return None
    return module.randomizer_for(block)


def _randomizer_replay_contexts(randomizer: Any) -> Tuple[contextlib.AbstractContextManager,
                                                           contextlib.AbstractContextManager]:
    """Checkpoint `context_fn` making the recomputation draw the parallel streams the forward drew.

    Tensor-parallel dropouts swap their own per-group stream into the default generator, so
    torch's restoring of the default generator is not enough: the streams are snapshotted
    when the block runs forward, set to that snapshot for the recomputation, and put back
    afterwards so that later forwards continue where they were. The streams active around the
    block (the model's replicated one, `fork_model_rng`) are continued from the default
    generator, which torch restores, as the forward continued them.
    """
    snapshot = randomizer.get_states()
    active = randomizer.active_streams()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = randomizer.get_states()
        randomizer.set_states(snapshot)
        try:
            with randomizer.continuing(active):
                yield
        finally:
            randomizer.set_states(current)

    return contextlib.nullcontext(), replay()


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = self.__dict__.get(_INNER_FORWARD_ATTR) or functools.partial(type(self).forward, self)
    # Outside training (evaluation, no_grad) nothing is saved for backward: nothing to recompute.
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    args, kwargs = _without_cache(self, args, kwargs)
    randomizer = _parallel_randomizer_of(self)
    # The block's keyword arguments travel in a partial: checkpoint() would take some names
    # (debug, context_fn, determinism_check, ...) as its own options.
    if randomizer is None:
        # No context_fn argument at all: torch.compile traces checkpoint() only with the default one.
        return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=False)
    return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=False,
                      context_fn=functools.partial(_randomizer_replay_contexts, randomizer))


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward


def checkpoint_module(module: nn.Module) -> None:
    """Make `module` recompute its forward during backward (non-reentrant `torch.utils.checkpoint`).

    Non-reentrant because the reentrant variant drops gradients of parameters when no block
    input requires grad (frozen embeddings under LoRA) and does not support keyword
    arguments. The wrapper is a method bound to `module`, so `copy.deepcopy` rebinds it to
    the copy. Idempotent.
    """
    if is_checkpointed(module):
        return
    if "forward" in module.__dict__:
        setattr(module, _INNER_FORWARD_ATTR, module.__dict__["forward"])
    module.forward = types.MethodType(_checkpointed_forward, module)


def _outermost(model: nn.Module, targets: Sequence[nn.Module]) -> Tuple[List[nn.Module], int]:
    """Targets not nested in another target, and how many nested ones were dropped."""
    target_ids = {id(m) for m in targets}
    kept: List[nn.Module] = []
    nested = 0

    def visit(module: nn.Module, inside_target: bool) -> None:
        nonlocal nested
        is_target = id(module) in target_ids
        if is_target and inside_target:
            nested += 1
        elif is_target:
            kept.append(module)
        for child in module.children():
            visit(child, inside_target or is_target)

    visit(model, False)
    return kept, nested


def _block_classes(model: nn.Module, config: CheckpointConfig) -> List[Type[nn.Module]]:
    classes = resolve_module_classes(model, config.wrap_cls, what="checkpoint wrap_cls")
    if not classes:
        raise ValueError(
            f"checkpoint: found no transformer block class in {type(model).__name__} (no `_no_split_modules` "
            "class in the model and no nn.ModuleList of a single class); pass wrap_cls=[<block class or name>]")
    absent = [c.__name__ for c in classes if not modules_of_classes(model, [c])]
    if absent:
        raise ValueError(f"checkpoint: wrap_cls {absent} has no instance in {type(model).__name__}")
    return classes


@register
class CheckpointOptimization(Optimization):
    """Recompute block activations in backward: memory for time; must precede sharding wrappers."""

    name = "checkpoint"
    order = Order.CHECKPOINT
    Config = CheckpointConfig
    search_dimension = "checkpoint"

    @classmethod
    def memory_saving(cls, config: CheckpointConfig) -> Dict[str, float]:
        return {"recompute": 1.0}     # the blocks keep their inputs only

    @classmethod
    def cost_traits(cls, config: CheckpointConfig, context: CostContext) -> Dict[str, Any]:
        return {"checkpoint": True}

    config_aliases = {
        "wrap_class": ConfigAlias(to="wrap_cls"),
        "no_reentrant": ConfigAlias(accepts=is_true, instead="atorch always checkpoints non-reentrantly (the "
                                    "reentrant variant drops gradients of blocks whose inputs need none and takes no "
                                    "keyword arguments); drop the key"),
    }

    @classmethod
    def normalize_config(cls, raw: Any) -> Any:
        # ATorch also takes the block classes themselves: ("checkpoint", LlamaDecoderLayer) or a tuple of them.
        if isinstance(raw, type) or (isinstance(raw, (tuple, list)) and raw and
                                     all(isinstance(c, (type, str)) for c in raw)):
            return {"wrap_cls": raw}
        return super().normalize_config(raw)

    def validate(self, config: CheckpointConfig, context: ValidationContext) -> None:
        if context.model is not None:
            _block_classes(context.model, config)

    def apply(self, ctx: ModelContext, config: CheckpointConfig) -> None:
        model = ctx.model
        classes = _block_classes(model, config)
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            # Hugging Face's own checkpointing (`activation_checkpointing_enable`) would nest a second
            # recomputation inside ours; its per-layer switch is the `gradient_checkpointing` flag.
            for m in model.modules():
                if getattr(m, "gradient_checkpointing", False) is True:
                    setattr(m, "gradient_checkpointing", False)  # a plain flag, not a Module or Tensor
            logger.info("checkpoint: replaced the model's Hugging Face gradient checkpointing by atorch's")
        blocks, nested = _outermost(model, modules_of_classes(model, classes))
        if nested:
            logger.info("checkpoint: %d module(s) of %s are inside another checkpointed block; checkpointing "
                        "only the outer ones", nested, [c.__name__ for c in classes])
        for block in blocks:
            checkpoint_module(block)
        summary: Dict[str, Any] = {"blocks": len(blocks), "classes": sorted({type(b).__name__ for b in blocks})}
        ctx.summaries["checkpoint"] = summary
        logger.info("checkpoint: %d blocks of %s recompute their activations in backward; while training they "
                    "run with use_cache=False and no past_key_values", summary["blocks"], summary["classes"])
