"""`lora`: low-rank adapters through `peft`; only the adapters train.

Applied before checkpointing and sharding (Order.LORA), so those wrap the adapted blocks and
the optimizer is built over the adapter parameters only. The model becomes a
`peft.PeftModel`: its state-dict keys gain peft's `base_model.model.` prefix, and
`model.save_pretrained` / `peft.get_peft_model_state_dict` save the adapters alone.
After `tensor_parallel`, the target linears are sharded layers that peft cannot adapt; the
adapters are then atorch's (`atorch.tensor_parallel.lora`: A and B sharded like the base
layer, same math and initialization scheme), and the model keeps its class.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple, cast

import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register
from atorch.modules.pipeline.native import PipelineStageModule
from atorch.utils.lora_init import lora_a_init

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (named as in the paper; `alpha` is peft's `lora_alpha`)."""

    r: int = 8
    """Adapter rank."""
    alpha: float = 16
    """Scaling numerator: adapter outputs are scaled by alpha / r."""
    target_modules: Optional[Tuple[str, ...]] = None
    """Names (or name suffixes, as peft matches them) of the layers to adapt; None: peft's default for the
    model type (Llama: q_proj, v_proj; GPT-2: c_attn)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    seed: int = 0
    """Seed of the adapter initialization, so every rank starts from the same adapters even where no
    wrapper broadcasts them (sharded training) and whatever the ranks' random state."""
    modules_to_save: Optional[Tuple[str, ...]] = None
    """Modules trained whole besides the adapters (peft's `modules_to_save`): a task head new for fine-tuning
    (`score`, `classifier`), or the LM head. peft trains a copy and keeps the loaded module beside it; a
    merged checkpoint holds the trained copy."""

    def __post_init__(self) -> None:
        for name in ("target_modules", "modules_to_save"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))


def _adaptable_types() -> Tuple[type, ...]:
    """Layer types peft's LoRA can adapt (transformers' Conv1D when transformers is loaded)."""
    types: List[type] = [nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention]
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None:
        types.append(conv1d)
    return tuple(types)


def _matches(target: str, name: str) -> bool:
    """peft's rule for a list of target names: the full name, or its last dotted components."""
    return name == target or name.endswith(f".{target}")


def _model_type(model: nn.Module, model_config: Any) -> Optional[str]:
    config = model_config if model_config is not None else getattr(model, "config", None)
    return getattr(config, "model_type", None)


def default_target_modules(model: nn.Module, model_config: Any = None) -> Optional[Tuple[str, ...]]:
    """peft's default LoRA targets for the model's type, or None when peft has none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    model_type = _model_type(model, model_config)
    targets = defaults.get(model_type) if model_type is not None else None
    return tuple(targets) if targets else None


def _adaptable_layer_names(model: nn.Module) -> List[str]:
    """Target names for the adaptable layers whose forward runs: the last part of each name, or the last two where
    the last is a bare index (`ff.0`, not `0`, which would match every child `0`); never called layers left out."""
    adaptable, uncalled = _adaptable_types(), _uncalled_layers(model)
    names = set()
    for name, m in model.named_modules():
        if name and isinstance(m, adaptable) and name not in uncalled:
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(names | _fused_expert_names(model))


# The expert projection names peft moves onto fused expert weights, by naming convention (Llama-style, Mixtral).
_EXPERT_NAME_SETS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w2", "w3"))


def _fused_expert_names(model: nn.Module) -> Set[str]:
    """The expert projection names that adapt `model`'s fused expert weights (`convert_like_peft`): transformers 5
    keeps a mixture of experts as stacked parameters, not layers, so the layer names alone suggested only the
    attention projections for OLMoE."""
    from atorch.auto.cost_model.traits import peft_expert_targets

    model_type = _model_type(model, None)
    if not isinstance(model_type, str):
        return set()
    names: Set[str] = set()
    for candidates in _EXPERT_NAME_SETS:
        try:
            names |= peft_expert_targets(model_type, candidates)[0]
        except ValueError:
            continue
    return names


def _uncalled_layers(model: nn.Module) -> Dict[str, str]:
    """Layers whose parent reads their weight directly and never calls their forward, so that a LoRA adapter there
    would never run (name -> why): nn.MultiheadAttention's `out_proj` (F.multi_head_attention_forward)."""
    return {f"{name}.out_proj" if name else "out_proj": "the output projection of nn.MultiheadAttention, whose "
            "forward reads out_proj.weight directly and never calls out_proj"
            for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}


