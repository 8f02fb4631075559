"""What the cost model knows of a model: `ModelShape`, read off a config or a module.

A transformers config's parameter layout (counts, tensor sizes, experts) is read off its own
model class built on the meta device (cached per config content); other configs are counted by
Llama's and GPT-2's formula. Config reading tolerates composite configs (a `text_config`) and
heterogeneous ones (values that vary by layer).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import nn

logger = logging.getLogger("atorch.auto.cost_model")


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a model; built from a HF config or a module."""

    num_params: int
    num_layers: int
    hidden_size: int
    # The MLP width one token goes through: the dense MLP's, or for a mixture of experts the
    # top-k experts' together plus the shared experts' (what the activation formula reads).
    intermediate_size: int
    num_heads: int
    vocab_size: int
    layer_params: int           # parameters of one transformer block (the non-embedding parameters / layers)
    embedding_params: int       # token/position embeddings + LM head (not tensor-sharded)
    kv_dim: int = 0             # key/value projection width (grouped-query attention); 0: hidden_size
    gated: bool = True          # Llama-style gated MLP (three matrices) rather than GPT-2's two
    fused_attention: bool = False   # the model's own attention never materializes b*heads*s^2 (sdpa, flash)
    kv_cache: bool = False          # a training forward fills Hugging Face's key/value cache (config.use_cache)
    # Measured / formula bytes a block saves for backward (`activation_probe`): the formula is
    # Llama's and GPT-2's; other architectures are measured on their own first block.
    activation_scale: float = 1.0
    # Elements per token one block saves more (negative: fewer) when a training forward fills Hugging
    # Face's cache (`kv_cache`), measured on the model's own first block (`activation_probe`); None:
    # the formula's (`activations._block_saved_bytes`: GPT-2's + 2 x kv_dim, Llama's 0).
    kv_cache_elements: Optional[float] = None
    # Width of one attention head; 0: hidden_size // num_heads. Gemma and Qwen3 set their own,
    # so their query and attention-output widths (num_heads * head_dim) differ from hidden_size.
    head_dim: int = 0
    # Parameters one token multiplies: a mixture of experts counts only its top-k routed experts
    # (shared experts, routers and everything else in full). 0: all of num_params. Memory counts
    # num_params; the FLOP count (`time_breakdown`) reads `compute_params`.
    active_params: int = 0
    # (elements, count) of the model's real parameter tensors, when known (a module, or a
    # transformers config instantiated on the meta device); (): `_parameter_sizes`' formula.
    parameter_sizes: Tuple[Tuple[int, int], ...] = ()
    # A two-matrix MLP whose activation is Hugging Face's tanh GELU written in Python ops
    # (GPT-2's NewGELUActivation: it keeps its input and three intermediates); False for a
    # native one (GPT-NeoX's and Falcon's nn.GELU, OPT's ReLU, Bloom's custom-autograd GELU),
    # which keeps what module_replace's fused GELU keeps. Read off the model where there is one.
    python_gelu: bool = True
    # The input embedding and the LM head are one matrix (GPT-2, Gemma, small Qwen2): counted once
    # in `embedding_params`, but held whole by both the first and the last pipeline stage.
    tied_embeddings: bool = False
    # Parameters the user froze (requires_grad=False) in the module the shape was read from: they
    # get no gradients and no optimizer state. `head_frozen`: the LM head's weight is one of them.
    frozen_params: int = 0
    head_frozen: bool = False
    # The linear layers LoRA can adapt, when the model is known: (leaf name, in features, out
    # features, how many), e.g. ("q_proj", 4096, 4096, 32); and the config's `model_type` (which
    # decides peft's default targets). (): LoRA is counted by Llama's and GPT-2's formula.
    linear_layers: Tuple[Tuple[str, int, int, int], ...] = ()
    model_type: str = ""
    # The mixture-of-experts weights transformers 5 fuses into one 3-D parameter per projection, which
    # peft's LoRA adapts as a whole (its `target_parameters`): (leaf name, experts, dim 1, dim 2, how
    # many), e.g. ("gate_up_proj", 128, 1536, 2048, 48).
    expert_weights: Tuple[Tuple[str, int, int, int, int], ...] = ()
    # Parameters atorch's tensor_parallel keeps whole on every rank under the model's own plan (its
    # preset or transformers' plan: norms, routers, a shared expert the plan leaves out), when the
    # model is known and has one; -1: `memory.tensor_replicated_params`' formula counts them.
    tensor_whole_params: int = -1
    # The model can switch to sdpa attention (transformers' `_supports_sdpa`; True when unknown): module_replace's
    # fused attention does nothing for BLOOM or Gemma 2 (transformers 5), whose eager attention saves its
    # b*heads*s^2 scores and probabilities (0.74x / 0.83x of the measured peak when counted as fused).
    sdpa_capable: bool = True
    # The LM head's logits are soft-capped (Gemma 2's final_logit_softcapping: cap * tanh(logits / cap)): tanh
    # saves its b*s*vocab output for backward beside the loss's softmax.
    logit_softcapping: bool = False
    # Bytes per sequence and squared token that one block's sdpa attention still saves where torch's fused kernel
    # does not run and its math path keeps the b x heads x s x s matrix (`activation_probe.sdpa_quadratic_bytes`;
    # 0: a fused kernel, or not measured). Counted wherever attention is counted as fused.
    sdpa_quadratic_bytes: float = 0.0
    # (precision mode, bytes per sequence and squared token) that one block's eager attention saves beyond the
    # formula's b x heads x s x s matrices (`activations._attention_matrix_bytes`), measured by the activation probe
    # on the model's own block at three lengths: BLOOM's softmax kept in fp32 beside its half copy in "half" (the
    # formula, counted on GPT-2, keeps one half matrix: +4 bytes a head), Gemma 2's soft-capped scores (tanh's
    # output, +1 value a head). Negative where a block keeps less. (): none, or not measured. Counted wherever
    # attention is not fused (`eager_quadratic`).
    eager_quadratic_bytes: Tuple[Tuple[str, float], ...] = ()
    # (shape, how many) of the parameters, when read off a model: FSDP2 pads each shard to ceil(dim / ranks) rows
    # of the dimension it splits, so a rank holds more than an even share where that does not divide (60 experts
    # over 8 ranks: 8 a rank, not 7.5). `memory.fsdp2_rank0_share`.
    param_shapes: Tuple[Tuple[Tuple[int, ...], int], ...] = ()

    @property
    def compute_params(self) -> int:
        return self.active_params or self.num_params

    def eager_quadratic(self, mode: str) -> float:
        """`eager_quadratic_bytes` of precision mode `mode` ("fp32", "autocast", "half"); 0.0 where not measured."""
        return dict(self.eager_quadratic_bytes).get(mode, 0.0)

    @property
    def head_params(self) -> int:
        """Elements of the LM head's weight (what its gradient holds): vocab x the input width of the model's own
        `lm_head` where the shape lists it (OPT with `word_embed_proj_dim` projects to 512 first), else vocab x
        hidden."""
        widths = [n_in for leaf, n_in, n_out, _ in self.linear_layers if leaf == "lm_head" and n_out == self.vocab_size]
        return self.vocab_size * (widths[0] if widths else self.hidden_size)

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim if self.head_dim and self.num_heads else self.hidden_size

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a model config. A transformers config's parameter layout is read off its own model
        class, instantiated on the meta device (`_meta_layout`, cached per config content); any
        other config (or one that cannot be instantiated) is counted by Llama's and GPT-2's formula."""
        shape = _formula_shape(config)
        layout = _meta_layout(config, shape.num_layers)
        return dataclasses.replace(shape, **layout) if layout else shape

    @classmethod
    def from_module(cls, model: nn.Module) -> "ModelShape":
        """From a module: its HF config when it has one (with exact parameter counts), else its layers."""
        config = getattr(model, "config", None)
        if config is not None and _config_int(_text_config(config), ("hidden_size", "n_embd", "d_model"), default=0):
            shape = _formula_shape(config)
            return dataclasses.replace(shape, **_module_layout(model, config, shape.num_layers))
        # A plain module: the largest ModuleList is the layer stack; the widest Linear input is the width.
        num_params = sum(p.numel() for p in model.parameters())
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        hidden = max((m.in_features for m in linears), default=1)
        ffn = max((m.out_features for m in linears), default=hidden)
        stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = max((len(s) for s in stacks), default=max(1, len(linears)))
        embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
        return cls(num_params, layers, hidden, ffn, 0, vocab, (num_params - embedding) // max(1, layers), embedding,
                   python_gelu=_has_python_gelu(model),
                   frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad))


_FFN_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
# transformers' activation names (`ACT2FN`) and classes of its tanh GELU in Python ops: what
# module_replace's `activation` kind fuses.
_PYTHON_GELU_NAMES = ("gelu_new", "gelu_fast")
_PYTHON_GELU_CLASSES = ("NewGELUActivation", "FastGELUActivation")


def _has_python_gelu(model: nn.Module) -> bool:
    return any(type(m).__name__ in _PYTHON_GELU_CLASSES for m in model.modules())


def _formula_shape(config: Any) -> ModelShape:
    """The shape by Llama's and GPT-2's formula, with the widths every family's config states.

    The parameter counts are exact for Llama and GPT-2 lookalikes only; `ModelShape.from_config`
    and `from_module` replace them by the real model's where there is one.
    """
    config = _text_config(config)
    h = _config_int(config, ("hidden_size", "n_embd", "d_model"))
    layers = _config_int(config, ("num_hidden_layers", "n_layer", "num_layers"))
    heads = _config_int(config, ("num_attention_heads", "n_head"))
    vocab = _config_int(config, ("vocab_size",), default=0)   # 0: no token embedding (ViT, an audio encoder)
    ffn = _config_int(config, _FFN_NAMES, default=4 * h) or 4 * h
    kv_heads = _config_int(config, ("num_key_value_heads", "num_kv_heads"), default=heads) or heads
    if _config_attr(config, "multi_query", False) is True and \
            not _config_attr(config, "new_decoder_architecture", False):
        kv_heads = 1    # Falcon's and GPT-BigCode's multi-query attention: one key/value head
    head_dim = _config_int(config, ("head_dim",), default=h // heads) or h // heads
    q_dim = heads * head_dim
    gated = _config_attr(config, "intermediate_size", _MISSING) is not _MISSING   # Llama's SwiGLU: three MLP matrices
    attn = h * q_dim * 2 + 2 * h * kv_heads * head_dim
    mlp = (3 if gated else 2) * h * ffn
    layer = attn + mlp + 2 * h
    final_norm = h
    if not gated:   # GPT-2 style: every linear and LayerNorm has a bias
        layer += (q_dim + 2 * kv_heads * head_dim + h) + (ffn + h) + 2 * h
        final_norm += h
    else:
        if _config_attr(config, "attention_bias", False):
            layer += q_dim + 2 * kv_heads * head_dim + h
        if _config_attr(config, "mlp_bias", False):
            layer += 2 * ffn + h
    positions = _config_int(config, ("n_positions",), default=0) * h
    tied = bool(_config_attr(config, "tie_word_embeddings", False))
    embedding = vocab * h * (1 if tied else 2) + positions
    fused = _config_attr(config, "_attn_implementation", None) in ("sdpa", "flash_attention_2", "flash_attention_3",
                                                                   "flex_attention")
    return ModelShape(layers * layer + embedding + final_norm, layers, h, _active_ffn(config, ffn), heads, vocab,
                      layer, embedding, kv_heads * head_dim, gated, fused,
                      bool(_config_attr(config, "use_cache", False)),
                      head_dim=head_dim if head_dim * heads != h else 0,
                      python_gelu=_config_attr(config, "activation_function",
                                               _config_attr(config, "hidden_act", "gelu_new")) in _PYTHON_GELU_NAMES,
                      tied_embeddings=tied, logit_softcapping=_softcapped(config))


def _experts_per_token(config: Any) -> Tuple[int, int]:
    """(routed experts, experts each token goes to) of a mixture-of-experts config; (0, 0) for a dense one."""
    config = _text_config(config)
    experts = _config_int(config, ("num_local_experts", "num_experts", "n_routed_experts"), default=0)
    top_k = _config_int(config, ("num_experts_per_tok", "num_experts_per_token", "moe_topk"), default=0)
    return (experts, min(top_k, experts)) if experts and top_k else (0, 0)


def _active_ffn(config: Any, ffn: int) -> int:
    """The MLP width one token goes through: top-k experts (Mixtral's `intermediate_size`, Qwen-MoE's
    `moe_intermediate_size` each) plus the shared experts (Qwen2-MoE's `shared_expert_intermediate_size`,
    DeepSeek's `n_shared_experts` x the expert width); the dense width without experts."""
    _, top_k = _experts_per_token(config)
    if not top_k:
        return ffn
    config = _text_config(config)
    expert = _config_int(config, ("moe_intermediate_size",), default=ffn) or ffn
    shared = _config_int(config, ("shared_expert_intermediate_size",), default=0) or \
        _config_int(config, ("n_shared_experts",), default=0) * expert
    return top_k * expert + shared


# Leaf names Hugging Face gives the gate of a gated MLP (Llama's gate_proj, Phi-3's and the
# fused experts' gate_up_proj, the original Mixtral's w1/w3 pair); non-gated MLPs name theirs
# c_fc, fc1, dense_h_to_4h, up_proj (MPT), fc_in.
_GATE_NAMES = frozenset({"gate_proj", "gate_up_proj", "w3"})


def _module_layout(model: nn.Module, config: Any, num_layers: int) -> Dict[str, Any]:
    """The `ModelShape` fields a Hugging Face model's own parameters determine.

    Counts as `ModelShape.from_module` always has: embeddings are the `nn.Embedding` weights and an
    untied `lm_head`; a layer is the rest over the layer count. Mixture of experts: every module
    named `experts` holds its routed experts' parameters, of which a token multiplies top-k/E.
    """
    params = list(model.parameters())       # one entry per shared (tied) parameter
    num_params = sum(p.numel() for p in params)
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, nn.Linear) and _shares_storage(head.weight, model)
    if isinstance(head, nn.Linear) and not tied:
        embedding += head.weight.numel()
    sizes: Dict[int, int] = {}
    for p in params:
        sizes[p.numel()] = sizes.get(p.numel(), 0) + 1
    fields: Dict[str, Any] = dict(num_params=num_params, layer_params=(num_params - embedding) // max(1, num_layers),
                                  embedding_params=embedding, parameter_sizes=tuple(sorted(sizes.items())),
                                  tied_embeddings=tied,
                                  frozen_params=sum(p.numel() for p in params if not p.requires_grad),
                                  head_frozen=isinstance(head, nn.Linear) and not head.weight.requires_grad)
    experts, top_k = _experts_per_token(config)
    routed = [module for name, module in model.named_modules() if name.rpartition(".")[2] == "experts"]
    if top_k and routed:
        inactive = sum(p.numel() for module in routed for p in module.parameters()) * (experts - top_k) / experts
        fields["active_params"] = num_params - round(inactive)
    elif top_k:     # the config names experts its model does not have: a dense MLP after all
        _log_once(f"{type(model).__name__}: its config routes {top_k} of {experts} experts but no module is named "
                  "'experts'; the FLOP count multiplies every parameter")
        text = _text_config(config)
        h = _config_int(text, ("hidden_size", "n_embd", "d_model"))
        fields["intermediate_size"] = _config_int(text, _FFN_NAMES, default=4 * h) or 4 * h
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if stacks:      # the layer stack's first block tells a gated MLP from a two-matrix one
        names = {part for name, _ in stacks[0][0].named_parameters() for part in name.split(".")}
        fields["gated"] = bool(names & _GATE_NAMES)
    fields["python_gelu"] = _has_python_gelu(model)
    fields["sdpa_capable"] = bool(getattr(model, "_supports_sdpa", True))
    shapes: Dict[Tuple[int, ...], int] = {}
    for p in params:
        key = tuple(int(d) for d in p.shape)
        shapes[key] = shapes.get(key, 0) + 1
    fields["param_shapes"] = tuple(sorted(shapes.items()))
    fields["logit_softcapping"] = _softcapped(config)
    fields["linear_layers"] = _linear_layers(model)
    fields["expert_weights"] = _expert_weights(model)
    model_type = getattr(_text_config(config), "model_type", None) or getattr(config, "model_type", None)
    fields["model_type"] = model_type if isinstance(model_type, str) else ""
    fields["tensor_whole_params"] = _tensor_whole_params(model)
    return fields


