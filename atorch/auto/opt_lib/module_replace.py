"""`module_replace`: swap modules for fused equivalents with the same parameters and outputs.

Four kinds, each replaced wherever the model has one, or only in the module classes named:

- `attention`: Hugging Face attention switches from "eager" to PyTorch `scaled_dot_product_attention`
  (the fused scale + mask + softmax (+ dropout) of the system we follow);
- `norm`: Llama-style RMSNorm becomes `FusedRMSNorm` (`F.rms_norm`);
- `activation`: GPT-2's tanh GELU written in Python ops becomes `nn.GELU(approximate="tanh")`;
- `mlp` (off by default): MLPs become `FusedMLP`, bias + activation (+ dropout) or activation x gate
  compiled as one kernel (`atorch.modules.fused.mlp`). Off by default because on CPU it is not
  reliably faster (benchmarks/RESULTS.md, "Kernel fusion") and it compiles on the first call.

Parameter names, and so state-dict keys, do not change.

One rule for every model when something cannot be replaced: if the model has no candidate of the
selected kinds or classes at all, `validate` raises a ValueError naming the model (the strategy
would be meaningless for it); otherwise `apply` logs a notice listing what was replaced, what
was already fused and what was not replaced and why (a WARNING when nothing was replaced), and
the same lists are in the `ModuleReplaceSummary` it stores.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union, cast

from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.modules.fused import FusedRMSNorm, is_llama_style_rms_norm
from atorch.modules.fused.mlp import FusedMLP
from atorch.modules.fused.mlp_layouts import MLPLayout, looks_like_mlp, mlp_layout

logger = logging.getLogger(__name__)

# Attention implementations that materialize the full attention matrix: the ones to replace.
# Any other value ("sdpa", "flash_attention_2", "flex_attention", a hub kernel) is already fused.
_EAGER_ATTENTION = (None, "eager")
KINDS = ("attention", "norm", "activation", "mlp")


@dataclass(frozen=True)
class ModuleReplaceConfig:
    """Which modules to replace: every module of an enabled kind, plus every module of a listed class."""

    attention: bool = True
    """Hugging Face models on the "eager" attention implementation switch to "sdpa"."""
    norm: bool = True
    """Llama-style RMSNorm modules (LlamaRMSNorm and its copies) become `FusedRMSNorm`."""
    activation: bool = True
    """`NewGELUActivation` / `FastGELUActivation` (GPT-2 style) become `nn.GELU(approximate="tanh")`."""
    mlp: bool = False
    """MLPs (GPT-2, GPT-J, GPT-NeoX, Falcon, and every Llama-style gated MLP) become `FusedMLP`."""
    classes: Tuple[str, ...] = ()
    """Module class names replaced whatever the kind flags say, e.g. ("LlamaMLP", "LlamaAttention")."""

    def enabled(self) -> List[str]:
        return [kind for kind in KINDS if getattr(self, kind)] + [f"class {c}" for c in self.classes]


@dataclass(frozen=True)
class ModuleReplaceSummary:
    """What `module_replace` did to one model (result.summaries["module_replace"] / `fuse(...)`'s return)."""

    model: str
    replaced: Tuple[Tuple[str, str, str], ...] = ()
    """(kind, module name, "Old -> New") for each replacement; attention is one entry for the model."""
    already_fused: Tuple[str, ...] = ()
    not_replaced: Tuple[str, ...] = ()
    """"name (Class): reason" for each candidate of a selected kind or class that was left as is."""

    def counts(self) -> Dict[str, int]:
        out = {kind: 0 for kind in KINDS}
        for kind, _, _ in self.replaced:
            out[kind] += 1
        return out

    def describe(self) -> str:
        replaced = [f"{name} ({what})" for _, name, what in self.replaced]
        return (f"{self.model}: replaced {self.counts()} {replaced}; already fused {list(self.already_fused)}; "
                f"not replaced {list(self.not_replaced)}")


@dataclass
class ReplacementPlan:
    """What `module_replace` would do to a model; computed without changing it."""

    model_name: str = ""
    attention_model: Optional[nn.Module] = None        # the outermost HF model to switch to sdpa
    attention_config: Any = None                       # or a pipeline stage's HF config (a stage is no HF model)
    modules: Dict[int, Tuple[str, str, nn.Module]] = field(default_factory=dict)  # id -> (name, kind, module)
    already_fused: List[str] = field(default_factory=list)
    not_supported: List[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.attention_model is None and self.attention_config is None and not self.modules

    def found_nothing(self) -> bool:
        return self.is_empty() and not self.already_fused and not self.not_supported


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


def _attention_classes(model: nn.Module) -> List[str]:
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})


