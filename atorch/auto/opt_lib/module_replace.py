"""`module_replace`: swap modules for fused equivalents with the same parameters and outputs.

Three kinds, each replaced wherever the model has one: Hugging Face attention switches from
the "eager" implementation to PyTorch `scaled_dot_product_attention`; Llama-style RMSNorm
becomes `FusedRMSNorm` (`F.rms_norm`); GPT-2's tanh GELU written in Python ops becomes
`nn.GELU(approximate="tanh")`. Parameter names, and so state-dict keys, do not change.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.modules.fused import FusedRMSNorm, is_llama_style_rms_norm

logger = logging.getLogger(__name__)

# Attention implementations that materialize the full attention matrix: the ones to replace.
# Any other value ("sdpa", "flash_attention_2", "flex_attention", a hub kernel) is already fused.
_EAGER_ATTENTION = (None, "eager")
_KINDS = ("attention", "norm", "activation")


@dataclass(frozen=True)
class ModuleReplaceConfig:
    """Which kinds of modules to replace; each enabled kind is replaced wherever it occurs."""

    attention: bool = True
    """Hugging Face models on the "eager" attention implementation switch to "sdpa"."""
    norm: bool = True
    """Llama-style RMSNorm modules (LlamaRMSNorm and its copies) become `FusedRMSNorm`."""
    activation: bool = True
    """`NewGELUActivation` / `FastGELUActivation` (GPT-2 style) become `nn.GELU(approximate="tanh")`."""


@dataclass
class ReplacementPlan:
    """What `module_replace` would do to a model; computed without changing it."""

    attention_model: Optional[nn.Module] = None        # the outermost HF model to switch to sdpa
    modules: Dict[int, Tuple[str, str, nn.Module]] = field(default_factory=dict)  # id -> (name, kind, module)
    already_fused: List[str] = field(default_factory=list)
    not_supported: List[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.attention_model is None and not self.modules

    def counts(self) -> Dict[str, int]:
        out = {kind: 0 for kind in _KINDS}
        if self.attention_model is not None:
            out["attention"] = 1
        for _, kind, _ in self.modules.values():
            out[kind] += 1
        return out


def _loaded_transformers_attr(module: str, name: str) -> Any:
    """`transformers.<module>.<name>` if transformers is already imported, else None.

    A model can only hold Hugging Face modules if transformers was imported to build it, so
    this avoids importing transformers (seconds) for plain PyTorch models.
    """
    mod = sys.modules.get(f"transformers.{module}")
    return getattr(mod, name, None)


def _python_gelu_classes() -> Tuple[type, ...]:
    classes = (_loaded_transformers_attr("activations", "NewGELUActivation"),
               _loaded_transformers_attr("activations", "FastGELUActivation"))
    return tuple(c for c in classes if c is not None)


def _plan_attention(model: nn.Module, plan: ReplacementPlan) -> None:
    pretrained_cls = _loaded_transformers_attr("modeling_utils", "PreTrainedModel")
    if pretrained_cls is None:
        return
    # The outermost Hugging Face model: set_attn_implementation propagates to its sub-models.
    hf_model = next((m for m in model.modules() if isinstance(m, pretrained_cls)), None)
    if hf_model is None:
        return
    name = type(hf_model).__name__
    current = getattr(hf_model.config, "_attn_implementation", None)
    if current not in _EAGER_ATTENTION:
        plan.already_fused.append(f"{name} attention ({current!r})")
    elif not getattr(hf_model, "_supports_sdpa", False):
        plan.not_supported.append(f"{name} attention (the model does not support 'sdpa')")
    elif not type(hf_model)._can_set_attn_implementation():
        plan.not_supported.append(f"{name} attention (the model cannot switch implementation after construction)")
    else:
        plan.attention_model = hf_model


def plan_replacements(model: nn.Module, config: ModuleReplaceConfig) -> ReplacementPlan:
    """Find what `config` would replace in `model`, without changing anything."""
    plan = ReplacementPlan()
    if config.attention:
        _plan_attention(model, plan)
    gelu_classes = _python_gelu_classes() if config.activation else ()
    for name, module in model.named_modules():
        if config.norm and is_llama_style_rms_norm(module):
            plan.modules[id(module)] = (name, "norm", module)
        elif config.norm and isinstance(module, (FusedRMSNorm, nn.RMSNorm)):
            plan.already_fused.append(f"{name} ({type(module).__name__})")
        elif gelu_classes and type(module) in gelu_classes:
            plan.modules[id(module)] = (name, "activation", module)
    return plan


def _fused_equivalent(kind: str, module: nn.Module) -> nn.Module:
    if kind == "norm":
        return FusedRMSNorm.from_module(module)
    if kind == "activation":
        # Both Python GELUs compute 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))), which is
        # exactly the tanh approximation torch implements as one kernel.
        return nn.GELU(approximate="tanh")
    raise AssertionError(f"unknown replacement kind {kind!r}")


@register
class ModuleReplaceOptimization(Optimization):
    """Fused attention, RMSNorm and GELU with unchanged parameters, before anything wraps the blocks."""

    name = "module_replace"
    order = Order.MODULE_REPLACE
    Config = ModuleReplaceConfig

    @classmethod
    def cost_traits(cls, config: ModuleReplaceConfig, context: CostContext) -> Dict[str, Any]:
        # sdpa attention never materializes the b x heads x s x s matrix.
        return {"fused_attention": bool(config.attention)}

    @classmethod
    def parse_config(cls, raw: Any) -> ModuleReplaceConfig:
        """Also accept a list of kind names, e.g. ["attention", "norm"]: exactly those are replaced."""
        if isinstance(raw, (list, tuple)):
            unknown = [k for k in raw if k not in _KINDS]
            if unknown:
                raise ValueError(f"module_replace: unknown replacement kind(s) {unknown}; valid kinds are "
                                 f"{list(_KINDS)}")
            return ModuleReplaceConfig(**{kind: kind in raw for kind in _KINDS})
        return super().parse_config(raw)

    def validate(self, config: ModuleReplaceConfig, context: ValidationContext) -> None:
        enabled = [f.name for f in fields(config) if getattr(config, f.name)]
        if not enabled:
            raise ValueError(f"module_replace: config {config} enables no replacement; enable at least one of "
                             f"{list(_KINDS)} or drop module_replace from the strategy")
        if context.model is None:
            return
        plan = plan_replacements(context.model, config)
        if plan.is_empty() and not plan.already_fused:
            found = f"; not replaceable: {plan.not_supported}" if plan.not_supported else ""
            raise ValueError(
                f"module_replace: nothing to replace in {type(context.model).__name__} for kinds {enabled} "
                "(looked for Hugging Face attention on the 'eager' implementation, Llama-style RMSNorm, and "
                f"NewGELUActivation/FastGELUActivation){found}; drop module_replace from the strategy")

    def apply(self, ctx: ModelContext, config: ModuleReplaceConfig) -> None:
        plan = plan_replacements(ctx.model, config)
        if plan.already_fused:
            logger.info("module_replace: already fused, left as is: %s", plan.already_fused)
        if plan.attention_model is not None:
            _switch_to_sdpa(plan.attention_model)
        replacements = {key: _fused_equivalent(kind, module) for key, (_, kind, module) in plan.modules.items()}
        # Walk every parent's registered children directly: named_modules and named_children list a
        # module registered under two names once only, and both names must get the replacement.
        for parent in list(ctx.model.modules()):
            for child_name, child in list(parent._modules.items()):
                if id(child) in replacements:
                    setattr(parent, child_name, replacements[id(child)])
        counts = plan.counts()
        ctx.summaries["module_replace"] = counts
        logger.info("module_replace: replaced %s", counts)


def _switch_to_sdpa(hf_model: nn.Module) -> None:
    hf_model.set_attn_implementation("sdpa")
    # transformers only logs a warning when a sub-model cannot switch; a silent half switch
    # would leave eager attention in place, so check every sub-model's config.
    pretrained_cls = _loaded_transformers_attr("modeling_utils", "PreTrainedModel")
    stale = [type(m).__name__ for m in hf_model.modules()
             if isinstance(m, pretrained_cls) and m.config._attn_implementation in _EAGER_ATTENTION]
    if stale:
        raise RuntimeError(f"module_replace: set_attn_implementation('sdpa') left {stale} on eager attention")