def _softcapped(config: Any) -> bool:
    """Whether the config soft-caps the LM head's logits (`ModelShape.logit_softcapping`)."""
    cap = _config_attr(_text_config(config), "final_logit_softcapping", None)
    return isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0


def _tensor_whole_params(model: nn.Module) -> int:
    """What the model's tensor-parallel plan leaves whole (`ModelShape.tensor_whole_params`); -1 without a plan.

    The plan is resolved for a tensor size of 1, which checks no divisibility: which modules are
    split does not depend on the size (a size the model cannot take is refused when it is applied).
    """
    from atorch.tensor_parallel.plan import resolve_tp_plan, whole_parameter_count
    from atorch.tensor_parallel.presets import tpinfo_for_model

    try:
        return whole_parameter_count(model, resolve_tp_plan(model, tpinfo_for_model(model), 1))
    except ValueError as exc:   # no plan, or one atorch refuses: the formula stands in
        _log_once(f"{type(model).__name__}: no tensor-parallel plan to count its replicated parameters ({exc})")
        return -1


def _expert_weights(model: nn.Module) -> Tuple[Tuple[str, int, int, int, int], ...]:
    """(leaf name, experts, dim 1, dim 2, count) of the 3-D parameters inside `experts` modules: the fused
    expert projections (`ModelShape.expert_weights`)."""
    counts: Dict[Tuple[str, int, int, int], int] = {}
    for name, param in model.named_parameters():
        if param.dim() == 3 and ".experts." in f".{name}":
            e, d1, d2 = (int(d) for d in param.shape)
            key = (name.rpartition(".")[2], e, d1, d2)
            counts[key] = counts.get(key, 0) + 1
    return tuple(sorted((leaf, e, d1, d2, count) for (leaf, e, d1, d2), count in counts.items()))