def target_layer_names(model: nn.Module, targets: Tuple[str, ...]) -> List[str]:
    """The names of the layers of `model` that one of `targets` names (peft's matching rule)."""
    return [name for name, _ in model.named_modules() if name and any(_matches(t, name) for t in targets)]


def convert_like_peft(peft_config: Any, model: nn.Module, model_config: Any = None) -> None:
    """Apply, in place, peft's rewrite of LoRA targets for the mixture-of-experts models whose experts
    transformers 5 fuses into stacked parameters (Mixtral, Qwen2/3-MoE, OLMoE, ...): the expert projection
    names (`gate_proj`, `up_proj`, `down_proj`, Mixtral's `w1`...) become `target_parameters` on the fused
    expert weights, and leave `target_modules`. `get_peft_model` does this itself on a whole transformers
    model, but not on a pipeline stage (no config of its own), which then adapted the dense MLPs of a mixed
    model instead of the experts and saved a checkpoint that could not be merged. Applied here on every
    layout (with the user's model config for a stage), the same names adapt the same weights everywhere;
    applied again by peft it changes nothing. A no-op where peft has no rewrite (dense models, older peft)."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None:
        config = model_config
    if getattr(config, "model_type", None) is None:
        return
    # peft reads the model type off `model.config`, and the modules only for a string (regex) target.
    view = SimpleNamespace(config=config, named_modules=model.named_modules, named_parameters=model.named_parameters)
    convert_peft_config_for_transformers(peft_config, cast(nn.Module, view), None)


def expert_targets(model: nn.Module, targets: Tuple[str, ...], model_config: Any = None) -> Tuple[Set[str], Set[str]]:
    """(the target names peft moves onto fused expert weights, the parameter names it adapts instead): see
    `convert_like_peft` and the cost model's reading of the same rewrite (`traits.peft_expert_targets`); two
    empty sets for a model without such a rewrite."""
    from atorch.auto.cost_model.traits import peft_expert_targets

    model_type = _model_type(model, model_config)
    if not isinstance(model_type, str):
        return set(), set()
    try:
        moved, ranks = peft_expert_targets(model_type, tuple(targets))
    except ValueError as e:     # e.g. gate_proj without up_proj, which transformers fuses into one weight
        raise ValueError(f"lora: target_modules {list(targets)}: {e}") from e
    return set(moved), set(ranks)


# (model type, moved names) already warned about: the automatic search applies lora once per dry run, and a
# pipeline stage checks its targets again.
_WARNED_EXPERTS: Set[Tuple[str, Tuple[str, ...]]] = set()


def _warn_dense_layers_left(model: nn.Module, moved: Set[str], params: Set[str], model_config: Any = None) -> None:
    """Warn when names peft moved onto fused expert weights also name dense linear layers (a model mixing
    MoE and dense MLPs): peft adapts only the experts for them (it maps any name ending in one of them), and
    so does atorch on every layout."""
    dense = [name for name, m in model.named_modules()
             if name and isinstance(m, nn.Linear) and any(_matches(t, name) for t in moved)]
    key = (str(_model_type(model, model_config) or type(model).__name__), tuple(sorted(moved)))
    if not dense or key in _WARNED_EXPERTS:
        return
    _WARNED_EXPERTS.add(key)
    logger.warning("lora: peft maps the targets %s to the fused expert weights %s of this mixture-of-experts model "
                   "(its rewrite for transformers 5, which fuses the experts); the %d dense layer(s) of those names "
                   "get no adapter, e.g. %r", sorted(moved), sorted(params), len(dense), dense[0])


def resolve_target_modules(model: nn.Module, config: LoraConfig, model_config: Any = None,
                           on_stage: bool = False) -> Tuple[str, ...]:
    """The target names for `model`, checked: each matches at least one layer, and only adaptable ones.

    `on_stage`: `model` is one pipeline stage of a model validated whole (where every target matched a layer):
    a target that matches nothing here is on another stage, which adapts it; at least one must be here, as a
    stage without adapters has nothing to train.
    """
    targets = config.target_modules
    if targets is None:
        targets = default_target_modules(model, model_config)
        if targets is None:
            raise ValueError(
                f"lora: peft has no default target modules for {type(model).__name__} (model type "
                f"{_model_type(model, model_config)!r}); pass target_modules, e.g. some of its adaptable layer "
                f"names {_adaptable_layer_names(model)}")
    adaptable, uncalled = _adaptable_types(), _uncalled_layers(model)
    named = [(name, m) for name, m in model.named_modules() if name]
    moved, expert_params = expert_targets(model, tuple(targets), model_config)
    if moved:
        param_names = [name for name, _ in model.named_parameters()]
        held = [p for p in sorted(expert_params) if any(_matches(p, name) for name in param_names)]
        if not held and not on_stage:
            raise ValueError(f"lora: peft maps the targets {sorted(moved)} to the fused expert weights "
                             f"{sorted(expert_params)}, which {type(model).__name__} does not have")
        _warn_dense_layers_left(model, moved, expert_params, model_config)
        if on_stage and held:
            return tuple(targets)    # the stage holds experts to adapt
    unmatched = []
    for target in targets:
        if target in moved:
            continue
        hits = [(name, m) for name, m in named if _matches(target, name)]
        if not hits:
            unmatched.append(target)
            continue
        never_called = [name for name, _ in hits if name in uncalled]
        if never_called:
            raise ValueError(
                f"lora: target {target!r} matches {never_called[0]!r}, {uncalled[never_called[0]]}: an adapter there "
                f"would never run and train nothing; choose other targets, e.g. among {_adaptable_layer_names(model)}")
        bad = [(name, m) for name, m in hits if not isinstance(m, adaptable)]
        if bad:
            name, m = bad[0]
            raise ValueError(
                f"lora: target {target!r} matches {type(m).__name__} modules (e.g. {name!r}), which LoRA cannot "
                f"adapt; adaptable layers are {[t.__name__ for t in adaptable]}, named {_adaptable_layer_names(model)}")
    if unmatched and on_stage:
        if len(unmatched) < len(targets) - len(moved):
            return tuple(targets)    # peft adapts the targets here and skips those on other stages
        stage = f"pipeline stage {getattr(model, 'stage_index', '?')} of {getattr(model, 'num_stages', '?')}"
        raise ValueError(f"lora: none of the target module(s) {list(targets)} is on {stage}, whose adaptable layer "
                         f"names are {_adaptable_layer_names(model)}: a stage without adapters has nothing to train; "
                         "add a target that every stage holds (e.g. its attention projections) or use fewer stages")
    if unmatched:
        raise ValueError(f"lora: target module(s) {unmatched} match no layer of {type(model).__name__}; its "
                         f"adaptable layer names are {_adaptable_layer_names(model)}")
    return tuple(targets)


def check_modules_to_save(model: nn.Module, saved: Tuple[str, ...], targets: Tuple[str, ...]) -> None:
    """Refuse `modules_to_save` names that peft would not apply as meant: peft matches them by plain suffix
    (`name.endswith(target)`) and skips a name that matches nothing without a word, so a typo would leave the
    head frozen. Each name must match a module with parameters at a dotted boundary (as `target_modules` are
    matched), match nothing more by peft's looser rule (`proj` would wrap every `q_proj`), and neither hold
    nor sit inside an adapted layer (peft would wrap the adapters into the copy)."""
    named = [(name, m) for name, m in model.named_modules() if name]
    adapted = [name for name, _ in named if any(_matches(t, name) for t in targets)]
    for target in saved:
        hits = [(name, m) for name, m in named if _matches(target, name)]
        loose = [name for name, _ in named if name.endswith(target) and not _matches(target, name)]
        if not hits and not loose:
            shown = [name for name, m in named if name.count(".") <= 1 and any(True for _ in m.parameters())]
            raise ValueError(f"lora: modules_to_save {target!r} matches no module of {type(model).__name__}; name a "
                             f"module to train whole, e.g. one of {shown[:12]}")
        if loose:
            raise ValueError(f"lora: modules_to_save {target!r} would also make peft train {loose[0]!r} whole (peft "
                             f"matches these names by suffix, and {len(loose)} module name(s) end with it); give a "
                             "longer name, e.g. the full module path")
        for name, m in hits:
            if not any(True for _ in m.parameters()):
                raise ValueError(f"lora: modules_to_save {target!r} matches {name!r} ({type(m).__name__}), which "
                                 "has no parameters to train")
            overlap = [a for a in adapted if a == name or a.startswith(name + ".") or name.startswith(a + ".")]
            if overlap:
                raise ValueError(f"lora: modules_to_save {target!r} ({name!r}) overlaps the adapted layer "
                                 f"{overlap[0]!r}: a module is either adapted (target_modules) or trained whole "
                                 "(modules_to_save), not both")


def _is_peft_model(model: nn.Module) -> bool:
    peft_model = getattr(sys.modules.get("peft"), "PeftModel", None)
    return peft_model is not None and isinstance(model, peft_model)


def add_lora_adapters(model: nn.Module, config: LoraConfig, model_config: Any = None,
                      on_stage: bool = False) -> nn.Module:
    """`peft.get_peft_model(model, ...)` for `config`, with the adapters initialized from `config.seed`.

    Freezes every base parameter; the returned model's trainable parameters are exactly the
    adapters' `lora_A` / `lora_B` weights. `on_stage`: `model` is a pipeline stage, which adapts the
    targets it holds (see `resolve_target_modules`); its peft config names all of them, as every stage's does.
    """
    import peft

    targets = resolve_target_modules(model, config, model_config, on_stage)
    # transformers' Conv1D (GPT-2) stores its weight transposed; peft must be told, or it
    # corrects the flag itself with a warning on every call.
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    fan_in_fan_out = conv1d is not None and any(
        isinstance(m, conv1d) for name, m in model.named_modules() if any(_matches(t, name) for t in targets))
    # peft uses lora_alpha only in alpha / r, so a float works; its annotation says int.
    saved = list(config.modules_to_save) if config.modules_to_save else None
    peft_config = peft.LoraConfig(r=config.r, lora_alpha=config.alpha, target_modules=list(targets),  # type: ignore[arg-type]
                                  lora_dropout=config.dropout, fan_in_fan_out=fan_in_fan_out,
                                  modules_to_save=saved)
    convert_like_peft(peft_config, model, model_config)
    cuda_devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    # A private random stream: the adapters do not depend on (or disturb) the caller's RNG state.
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(config.seed)
        peft_model = peft.get_peft_model(model, peft_config)
    _seed_adapters_by_path(peft_model, config.seed)
    _UncalledAdapterCheck(peft_model)
    return peft_model


# transformers' task heads (sequence / token classification, question answering) under the model's own root.
TASK_HEAD_NAMES = ("classifier", "score", "qa_outputs")
# (model class, head) pairs already warned about: the automatic search applies lora once per dry run.
_WARNED_HEADS: Set[Tuple[str, str]] = set()


def _warn_frozen_task_heads(model: nn.Module) -> None:
    """Warn about a task head (`TASK_HEAD_NAMES`) with no adapter and nothing trainable: LoRA freezes it with the
    base model, so it keeps the weights it was loaded with, and a head new for this task (what from_pretrained
    adds for fine-tuning a classifier: random) never trains. Naming it in `modules_to_save` trains it whole."""
    get_base = getattr(model, "get_base_model", None)   # peft's PeftModel
    model_class = type(get_base() if callable(get_base) else model).__name__
    for name, module in model.named_modules():
        head = name.rsplit(".", 1)[-1]
        if head not in TASK_HEAD_NAMES or name.count(".") > 2:   # base_model.model.<head>
            continue
        params = list(module.parameters())
        key = (model_class, name)
        if not params or any(p.requires_grad for p in params) or key in _WARNED_HEADS:
            continue
        _WARNED_HEADS.add(key)
        logger.warning("lora: the task head %r (%s) has no adapter and stays frozen with the base model: it keeps "
                       "the weights it was loaded with, so a head new for this task never trains; add %r to "
                       "modules_to_save to train it whole (or to target_modules to adapt it)", name,
                       type(module).__name__, head)


class _UncalledAdapterCheck:
    """Forward hooks until the model's first forward, then a warning naming the adapted layers that did not run
    in it: their adapters got no gradient (a layer whose parent never calls it trains nothing). Plain objects,
    not closures, so that the model still pickles."""

    def __init__(self, model: nn.Module) -> None:
        layers = {name: m for name, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)}
        self.pending = set(layers)
        self.handles = [m.register_forward_hook(_MarkCalled(self, name)) for name, m in layers.items()]
        self.handles.append(model.register_forward_hook(self))

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        for handle in self.handles:
            handle.remove()
        if self.pending:
            shown = sorted(self.pending)
            logger.warning("lora: %d adapted layer(s) did not run in the first forward, so their adapters got no "
                           "gradient, e.g. %s; a layer whose parent never calls its forward trains nothing (choose "
                           "other target_modules), one used conditionally (an MoE expert, a branch) trains once used",
                           len(shown), shown[:5])


class _MarkCalled:
    def __init__(self, check: _UncalledAdapterCheck, name: str) -> None:
        self.check, self.name = check, name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.check.pending.discard(self.name)


def _seed_adapters_by_path(peft_model: nn.Module, seed: int) -> None:
    """Set each adapter's A to `lora_a_init(seed, layer path)`: the same adapters whatever part of
    the model this process holds (a pipeline stage, a tensor-parallel slice); B stays zero."""
    prefix = "base_model.model."
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict):
            continue
        path = name[len(prefix):] if name.startswith(prefix) else name
        for adapter in lora_a.values():
            weight = getattr(adapter, "weight", None)
            if weight is None:
                continue
            r, in_features = weight.shape
            with torch.no_grad():
                weight.copy_(lora_a_init(seed, path, r, in_features))


def _check_tensor_parallel_targets(model: nn.Module, targets: Tuple[str, ...]) -> None:
    """Refuse, before anything is applied, targets tensor-parallel LoRA cannot adapt: transformers' Conv1D
    (GPT-2) stores its weight transposed, and atorch's sharded adapters support nn.Linear layouts only
    (`atorch.tensor_parallel.lora.add_lora` would refuse it after tensor_parallel was applied)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is None:
        return
    hits = [name for name, m in model.named_modules()
            if name and isinstance(m, conv1d) and any(_matches(t, name) for t in targets)]
    if hits:
        raise ValueError(f"lora with tensor_parallel supports nn.Linear layouts; targets {list(targets)} match "
                         f"{len(hits)} layers that store a Conv1D weight (GPT-2), e.g. {hits[0]!r}: target another "
                         "model or drop tensor_parallel (lora alone adapts Conv1D through peft)")