def _plan_attention(model: nn.Module, plan: ReplacementPlan) -> None:
    pretrained_cls = _loaded_transformers_attr("modeling_utils", "PreTrainedModel")
    if pretrained_cls is None:
        return
    # The outermost Hugging Face model: set_attn_implementation propagates to its sub-models.
    hf_model = next((m for m in model.modules() if isinstance(m, pretrained_cls)), None)
    if hf_model is None:
        _plan_stage_attention(model, plan)
        return
    name = type(hf_model).__name__
    current = getattr(hf_model.config, "_attn_implementation", None)
    if current not in _EAGER_ATTENTION:
        plan.already_fused.append(f"{name} attention ({current!r})")
    elif not getattr(hf_model, "_supports_sdpa", False):
        plan.not_supported.append(f"{name} attention: the model does not support 'sdpa'")
    elif not type(hf_model)._can_set_attn_implementation():
        plan.not_supported.append(f"{name} attention: the model cannot switch implementation after construction")
    else:
        plan.attention_model = hf_model


def _plan_stage_attention(model: nn.Module, plan: ReplacementPlan) -> None:
    """A pipeline stage (`PipelineStageModule`) holds Hugging Face layers but no `PreTrainedModel`: its
    layers read the attention implementation from the config it records, which is switched instead."""
    stage = next((m for m in model.modules() if getattr(m, "hf_config", None) is not None), None)
    if stage is None:
        return
    name, config = type(stage).__name__, stage.hf_config
    current = getattr(config, "_attn_implementation", None)
    if current not in _EAGER_ATTENTION:
        plan.already_fused.append(f"{name} attention ({current!r})")
    elif not getattr(stage, "hf_supports_sdpa", False):
        plan.not_supported.append(f"{name} attention: the model does not support 'sdpa'")
    else:
        plan.attention_config = config


def _kind_of(module: nn.Module, gelu_classes: Tuple[type, ...]) -> Optional[str]:
    """The replacement kind a module is a candidate of (replaceable, already fused or not supported), or None."""
    if looks_like_mlp(module) or isinstance(module, FusedMLP):
        return "mlp"
    if is_llama_style_rms_norm(module) or isinstance(module, (FusedRMSNorm, nn.RMSNorm)) \
            or type(module).__name__.endswith("RMSNorm"):
        return "norm"
    if gelu_classes and type(module) in gelu_classes:
        return "activation"
    if type(module).__name__.endswith("Attention"):
        return "attention"
    return None


def _selected(kind: str, module: nn.Module, config: ModuleReplaceConfig) -> bool:
    return getattr(config, kind) or type(module).__name__ in config.classes


def plan_replacements(model: nn.Module, config: ModuleReplaceConfig) -> ReplacementPlan:
    """Find what `config` would replace in `model`, without changing anything."""
    plan = ReplacementPlan(model_name=type(model).__name__)
    # Attention is switched model-wide (all attention modules read one config): by kind, or
    # when one of the listed classes is an attention module of this model.
    if config.attention or set(config.classes) & set(_attention_classes(model)):
        _plan_attention(model, plan)
    gelu_classes = _python_gelu_classes()
    inside_fused_mlp: Set[int] = set()   # ids of modules inside an MLP that is fused whole
    for name, module in model.named_modules():
        if id(module) in inside_fused_mlp:
            continue
        label = f"{name or '<root>'} ({type(module).__name__})"
        if looks_like_mlp(module) and _selected("mlp", module, config):
            layout = mlp_layout(module)
            if isinstance(layout, str):
                plan.not_supported.append(f"{label}: {layout}")
            else:
                plan.modules[id(module)] = (name, "mlp", module)
                # Its activation is fused with it: not replaced again as an activation.
                inside_fused_mlp.update(id(m) for m in module.modules() if m is not module)
        elif isinstance(module, FusedMLP) and _selected("mlp", module, config):
            plan.already_fused.append(label)
        elif is_llama_style_rms_norm(module) and _selected("norm", module, config):
            plan.modules[id(module)] = (name, "norm", module)
        elif isinstance(module, (FusedRMSNorm, nn.RMSNorm)) and _selected("norm", module, config):
            plan.already_fused.append(label)
        elif type(module).__name__.endswith("RMSNorm") and _selected("norm", module, config):
            plan.not_supported.append(f"{label}: not Llama's RMSNorm formula (e.g. Gemma's (1 + weight))")
        elif gelu_classes and type(module) in gelu_classes and _selected("activation", module, config):
            plan.modules[id(module)] = (name, "activation", module)
    return plan