def _linear_layers(model: nn.Module) -> Tuple[Tuple[str, int, int, int], ...]:
    """(leaf name, in, out, count) of the model's `nn.Linear` and transformers `Conv1D` layers (GPT-2's,
    whose weight is stored in x out): what peft's LoRA can adapt, matched by leaf name."""
    counts: Dict[Tuple[str, int, int], int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            dims = (module.in_features, module.out_features)
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
                and module.weight.dim() == 2:
            dims = (int(module.weight.shape[0]), int(module.weight.shape[1]))
        else:
            continue
        key = (name.rpartition(".")[2], dims[0], dims[1])
        counts[key] = counts.get(key, 0) + 1
    return tuple(sorted((leaf, n_in, n_out, count) for (leaf, n_in, n_out), count in counts.items()))


# Config content (JSON) -> the fields `_module_layout` read off its meta-device model. Bounded:
# a search asks for a handful of configs, but a long-lived process may see many.
_LAYOUTS: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
_LAYOUTS_MAX = 64
_LOGGED_MESSAGES: Set[str] = set()


def _config_key(config: Any) -> Optional[str]:
    """A transformers config's content as a cache key; None for anything else."""
    transformers = sys.modules.get("transformers")     # a transformers config implies it is imported
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    try:
        return json.dumps(config.to_dict(), sort_keys=True, default=repr)
    except (TypeError, ValueError) as error:
        return f"{type(config).__name__}:{id(config)}:{error}"   # unserializable: not cached across objects


def _meta_model(config: Any, purpose: str, attention: str = "eager", device: str = "meta") -> Optional[nn.Module]:
    """`AutoModelForCausalLM.from_config(config)` on the meta device with eager attention (the
    attention implementation does not change the parameters, and eager needs no optional kernel
    package; `attention="sdpa"` for the probe of what sdpa saves; `device="cpu"` inside a fake-tensor mode
    for that probe); None, with the reason logged once, when transformers cannot build it."""
    import transformers

    try:
        # A copy: from_config may write into the config.
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention)
    except Exception as error:  # noqa: BLE001 - any failure means "use the formula", said once
        _log_once(f"{purpose} {type(config).__name__}'s by the Llama/GPT-2 formula (building its model on the meta "
                  f"device failed: {type(error).__name__}: {error})")
        return None


