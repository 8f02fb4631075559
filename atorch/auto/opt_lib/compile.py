"""`compile`: torch.compile each transformer block (default) or the whole model, on any device.

Where it sits, as torchtitan places it: after tensor parallelism, activation checkpointing and
module replacement (so the compiled code is the block those produced, recomputation included)
and before sharding (FSDP2's unshard/reshard hooks then run around the compiled block, not
inside the graph). The block's `forward` is replaced on the instance by its compiled version,
so module structure, parameter names and state-dict keys stay exactly as they were (no
`_orig_mod.` prefix), and module hooks stay outside the compiled region.

Per block rather than whole model: blocks of one class share one compiled graph (dynamo treats
their parameters as inputs), so the compile time is one block's, and a graph break in the
model's glue code costs nothing. Inductor runs on CPU as well as GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib._sharding import ClassSpec, normalize_wrap_cls
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.utils.module_utils import modules_of_classes, resolve_module_classes

logger = logging.getLogger(__name__)

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SCOPES = ("block", "model")
# Step time compiled / eager, by device type: what the cost model multiplies compute time by.
# "cpu": measured here, per-block compile of a 98M Llama, fp32 AdamW, 1 thread: CPU seconds per
# step compiled / eager 0.92 (0.88-0.94 over 6 interleaved rounds; benchmarks/compile.py,
# benchmarks/RESULTS.md "Compile"; wall time on the loaded machine was too noisy to use).
# "cuda" (and other accelerators): an assumption, not measured here -- PyTorch and IBM report
# torch.compile raising training MFU by 10-23% on Llama-style models with FSDP and activation
# checkpointing on A100s (pytorch.org/blog/maximizing-training-throughput), i.e. a factor
# 0.81-0.91; 1 / 1.15 is taken.
COMPUTE_TIME_FACTOR: Dict[str, float] = {"cpu": 0.92, "cuda": 0.87}
# The forward an instance had before compiling (kept so the module can be inspected or restored).
_EAGER_FORWARD_ATTR = "_atorch_forward_before_compile"


@dataclass(frozen=True)
class CompileConfig:
    """How to compile."""

    scope: str = "block"
    """"block": each transformer block (`wrap_cls`); "model": the whole model's forward."""
    wrap_cls: Optional[Tuple[ClassSpec, ...]] = None
    """Block classes or class names for scope="block"; None: the model's transformer block, auto-detected."""
    mode: Optional[str] = None
    """torch.compile mode (None: torch's default); one of MODES."""
    fullgraph: bool = False
    """Fail instead of falling back to eager at a graph break."""
    dynamic: Optional[bool] = None
    """torch.compile's dynamic-shape setting (None: decide from the shapes seen)."""

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"compile: scope={self.scope!r}; valid scopes are {list(SCOPES)}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"compile: mode={self.mode!r}; valid modes are {list(MODES)} or None")
        for key in ("fullgraph",):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"compile: {key}={getattr(self, key)!r} must be True or False")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ValueError(f"compile: dynamic={self.dynamic!r} must be True, False or None")
        object.__setattr__(self, "wrap_cls", normalize_wrap_cls("compile", self.wrap_cls))
        if self.scope == "model" and self.wrap_cls is not None:
            raise ValueError("compile: wrap_cls applies to scope='block' only")


def compile_forward(module: nn.Module, config: CompileConfig) -> None:
    """Replace `module.forward` by its compiled version (on the instance; keys and hooks unchanged)."""
    eager = module.forward
    compiled = torch.compile(eager, mode=config.mode, fullgraph=config.fullgraph, dynamic=config.dynamic)
    setattr(module, _EAGER_FORWARD_ATTR, eager)
    module.forward = compiled


def is_compiled(module: nn.Module) -> bool:
    return _EAGER_FORWARD_ATTR in vars(module)


@register
class CompileOptimization(Optimization):
    name = "compile"
    order = Order.COMPILE
    Config = CompileConfig
    search_dimension = "compile"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        # On CPU a dry run would spend tens of seconds compiling each candidate, more than it
        # measures: offered by default on GPUs only (included=["compile"] searches it anywhere).
        return [None, cls.name] if context.device_type == "cuda" else [None]

    def validate(self, config: CompileConfig, context: ValidationContext) -> None:
        if config.scope == "block" and context.model is not None:
            resolve_module_classes(context.model, config.wrap_cls, "compile: wrap_cls")

    @classmethod
    def cost_traits(cls, config: CompileConfig, context: CostContext) -> Dict[str, Any]:
        # A prior for ranking; the dry run measures the real gain of this model on this device.
        factor = COMPUTE_TIME_FACTOR.get(context.device_type, COMPUTE_TIME_FACTOR["cuda"])
        # apply() turns Hugging Face's key/value cache off for training.
        return {"compute_time_factor": factor, "kv_cache_off": True}

    @classmethod
    def describe_step(cls, config: CompileConfig) -> str:
        return f"{cls.name}({config.scope}{', ' + config.mode if config.mode else ''})"

    def apply(self, ctx: ModelContext, config: CompileConfig) -> None:
        model_config = getattr(ctx.model, "config", None)
        if model_config is not None and getattr(model_config, "use_cache", False) is True:
            # Hugging Face's key/value cache in a training forward: dynamo recompiles each block for
            # its layer's cache state (past torch's recompile limit of 8 the rest ran eager, slower
            # than eager: benchmarks/RESULTS.md, "Compile"), and with activation checkpointing the
            # recompute appends to the cache the forward filled (a shape error). Training needs no
            # cache; `generate` passes use_cache=True itself. Hugging Face's gradient checkpointing
            # makes the same change.
            logger.warning("compile: setting model.config.use_cache = False (a key/value cache makes every compiled "
                           "block recompile and breaks recomputation); generate() still uses its cache")
            model_config.use_cache = False
        if config.scope == "model":
            compile_forward(ctx.model, config)
            summary: dict = {"scope": "model", "modules": 1}
        else:
            classes = resolve_module_classes(ctx.model, config.wrap_cls, "compile: wrap_cls")
            blocks = modules_of_classes(ctx.model, classes)
            # Outermost blocks only: a compiled block already compiles what it contains.
            inside = {id(m) for b in blocks for m in b.modules() if m is not b}
            blocks = [b for b in blocks if id(b) not in inside]
            if not blocks:
                raise ValueError(f"compile: {type(ctx.model).__name__} has no module of {[c.__name__ for c in classes]}"
                                 "; pass wrap_cls, or scope='model'")
            for block in blocks:
                compile_forward(block, config)
            summary = {"scope": "block", "modules": len(blocks), "classes": sorted({type(b).__name__ for b in blocks})}
        summary["mode"] = config.mode or "default"
        ctx.summaries[self.name] = summary
        logger.info("compile: %s", summary)