def _fused_equivalent(kind: str, module: nn.Module) -> nn.Module:
    if kind == "norm":
        return FusedRMSNorm.from_module(module)
    if kind == "activation":
        # Both Python GELUs compute 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))), which is
        # exactly the tanh approximation torch implements as one kernel.
        return nn.GELU(approximate="tanh")
    if kind == "mlp":
        # Planned as "mlp" only when mlp_layout gave a layout (not a reason).
        layout, activation = cast(Tuple[MLPLayout, str], mlp_layout(module))
        return FusedMLP(module, layout, activation)
    raise AssertionError(f"unknown replacement kind {kind!r}")


def _check_classes(model: nn.Module, config: ModuleReplaceConfig) -> None:
    """Every class listed occurs in `model` and is of a kind module_replace replaces (any other would be
    left as is without a word: it is no candidate, so no reason would be listed for it)."""
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in config.classes if c not in present]
    if missing:
        raise ValueError(f"module_replace: classes {missing} do not occur in {type(model).__name__}; its module "
                         f"classes are {sorted(present)}")
    gelu_classes = _python_gelu_classes()
    kinds = {type(m).__name__: _kind_of(m, gelu_classes) for m in model.modules()}
    other = [c for c in config.classes if kinds.get(c) is None]
    if other:
        replaceable = sorted(name for name, kind in kinds.items() if kind is not None)
        raise ValueError(f"module_replace: classes {other} are of no kind module_replace replaces (attention: "
                         "Hugging Face *Attention modules; norm: *RMSNorm; activation: NewGELUActivation / "
                         "FastGELUActivation; mlp: *MLP modules); list only such classes, e.g. those of "
                         f"{type(model).__name__}: {replaceable}")


def validate_on_model(model: nn.Module, config: ModuleReplaceConfig) -> ReplacementPlan:
    """The plan for `model`, raising ValueError when the config cannot mean anything for it."""
    _check_classes(model, config)
    plan = plan_replacements(model, config)
    if plan.found_nothing():
        raise ValueError(
            f"module_replace: nothing to replace in {type(model).__name__} for kinds {config.enabled()} (looked for "
            "Hugging Face attention, Llama-style RMSNorm, NewGELUActivation/FastGELUActivation and, with mlp, "
            "*MLP modules); drop module_replace from the strategy")
    return plan


def replace_modules(model: nn.Module, config: ModuleReplaceConfig) -> ModuleReplaceSummary:
    """Apply `config` to `model` in place and return (and log) what was and was not replaced."""
    plan = validate_on_model(model, config)
    replaced: List[Tuple[str, str, str]] = []
    if plan.attention_model is not None:
        _switch_to_sdpa(plan.attention_model)
        replaced.append(("attention", type(plan.attention_model).__name__, "eager -> sdpa"))
    elif plan.attention_config is not None:
        # The stage's layers hold this config object and read the implementation at every forward.
        plan.attention_config._attn_implementation = "sdpa"
        replaced.append(("attention", type(plan.attention_config).__name__, "eager -> sdpa"))
    replacements = {key: _fused_equivalent(kind, module) for key, (_, kind, module) in plan.modules.items()}
    # Walk every parent's registered children directly: named_modules and named_children list a
    # module registered under two names once only, and both names must get the replacement.
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])
    for key, (name, kind, module) in plan.modules.items():
        replaced.append((kind, name, f"{type(module).__name__} -> {type(replacements[key]).__name__}"))
    summary = ModuleReplaceSummary(model=type(model).__name__, replaced=tuple(replaced),
                                   already_fused=tuple(plan.already_fused), not_replaced=tuple(plan.not_supported))
    logger.log(logging.INFO if replaced else logging.WARNING, "module_replace: %s", summary.describe())
    return summary


def _normalize_targets(targets: Sequence[Union[str, type]]) -> Dict[str, Any]:
    kinds, classes, unknown = set(), [], []
    for target in targets:
        if isinstance(target, type):
            classes.append(target.__name__)
        elif isinstance(target, str) and target in KINDS:
            kinds.add(target)
        else:
            unknown.append(target)
    if unknown:
        raise ValueError(f"module_replace: unknown replacement kind(s) {unknown}; valid kinds are {list(KINDS)} "
                         "(module classes are passed as classes, or by name under the config key 'classes')")
    return {**{kind: kind in kinds for kind in KINDS}, "classes": tuple(classes)}