def _meta_layout(config: Any, num_layers: int) -> Optional[Dict[str, Any]]:
    """`_module_layout` of `AutoModelForCausalLM.from_config(config)` built on the meta device, cached
    per config content. No memory; Llama-2-70B's config takes 0.03-0.09 s here (2 shared cores), plus
    0.6-1.4 s the first time in a process that transformers imports that family's modeling module;
    a cached config costs its `to_dict` and JSON, under 5 ms. None, with the reason logged once, for
    a config transformers cannot instantiate as a causal LM (or not a transformers config at all):
    the caller keeps the formula."""
    key = _config_key(config)
    if key is None:
        return None
    if key in _LAYOUTS:
        _LAYOUTS.move_to_end(key)
        return _LAYOUTS[key]
    model = _meta_model(config, "counting the parameters of")
    if model is None:
        return None
    layout = _module_layout(model, config, num_layers)
    _LAYOUTS[key] = layout
    if len(_LAYOUTS) > _LAYOUTS_MAX:
        _LAYOUTS.popitem(last=False)
    return layout


def _log_once(message: str) -> None:
    if message not in _LOGGED_MESSAGES:
        _LOGGED_MESSAGES.add(message)
        logger.info("cost model: %s", message)


def _shares_storage(weight: torch.Tensor, model: nn.Module) -> bool:
    return any(m.weight is weight for m in model.modules() if isinstance(m, nn.Embedding))