@register
class LoraOptimization(Optimization):
    """Train low-rank adapters of the target layers instead of the full model."""

    name = "lora"
    order = Order.LORA
    Config = LoraConfig
    search_dimension = None   # it changes what is trained; a user's choice, not a speed-up

    @classmethod
    def cost_traits(cls, config: LoraConfig, context: CostContext) -> Dict[str, Any]:
        # Frozen base weights: no gradients or optimizer state; only the adapters train.
        return {"lora_rank": config.r, "lora_targets": config.target_modules,
                "lora_modules_to_save": config.modules_to_save}

    def validate(self, config: LoraConfig, context: ValidationContext) -> None:
        if not isinstance(config.r, int) or isinstance(config.r, bool) or config.r < 1:
            raise ValueError(f"lora: r={config.r!r}; expected an integer >= 1")
        # `not x > 0` rather than `x <= 0`: NaN fails every comparison, and nan (or inf) scaled every adapter output.
        if isinstance(config.alpha, bool) or not isinstance(config.alpha, (int, float)) \
                or not 0 < config.alpha < float("inf"):
            raise ValueError(f"lora: alpha={config.alpha!r}; expected a finite number > 0")
        if isinstance(config.dropout, bool) or not isinstance(config.dropout, (int, float)) \
                or not 0.0 <= config.dropout < 1.0:
            raise ValueError(f"lora: dropout={config.dropout!r}; expected a probability in [0, 1)")
        # torch.manual_seed truncated 1.5 to 1 and failed on 2**70 only while applying ("Overflow when unpacking").
        if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed < 2 ** 64:
            raise ValueError(f"lora: seed={config.seed!r}; expected an integer in [0, 2**64) (torch.manual_seed's "
                             "range)")
        if config.target_modules is not None and (
                not config.target_modules or not all(isinstance(t, str) and t for t in config.target_modules)):
            raise ValueError(f"lora: target_modules={config.target_modules!r}; expected None or a non-empty list "
                             "of layer names")
        if config.modules_to_save is not None and (
                not config.modules_to_save or not all(isinstance(t, str) and t for t in config.modules_to_save)):
            raise ValueError(f"lora: modules_to_save={config.modules_to_save!r}; expected None or a non-empty list "
                             "of module names")
        if "tensor_parallel" in context.configs and config.modules_to_save:
            raise ValueError(f"lora: modules_to_save={list(config.modules_to_save)} with tensor_parallel is not "
                             "supported (the adapters there are atorch's own layers, which train no module whole); "
                             "drop tensor_parallel or modules_to_save")
        if "tensor_parallel" in context.configs and config.dropout != 0.0:
            raise ValueError(f"lora: dropout={config.dropout} with tensor_parallel is not supported; use dropout=0.0")
        if context.model is None:
            return
        if _is_peft_model(context.model):
            raise ValueError(f"lora: the model is already a peft {type(context.model).__name__}; pass the base "
                             "model to auto_accelerate, or drop lora from the strategy to train the adapters it has")
        targets = resolve_target_modules(context.model, config, context.model_config)
        if config.modules_to_save:
            check_modules_to_save(context.model, config.modules_to_save, targets)
        if "tensor_parallel" in context.configs:
            moved, params = expert_targets(context.model, targets, context.model_config)
            if moved:
                raise ValueError(f"lora with tensor_parallel adapts linear layers; peft maps the targets "
                                 f"{sorted(moved)} to the fused expert weights {sorted(params)} of "
                                 f"{type(context.model).__name__}, which tensor-parallel LoRA cannot adapt: target "
                                 "the attention projections only, or drop tensor_parallel")
            _check_tensor_parallel_targets(context.model, targets)

    def apply(self, ctx: ModelContext, config: LoraConfig) -> None:
        from atorch.tensor_parallel import TensorParallelModule

        if any(isinstance(m, TensorParallelModule) for m in ctx.model.modules()):
            from atorch.tensor_parallel.lora import add_tp_lora_adapters

            targets = config.target_modules or default_target_modules(ctx.model, ctx.model_config)
            if not targets:
                raise ValueError(f"lora: peft has no default target modules for {type(ctx.model).__name__}; pass "
                                 "target_modules")
            add_tp_lora_adapters(ctx.model, targets, config.r, config.alpha, config.dropout, config.seed)
            adapted, expert_weights = sorted(targets), []
        else:
            # A pipeline stage has no config of its own: the user's model's tells peft the model type. Its
            # targets were checked on the whole model; the stage adapts those it holds.
            ctx.model = add_lora_adapters(ctx.model, config, getattr(ctx.model, "config", None) or ctx.model_config,
                                          on_stage=isinstance(ctx.model, PipelineStageModule))
            peft_config = cast(Any, ctx.model).peft_config["default"]   # a peft PeftModel now
            adapted = sorted(peft_config.target_modules)
            expert_weights = sorted(peft_config.target_parameters or ())
        _warn_frozen_task_heads(ctx.model)
        trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in ctx.model.parameters())
        summary: Dict[str, Any] = {"trainable_params": trainable, "total_params": total,
                                   "target_modules": adapted}
        if expert_weights:      # peft's rewrite for fused experts (`convert_like_peft`)
            summary["target_parameters"] = expert_weights
        if config.modules_to_save:
            summary["modules_to_save"] = sorted(config.modules_to_save)
        ctx.summaries["lora"] = summary
        experts = f" and on the fused expert weights {expert_weights}" if expert_weights else ""
        logger.info("lora: training %d of %d parameters (%.2f%%), adapters on %s%s", trainable, total,
                    100.0 * trainable / max(total, 1), summary["target_modules"], experts)