def fuse(model: nn.Module, targets: Optional[Sequence[Union[str, type]]] = None) -> ModuleReplaceSummary:
    """Fuse `model`'s modules in place: `fuse(model)` every kind (mlp included), or only `targets`.

    `targets` mixes kinds ("attention", "norm", "activation", "mlp") and module classes, e.g.
    `fuse(model, [LlamaMLP, LlamaAttention])`. Call it before the model is wrapped or sharded.
    Raises ValueError when nothing of the targets occurs in `model`; see the module docstring.
    """
    config = ModuleReplaceConfig(mlp=True) if targets is None else ModuleReplaceConfig(**_normalize_targets(targets))
    if not config.enabled():
        raise ValueError("fuse: targets=[] selects nothing; pass None for every kind")
    return replace_modules(model, config)


def attach_fuse_method(model: nn.Module) -> nn.Module:
    """Give `model` a `model.fuse(targets=None)` method (an instance attribute; the type is kept)."""
    import types

    object.__setattr__(model, "fuse", types.MethodType(fuse, model))
    return model


@register
class ModuleReplaceOptimization(Optimization):
    """Fused attention, RMSNorm, GELU and (opt-in) MLPs with unchanged parameters, before anything wraps the blocks."""

    name = "module_replace"
    order = Order.MODULE_REPLACE
    Config = ModuleReplaceConfig
    search_dimension = "module_replace"

    @classmethod
    def cost_traits(cls, config: ModuleReplaceConfig, context: CostContext) -> Dict[str, Any]:
        # sdpa attention never materializes the b x heads x s x s matrix; the fused GELU saves
        # only its input (the Python one four b*s*ffn tensors); F.rms_norm keeps other tensors
        # than Hugging Face's RMSNorm in half precision. A fused MLP fuses its activation too.
        return {"fused_attention": bool(config.attention), "fused_activation": bool(config.activation or config.mlp),
                "fused_norm": bool(config.norm)}

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        # A model in which the default config would replace nothing (BLOOM, Gemma 2: attention
        # that cannot switch to sdpa, norms that are not Llama's formula) gains nothing from it:
        # offered anyway, it would double the space with candidates that measure the same.
        if context.model is not None and plan_replacements(context.model, ModuleReplaceConfig()).is_empty():
            logger.info("module_replace: not searched, nothing to replace in %s with the default config",
                        type(context.model).__name__)
            return [None]
        return [None, cls.name]

    @classmethod
    def parse_config(cls, raw: Any) -> ModuleReplaceConfig:
        """Also accept a list of kind names (and classes), e.g. ["attention", "norm"]: exactly those are replaced."""
        if isinstance(raw, (list, tuple)):
            return ModuleReplaceConfig(**_normalize_targets(raw))
        if isinstance(raw, dict) and "classes" in raw:
            classes = raw["classes"]
            if isinstance(classes, (str, type)) or not all(isinstance(c, (str, type)) for c in classes):
                raise ValueError(f"module_replace: classes must be a list of module classes or class names, got "
                                 f"{classes!r}")
            raw = {**raw, "classes": tuple(c.__name__ if isinstance(c, type) else c for c in classes)}
        return super().parse_config(raw)

    def validate(self, config: ModuleReplaceConfig, context: ValidationContext) -> None:
        for kind in KINDS:
            # A string such as "no" or "false" is truthy: it would enable the replacement it meant to turn off.
            if not isinstance(getattr(config, kind), bool):
                raise ValueError(f"module_replace: {kind}={getattr(config, kind)!r} must be True or False")
        if not config.enabled():
            raise ValueError(f"module_replace: config {config} enables no replacement; enable at least one of "
                             f"{list(KINDS)} or list classes, or drop module_replace from the strategy")
        if context.model is not None:
            validate_on_model(context.model, config)

    def apply(self, ctx: ModelContext, config: ModuleReplaceConfig) -> None:
        # What was and was not replaced, for the user (result.summaries["module_replace"]).
        ctx.summaries["module_replace"] = replace_modules(ctx.model, config)


def _switch_to_sdpa(hf_model: nn.Module) -> None:
    # A transformers PreTrainedModel method, unseen through nn.Module's type.
    hf_model.set_attn_implementation("sdpa")  # type: ignore[operator]
    # transformers only logs a warning when a sub-model cannot switch; a silent half switch
    # would leave eager attention in place, so check every sub-model's config.
    pretrained_cls = _loaded_transformers_attr("modeling_utils", "PreTrainedModel")
    stale = [type(m).__name__ for m in hf_model.modules()
             if isinstance(m, pretrained_cls) and m.config._attn_implementation in _EAGER_ATTENTION]
    if stale:
        raise RuntimeError(f"module_replace: set_attn_implementation('sdpa') left {stale} on eager attention")