_MISSING = object()


def _text_config(config: Any) -> Any:
    """The language model's own config of a composite one (Gemma-3's, Llama-4's, Mllama's, Qwen3.5's:
    `hidden_size` and the heads live in its `text_config`), the config itself otherwise."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except Exception:  # noqa: BLE001 - a config that cannot say is read as it is
        return config


def _config_attr(config: Any, name: str, default: Any = None) -> Any:
    """`getattr(config, name, default)`, also for transformers' heterogeneous configs, which refuse
    a global read of an attribute that varies by layer (Gemma-4's head_dim, a per-layer number of
    heads): then the largest of the layers' integer values (memory is planned for the widest
    layer; the parameter counts come from the model built on the meta device anyway), or the first
    layer's value when they are not integers."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError (a RuntimeError), or a broken property
        try:
            values = [getattr(layer, name, None) for layer in getattr(config, "per_layer_config", None) or ()]
        except Exception:  # noqa: BLE001
            return default
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if ints:
            return max(ints)
        return next((v for v in values if v is not None), default)


def _config_int(config: Any, names: Tuple[str, ...], default: Optional[int] = None) -> int:
    for name in names:
        value = _config_attr(config, name)
        if isinstance(value, int):
            return value
    if default is None:
        raise ValueError(f"model config {type(config).__name__} has none of {list(names)}; the cost model needs "
                         "them (pass a ModelShape instead)")
    return default


def _parameter_sizes(shape: ModelShape) -> Tuple[Tuple[int, int], ...]:
    """(elements, count) of the model's parameter tensors: the real ones where the shape knows them,
    else as Hugging Face's Llama and GPT-2 lay them out."""
    if shape.parameter_sizes:
        return shape.parameter_sizes
    h, f, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
    kv = shape.kv_dim or h
    matrices = shape.vocab_size * h
    embeddings = ((matrices, max(1, shape.embedding_params // max(1, matrices))),
                  (shape.embedding_params % max(1, matrices), 1))
    block: Tuple[Tuple[int, int], ...]
    if shape.gated:
        block = ((h * h, 2 * L), (h * kv, 2 * L), (h * f, 3 * L), (h, 2 * L + 1))
    else:   # GPT-2: fused qkv, LayerNorm weights and biases, a bias on every linear
        block = ((h * (h + 2 * kv), L), (h * h, L), (h * f, 2 * L), (h + 2 * kv, L), (f, L), (h, 6 * L + 2))
    return tuple(size for size in embeddings + block if size[0] > 0)


def _largest_param_elements(shape: ModelShape) -> int:
    return max(elements for elements, _ in _parameter_sizes(shape))
