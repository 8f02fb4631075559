"""Predict a strategy's per-rank peak memory and step time without running it.

The planner ranks candidates by predicted step time and never dry-runs one whose predicted
peak exceeds the device memory. Pure: plain values in (model shape, strategy, batch, world
size, device), an `Estimate` out; nothing is allocated or communicated. A transformers config's
parameter layout (counts, tensor sizes, experts) is read off its own model class built on the
meta device (`ModelShape.from_config`); other configs are counted by Llama's and GPT-2's formula.

What a strategy does is declared by its optimizations (`Optimization.cost_traits`), combined
into `StrategyTraits`; the formulas read only those traits. Memory per rank, by backend
(`memory_breakdown`): replicated (DDP, torch ZeRO-1, tensor/pipeline stages), torch FSDP2, or
DeepSpeed ZeRO (a half-precision module with fp32 master partitions) -- model states,
buffers, gathered parameters and activations. The peak (`peak_bytes`) is what is always held
plus the larger of the activation phase and the gradient phase. Activations are counted, not
fitted: the tensors a Hugging Face decoder block saves for backward (per precision mode,
attention kind and tensor-parallel split; `_block_saved_bytes`), the final norm, and the loss's
b*s*vocab buffers (TP's gathered logits included), with and without checkpointing. Checked against
measured bytes on 2 ranks for every backend (tests/distributed/test_memory_model.py), the ZeRO
paper's Figure 1 (tests/unit/test_cost_model.py) and torch's FSDPMemTracker at 1B-7B on 8-64
fake ranks (benchmarks/memory_model.py). Step time = FLOPs / measured rate + a per-layer
overhead (both times the strategy's `compute_time_factor`, e.g. compile's) + communication volume /
measured bandwidth + a latency per collective.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple, Union

import torch
from torch import nn

from atorch.auto.strategy import Strategy, StrategyLike

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Activations are counted, not fitted: the bytes per token that a Hugging Face decoder block
# saves for backward, tensor by tensor, in each precision mode (listed with
# torch.autograd.graph.saved_tensors_hooks on Llama and GPT-2 blocks, eager and sdpa attention;
# see `_block_saved_bytes`), and the loss's b*s*vocab buffers. Checked against measured peaks on
# 2 CPU ranks (tests/distributed/test_dry_run.py) and torch's trackers at 1B-7B
# (benchmarks/memory_model.py).
# --------------------------------------------------------------------------------------------

# The device rates the step-time model divides by. "cpu" is measured (calibration script);
# the GPU entry is a datasheet-derived guess (no GPU was available to calibrate on) and only
# its ratios matter for ranking.
DEVICE_PROFILES: Dict[str, Dict[str, float]] = {
    "cpu": {"flops_fp32": 3.91e10, "flops_bf16": 6.65e10, "layer_overhead_s": 6.86e-3, "step_overhead_s": 0.0,
            "comm_bytes_per_s": 1.02e9, "comm_latency_s": 1.43e-3},
    "cuda": {"flops_fp32": 5.0e13, "flops_bf16": 4.0e14, "layer_overhead_s": 2.0e-4, "step_overhead_s": 2.0e-3,
             "comm_bytes_per_s": 1.5e11, "comm_latency_s": 2.0e-5},
}

ADAM_STATE_BYTES_PER_PARAM = 8       # exp_avg + exp_avg_sq in fp32
LORA_DEFAULT_RANK = 8


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

    @property
    def compute_params(self) -> int:
        return self.active_params or self.num_params

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
                   python_gelu=_has_python_gelu(model))


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
    vocab = _config_int(config, ("vocab_size",))
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
                                               _config_attr(config, "hidden_act", "gelu_new")) in _PYTHON_GELU_NAMES)


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
    if isinstance(head, nn.Linear) and not _shares_storage(head.weight, model):
        embedding += head.weight.numel()
    sizes: Dict[int, int] = {}
    for p in params:
        sizes[p.numel()] = sizes.get(p.numel(), 0) + 1
    fields: Dict[str, Any] = dict(num_params=num_params, layer_params=(num_params - embedding) // max(1, num_layers),
                                  embedding_params=embedding, parameter_sizes=tuple(sorted(sizes.items())))
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
    return fields


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


def _meta_model(config: Any, purpose: str) -> Optional[nn.Module]:
    """`AutoModelForCausalLM.from_config(config)` on the meta device with eager attention (the
    attention implementation does not change the parameters, and eager needs no optional kernel
    package); None, with the reason logged once, when transformers cannot build it."""
    import transformers

    try:
        # A copy: from_config may write into the config.
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
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


# (config content, probe tokens) -> the activation probe's scale for that config's block.
_CONFIG_SCALES: "OrderedDict[Tuple[str, int], float]" = OrderedDict()


def _config_activation_scale(config: Any, shape: ModelShape, seq_len: int) -> float:
    """The activation probe's measured / formula bytes for a transformers config's first block: its
    model built on the meta device and run under fake tensors (`activation_probe`; no memory, no
    compute), cached per config content and probe length; 1.0 for any other config.

    The meta model runs eager attention, so the formula it is compared with counts the attention
    matrix too; the scale then corrects the rest of the block (q/k norms, parallel attention,
    non-gated MLPs, experts) for whichever attention the strategy uses.
    """
    from atorch.auto.activation_probe import FAKE_PROBE_TOKENS, block_activation_scale

    key = _config_key(config)
    if key is None:
        return 1.0
    cache_key = (key, max(1, min(int(seq_len), FAKE_PROBE_TOKENS)))
    if cache_key in _CONFIG_SCALES:
        _CONFIG_SCALES.move_to_end(cache_key)
        return _CONFIG_SCALES[cache_key]
    model = _meta_model(config, "counting the block activations of")
    if model is None:
        return 1.0
    formula = _block_formula(dataclasses.replace(shape, fused_attention=False))
    scale = block_activation_scale(model, cache_key[1], formula)
    _CONFIG_SCALES[cache_key] = scale
    if len(_CONFIG_SCALES) > _LAYOUTS_MAX:
        _CONFIG_SCALES.popitem(last=False)
    return scale


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


# What DeepSpeed allocates with atorch's engine configs (checked against DeepSpeed 0.19 in
# tests/distributed/test_memory_model.py): the ZeRO-1/2 reduce bucket and ZeRO-3's contiguous
# reduce buffer, both `reduce_bucket_size` elements in the module's dtype (atorch derives it from
# the model: `_ds_config.bucket_elements`; DeepSpeed's own default is 5e8); ZeRO-3's prefetch.
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
DS_STAGE3_PREFETCH_ELEMENTS = 50_000_000
# ZeRO-3 keeps every parameter smaller than this whole on every rank (DeepSpeed's default
# `stage3_param_persistence_threshold`): norms and biases, and every parameter of a tiny model.
DS_STAGE3_PERSISTENCE_ELEMENTS = 100_000


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


def _ds_persistent_elements(shape: ModelShape, threshold: int = DS_STAGE3_PERSISTENCE_ELEMENTS) -> int:
    """Elements ZeRO-3 keeps whole on every rank: the parameters below the persistence threshold."""
    return sum(elements * count for elements, count in _parameter_sizes(shape) if elements < threshold)


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy does to memory and time: the combined `cost_traits` declarations of its items.

    Each optimization class declares its own effect (`Optimization.cost_traits`, e.g. amp_native:
    half compute and autocast; zero1: a sharder and its ZeRO stage); `from_strategy` applies
    them in the strategy's order, later items overriding earlier ones field by field. The
    memory formulas then read only these fields, never optimization names.
    """

    # layout (parallel_mode); tensor/pipeline count only when an optimization shards that way
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    tensor_parallel: bool = False
    gather_logits: bool = True          # tensor_parallel: the model returns the full logits (gathered)
    # precision
    compute_dtype_bytes: int = 4        # activations and matmuls (amp/half/DeepSpeed bf16: 2)
    param_dtype_bytes: int = 4          # parameters as the user's optimizer sees them (half: 2)
    autocast: bool = False              # amp_native: torch.autocast unless a sharding wrapper computes in half
    fp8: bool = False
    # sharding: None (replicated), "torch_zero1" (ZeroRedundancyOptimizer), "fsdp2", "deepspeed"
    sharding: Optional[str] = None
    zero_stage: int = 0
    reshard_after_forward: bool = True  # fsdp2 only
    cpu_offload: bool = False           # torch FSDP2 CPUOffloadPolicy: sharded params, grads, optimizer on the host
    ds_offload_optimizer: bool = False  # DeepSpeed offload_optimizer: fp32 master, Adam state, fp32 grads on the host
    ds_offload_params: bool = False     # DeepSpeed offload_param (ZeRO-3): the half parameter partitions too
    ds_bucket_elements: int = 0         # DeepSpeed's reduce bucket (user's ds_config); 0: atorch derives it
    # ZeRO-3's stage3_param_persistence_threshold and stage3_prefetch_bucket_size from the user's
    # ds_config (elements; 0 is a setting); None: DeepSpeed's defaults.
    ds_persistence_elements: Optional[int] = None
    ds_prefetch_elements: Optional[int] = None
    ddp_wrap: bool = False              # a DDP wrapper when data > 1 and nothing else reduces gradients
    # pipelines and accumulation
    pipeline_engine: Optional[str] = None   # "native" (torch pipelining) or "deepspeed"
    pipeline_chunks: int = 1            # micro-batches per step per data rank
    pipeline_schedule: str = "gpipe"    # "gpipe" keeps every micro-batch's activations, "1f1b" at most `pipeline`
    accumulation_steps: int = 1         # the micro-batch is global batch / data / accumulation_steps
    # what the model computes
    checkpoint: bool = False
    fused_attention: bool = False       # module_replace: sdpa, no b*heads*s^2 matrix
    fused_activation: bool = False      # module_replace: GPT-2's Python tanh GELU as one op (saves its input only)
    fused_norm: bool = False            # module_replace: RMSNorm as F.rms_norm (saves fp32 upcast and result in half)
    kv_cache_off: bool = False          # compile: sets the model's use_cache to False
    lora_rank: int = 0                  # lora: adapters of this rank, base weights frozen
    lora_targets: Optional[Tuple[str, ...]] = None
    trainable_fraction: float = 1.0     # derived: trainable / total parameters (lora)
    # how fast it computes
    compute_time_factor: float = 1.0    # multiplies compute + per-layer overhead seconds (compile: < 1)

    @classmethod
    def from_strategy(cls, strategy: StrategyLike, world_size: int, shape: ModelShape,
                      device_type: str = "cpu") -> "StrategyTraits":
        """Combine the `cost_traits` of every item of `strategy` (items of unknown names are ignored)."""
        from atorch.auto.opt_lib.base import CostContext, get_optimization

        s = Strategy.from_any(strategy)
        dims = _parallel_dims(s, world_size)
        items = []
        for item in s:
            try:
                opt = get_optimization(item.name)
            except ValueError:      # not registered here: it declares nothing to the cost model
                continue
            items.append((opt.order, opt, opt.parse_config(item.config)))
        items.sort(key=lambda entry: entry[0])
        configs = {opt.name: config for _, opt, config in items}
        context = CostContext(world_size=world_size, dims=dims, device_type=device_type, configs=configs)
        valid = {f.name for f in dataclasses.fields(cls)} - {"trainable_fraction"}
        updates: Dict[str, Any] = {}
        for _, opt, config in items:
            declared = opt.cost_traits(config, context)
            unknown = sorted(set(declared) - valid)
            if unknown:
                raise ValueError(f"{opt.name}.cost_traits declares unknown trait(s) {unknown}; valid traits are "
                                 f"{sorted(valid)}")
            updates.update(declared)
        if "parallel_mode" not in configs:      # no layout declared: every rank data-parallel
            updates["data"] = world_size
        traits = cls(**updates)
        if not traits.tensor_parallel:
            traits = dataclasses.replace(traits, tensor=1)
        if traits.pipeline_engine is None:
            traits = dataclasses.replace(traits, pipeline=1)
        trainable = lora_params(shape, traits) / max(1, shape.num_params + lora_params(shape, traits)) \
            if traits.lora_rank else 1.0
        return dataclasses.replace(traits, trainable_fraction=trainable)

    # -- derived views, in ZeRO's terms ---------------------------------------------------------
    @property
    def optimizer_shard(self) -> int:
        """Ranks the optimizer state is split over."""
        sharded = self.sharding in ("torch_zero1", "fsdp2") or (self.sharding == "deepspeed" and self.zero_stage >= 1)
        return self.data if sharded else 1

    @property
    def grad_shard(self) -> int:
        """Ranks the gradients are split over. DeepSpeed's stage-1 optimizer keeps only its partition's
        gradients too (it copies each reduced bucket's slice into one partition buffer; measured)."""
        sharded = self.sharding == "fsdp2" or (self.sharding == "deepspeed" and self.zero_stage >= 1)
        return self.data if sharded else 1

    @property
    def param_shard(self) -> int:
        """Ranks the stored parameters are split over."""
        sharded = self.sharding == "fsdp2" or (self.sharding == "deepspeed" and self.zero_stage >= 3)
        return self.data if sharded else 1

    @property
    def fsdp2(self) -> Optional[str]:
        """"zero2" (parameters kept gathered after forward) or "fsdp" (resharded) on torch FSDP2, else None."""
        if self.sharding != "fsdp2":
            return None
        return "fsdp" if self.reshard_after_forward else "zero2"

    @property
    def ddp_buckets(self) -> bool:
        """DDP keeps a flat copy of the gradients in its all-reduce buckets."""
        return self.ddp_wrap and self.data > 1 and self.sharding in (None, "torch_zero1") \
            and self.pipeline_engine is None

    @property
    def storage_bytes(self) -> int:
        """Bytes per element of the module's parameters: DeepSpeed holds them in its half dtype."""
        if self.sharding == "deepspeed" and self.compute_dtype_bytes == 2:
            return 2
        return self.param_dtype_bytes


def lora_params(shape: ModelShape, traits: StrategyTraits) -> int:
    """Adapter parameters: rank x (in + out) per adapted linear (peft's default targets: q and v for a
    Llama-style model, c_attn for GPT-2; any other target list counts one hidden x hidden linear each)."""
    if not traits.lora_rank:
        return 0
    r, h = traits.lora_rank, shape.hidden_size
    kv = shape.kv_dim or h
    if traits.lora_targets is None:
        per_layer = r * (2 * h + shape.q_dim + kv) if shape.gated else r * (h + 3 * h)
    else:
        per_layer = r * 2 * h * len(traits.lora_targets)
    return shape.num_layers * per_layer


def _parallel_dims(strategy: Strategy, world_size: int) -> Dict[str, int]:
    item = strategy.get("parallel_mode")
    if item is None or item.config is None:
        return {"data": world_size}
    config = item.config
    dims = getattr(config, "dims", None)
    if dims is None and isinstance(config, (tuple, list)) and config:
        dims = config[0]
    if not dims:
        return {"data": world_size}
    return {str(name): int(size) for name, size in dims}


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank peak memory and step time of one training step."""

    peak_memory_bytes: int
    step_time_s: float
    breakdown: Dict[str, float] = field(default_factory=dict, compare=False)

    def throughput(self, batch_size: int) -> float:
        """Predicted samples/s for a global batch of `batch_size`."""
        return batch_size / self.step_time_s if self.step_time_s > 0 else 0.0


def precision_mode(traits: StrategyTraits) -> str:
    """How the blocks compute, which decides the dtype of every saved activation.

    "fp32"; "autocast" (fp32 weights under `torch.autocast`: the residual stream and the norms
    stay fp32, each matmul saves a half copy of its input and of its weight); "half" (the module
    itself computes in half: the `half` optimization, FSDP2 mixed precision, DeepSpeed bf16/fp16).
    """
    if traits.compute_dtype_bytes == 4:
        return "fp32"
    if traits.autocast and traits.sharding not in ("fsdp2", "deepspeed") and traits.param_dtype_bytes == 4:
        return "autocast"
    return "half"


def _block_saved_bytes(shape: ModelShape, mode: str, seq_len: int, fused_attention: bool,
                       fused_activation: bool = False, fused_norm: bool = False,
                       kv_cache: bool = False) -> Tuple[float, float]:
    """Bytes per token that one decoder block saves for backward: (replicated, tensor-sharded).

    Counted on Hugging Face's Llama and GPT-2 blocks (saved_tensors_hooks, one storage counted
    once). Replicated under Megatron tensor parallelism: the residual stream, the norms' inputs
    and outputs, the column-parallel inputs (and their autocast copies). Sharded: q, k, v, the
    attention output, the attention matrix and the MLP's intermediate tensors.

    Llama (RMSNorm, SwiGLU): fp32 saves x, norm(x), the q/k/v input, q, k, v, the attention
    output and the same three for the MLP half, plus gate, silu(gate), up and their product.
    Under autocast the norms stay fp32 (x and x*rsqrt saved in fp32), while q, k and v each save
    their own half copy of the shared input (activation casts are not cached; 5 copies a block).
    In half the norms save an fp32 upcast of their input. Eager attention saves the softmax
    output (fp32 under autocast and in half, plus its half copy) and k and v repeated to every
    head; sdpa saves k and v at their grouped-query width and no b*heads*s^2 matrix.
    GPT-2 (LayerNorm, GELU MLP): x, the qkv input, q, k, v, the attention output, x2, the MLP
    input, and five b*s*ffn tensors (Hugging Face's tanh GELU in Python ops keeps its input and
    three intermediates; `fused_activation`, module_replace's `nn.GELU(approximate="tanh")`,
    keeps only its input: two b*s*ffn tensors, 0.57x the block in half at GPT-2 XL's width; a
    model whose own activation is native, `ModelShape.python_gelu` False, keeps two as well).
    `fused_norm` (module_replace's `F.rms_norm`): in half, each norm keeps its normalized result
    in fp32 where Hugging Face's RMSNorm keeps it in half (+2 bytes a norm; same bytes in fp32
    and under autocast). Measured on CPU, where `F.rms_norm` runs as its composite.
    `kv_cache` (a training forward with Hugging Face's cache, no checkpointing): the cache's
    `torch.cat` copies k and v and attention saves the copies. Where q, k and v are views of one
    fused projection (GPT-2's c_attn) the projection stays saved through q, so the copies are 2 x
    kv more; with separate projections (Llama) they replace tensors that are then freed (measured:
    the same bytes with and without the cache).
    """
    h, f, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    kv = (shape.kv_dim or h) if fused_attention else q
    attn = 0 if fused_attention or shape.num_heads == 0 else shape.num_heads * seq_len
    if shape.gated:
        qkvo = 2 * q + 2 * kv
        replicated = {"fp32": 4 * 6 * h, "autocast": 4 * 4 * h + 2 * 5 * h, "half": 4 * 2 * h + 2 * 4 * h}[mode]
        sharded = {"fp32": 4 * qkvo + 4 * 4 * f + 4 * attn, "autocast": 2 * qkvo + 2 * 4 * f + 6 * attn,
                   "half": 2 * qkvo + 2 * 4 * f + 6 * attn}[mode]
        if fused_norm and mode == "half":
            replicated += 2 * 2 * h
    else:
        ffn = 5 if shape.python_gelu and not fused_activation else 2      # b*s*ffn tensors the MLP keeps
        replicated = {"fp32": 4 * 4 * h, "autocast": 4 * 2 * h + 2 * 2 * h, "half": 2 * 4 * h}[mode]
        sharded = {"fp32": 4 * 4 * h + 4 * ffn * f + 4 * attn, "autocast": 2 * 4 * h + 2 * ffn * f + 6 * attn,
                   "half": 2 * 4 * h + 2 * ffn * f + 2 * attn}[mode]
        if kv_cache:
            sharded += (4 if mode == "fp32" else 2) * 2 * (shape.kv_dim or h)
    return float(replicated), float(sharded)


def _frozen_inputs_bytes(shape: ModelShape, mode: str) -> Tuple[float, float]:
    """Bytes per token a block does *not* save when its base linears are frozen (LoRA): a frozen
    linear needs no input for a weight gradient. The q/k/v input stays (peft's default adapters
    on q and v, or GPT-2's c_attn, read it); the MLP input, the attention output and the MLP
    product are saved only for the frozen o/gate/up/down weights. Under autocast the three
    frozen q/k/v casts go too (the two adapters cast their own copies)."""
    h, f = shape.hidden_size, shape.intermediate_size
    nbytes = 4 if mode == "fp32" else 2
    replicated = nbytes * h + (2 * 3 * h if mode == "autocast" and shape.gated else 0)
    return float(replicated), float(nbytes * (shape.q_dim + f))


def _final_norm_saved_bytes(shape: ModelShape, mode: str, frozen_head: bool = False,
                            fused_norm: bool = False) -> float:
    """Bytes per token the final norm and the LM head's input save (replicated under tensor parallelism)."""
    h = shape.hidden_size
    if shape.gated:
        saved = {"fp32": 4 * 3 * h, "autocast": 4 * 2 * h + 2 * h, "half": 4 * h + 2 * 2 * h}[mode]
        if fused_norm and mode == "half":     # F.rms_norm keeps its normalized result in fp32
            saved += 2 * h
    else:
        saved = {"fp32": 4 * 2 * h, "autocast": 4 * h + 2 * h, "half": 2 * 2 * h}[mode]
    # A frozen head (LoRA) keeps no input for its weight gradient.
    return float(saved - ((4 if mode == "fp32" else 2) * h if frozen_head else 0))


def block_activation_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                           kv_cache: bool = False) -> float:
    """Bytes one decoder block saves for backward on one rank (what a checkpointed block rebuilds,
    without a cache: checkpointed blocks run with use_cache=False)."""
    mode = precision_mode(traits)
    replicated, sharded = _block_saved_bytes(shape, mode, seq_len, traits.fused_attention or shape.fused_attention,
                                             traits.fused_activation, traits.fused_norm, kv_cache)
    if traits.lora_rank:
        frozen_replicated, frozen_sharded = _frozen_inputs_bytes(shape, mode)
        replicated, sharded = replicated - frozen_replicated, sharded - frozen_sharded
    return micro_batch * seq_len * (replicated + sharded / traits.tensor) * shape.activation_scale


def activation_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """Bytes one rank's forward saves for backward: its blocks, the final norm and the loss's softmax.

    With activation checkpointing a block keeps only its input (the residual stream: fp32 unless
    the module computes in half). A pipeline stage runs its share of the blocks (the final norm
    and the loss are counted: the last stage has them).
    """
    mode = precision_mode(traits)
    tokens = micro_batch * seq_len
    blocks = math.ceil(shape.num_layers / traits.pipeline)
    if traits.checkpoint:
        per_block = 1.0 * tokens * (2 if mode == "half" else 4) * shape.hidden_size
    else:
        per_block = block_activation_bytes(shape, traits, micro_batch, seq_len,
                                           kv_cache=shape.kv_cache and not traits.kv_cache_off)
    softmax = loss_softmax_bytes(shape, traits, micro_batch, seq_len)
    final = tokens * _final_norm_saved_bytes(shape, mode, frozen_head=bool(traits.lora_rank),
                                             fused_norm=traits.fused_norm)
    if traits.pipeline_engine is not None:
        # The schedule keeps each in-flight micro-batch's stage output for its backward: on the
        # last stage, the logits (b*s*vocab in the compute dtype).
        final += tokens * shape.vocab_size / traits.tensor * traits.compute_dtype_bytes
    return blocks * per_block + final + softmax


def loss_softmax_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int) -> float:
    """The loss's saved fp32 softmax (log-softmax, or the vocabulary-parallel softmax slice)."""
    return micro_batch * seq_len * 4.0 * shape.vocab_size / traits.tensor


def loss_buffer_bytes(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                      head_grad: float) -> float:
    """The b*s*vocab buffers on top of the saved activations at the activation phase's peak.

    Hugging Face's loss (`ForCausalLMLoss`, as `atorch.auto.train_step` runs it: the model's
    output is dropped before backward): the log-softmax backward holds its saved output, the
    incoming gradient and its result, 2 x 4 bytes a logit beyond the saved softmax; then the LM
    head's backward holds the logits' gradient and the head's weight gradient (`head_grad`).
    atorch's tensor parallel: the vocabulary-parallel loss's forward holds the local logits, an
    fp32 copy and the shifted logits; with `gather_logits` (the default) the output hook then
    holds the local slice, the gathered list and the concatenated full logits (b*s*vocab in the
    compute dtype, twice). Its backward reuses the saved softmax as the gradient.
    """
    tokens = micro_batch * seq_len
    v, t, cb = shape.vocab_size, traits.tensor, traits.compute_dtype_bytes
    if traits.tensor_parallel and t > 1:
        upcast = 4 if cb < 4 else 0
        forward = tokens * v / t * (cb + upcast + 4)
        gather = tokens * v * cb * (2 + 1 / t) if traits.gather_logits else 0.0
        return max(forward, gather, head_grad)
    return max(tokens * v * 8.0, head_grad + tokens * v * (cb - 4))


def estimate(model_or_config: Union[nn.Module, Any, ModelShape], strategy: StrategyLike, batch_size: int,
             seq_len: int, world_size: int, device: Union[str, torch.device] = "cpu",
             profile: Optional[Mapping[str, float]] = None) -> Estimate:
    """Predict (per-rank peak memory, step time) of `strategy` for a *global* batch of `batch_size`.

    `model_or_config` is a module, a transformers config or a `ModelShape`. `profile` overrides
    the device rates of `DEVICE_PROFILES[device type]`. The peak counts device memory only:
    what CPU offload keeps in host memory is in the breakdown as `mem_host_*` entries.
    """
    if batch_size <= 0 or seq_len <= 0 or world_size <= 0:
        raise ValueError(f"batch_size={batch_size}, seq_len={seq_len}, world_size={world_size} must all be > 0")
    shape = shape_of(model_or_config, seq_len)
    device_type = torch.device(device).type
    traits = StrategyTraits.from_strategy(strategy, world_size, shape, device_type)
    rates = dict(DEVICE_PROFILES.get(device_type, DEVICE_PROFILES["cuda"]))
    rates.update(profile or {})

    per_rank = max(1, batch_size // traits.data)
    memory = memory_breakdown(shape, traits, micro_batch_size(traits, batch_size), seq_len, device_type)
    time = time_breakdown(shape, traits, per_rank, seq_len, rates)
    return Estimate(peak_bytes(memory), sum(time.values()), {**{f"mem_{k}": v for k, v in memory.items()},
                                                             **{f"time_{k}": v for k, v in time.items()}})


def shape_of(obj: Any, seq_len: Optional[int] = None) -> ModelShape:
    """The `ModelShape` of a shape, a module or a config; with `seq_len`, its block activations
    measured by the activation probe (a module on itself, a transformers config on its model
    built on the meta device), as `estimate` uses it."""
    if isinstance(obj, ModelShape):
        return obj
    if isinstance(obj, nn.Module):
        return calibrated_shape(obj, seq_len) if seq_len else ModelShape.from_module(obj)
    shape = ModelShape.from_config(obj)
    if not seq_len:
        return shape
    return dataclasses.replace(shape, activation_scale=_config_activation_scale(obj, shape, seq_len))


# model -> {(seq_len, parameter count): scale}: one probe per model and sequence length.
_SCALES: "weakref.WeakKeyDictionary[nn.Module, Dict[Tuple[int, int], float]]" = weakref.WeakKeyDictionary()


def _block_formula(shape: ModelShape) -> Callable[[int, str], float]:
    """What the activation probe compares its measurement with: the formula's bytes one block of
    `shape` saves for `tokens` tokens in `mode` ("fp32" or "half"), with the shape's own attention."""
    def formula(tokens: int, mode: str) -> float:
        replicated, sharded = _block_saved_bytes(shape, mode, tokens, shape.fused_attention)
        return tokens * (replicated + sharded)
    return formula


def calibrated_shape(model: nn.Module, seq_len: int) -> ModelShape:
    """`ModelShape.from_module(model)` with its block activations measured on the model itself
    (`activation_probe.block_activation_scale`, cached per model and sequence length)."""
    from atorch.auto.activation_probe import block_activation_scale

    shape = ModelShape.from_module(model)
    key = (int(seq_len), shape.num_params)
    scales = _SCALES.setdefault(model, {})
    if key not in scales:
        scales[key] = block_activation_scale(model, key[0], _block_formula(shape))
    return dataclasses.replace(shape, activation_scale=scales[key])


def micro_batch_size(traits: StrategyTraits, global_batch: int) -> int:
    """Rows of one forward/backward on one rank: the global batch over the data ranks, then over the
    gradient-accumulation steps or the pipeline's micro-batches."""
    per_rank = max(1, global_batch // traits.data)
    split = traits.pipeline_chunks if traits.pipeline_engine is not None else traits.accumulation_steps
    return max(1, per_rank // max(1, split))


# Entries of `memory_breakdown` that are model states (the ZeRO paper's "model states"), and
# those that stay allocated from one step to the next (what a rank holds once a backward pass
# has finished and its activations are freed); the others exist only during part of a step.
MODEL_STATE_KEYS = ("params", "grads", "master", "optimizer")
RESIDENT_KEYS = MODEL_STATE_KEYS + ("ddp_buckets", "ds_reduce_buffer", "grad_fp32", "ds_persistent_params",
                                    "ds_offload_buffers", "ds_offload_host_buffers")


# The moments of a step, each a set of breakdown entries alive together; everything in no
# phase is held all the time. Gradients are set to None by zero_grad, so none exist during the
# next forward. Backward frees activations as it creates gradients, block by block: with a
# stack of similar blocks their sum is largest at one end, so backward is checked at its start
# (all activations, the loss freed) and at its end (all gradients).
FORWARD_END_KEYS = ("activations", "loss_softmax", "loss_buffers", "weight_casts", "gathered_params",
                    "ds_reduce_bucket")
# A block's backward: its unsharded gradients and their reduce-scatter copy (`unit_grads`), the
# next block prefetched, a checkpointed block rebuilt, FSDP2's root unit holding the LM head's
# unsharded gradient until the root reduces last.
BACKWARD_KEYS = ("weight_casts", "gathered_params", "prefetch", "ds_reduce_bucket", "unit_grads", "recompute",
                 "held_root_grads")
BACKWARD_START_KEYS = ("activations",) + BACKWARD_KEYS
BACKWARD_END_KEYS = ("grads",) + BACKWARD_KEYS
# After backward: the root unit's reduce-scatter; DeepSpeed's fp32 gradient copy for the step.
GRADIENT_PHASE_KEYS = ("grads", "reduce_scatter", "step_grad_fp32")
# The optimizer step: the gradients and the step's own temporaries (`optimizer_step`).
STEP_PHASE_KEYS = ("grads", "step_grad_fp32", "optimizer_step")
PHASES = (FORWARD_END_KEYS, BACKWARD_START_KEYS, BACKWARD_END_KEYS, GRADIENT_PHASE_KEYS, STEP_PHASE_KEYS)
# Entries of the activation phases (forward and backward), for callers that want them summed.
ACTIVATION_PHASE_KEYS = tuple(dict.fromkeys(FORWARD_END_KEYS + BACKWARD_KEYS))


def peak_bytes(breakdown: Mapping[str, float], phases: Optional[Tuple[Tuple[str, ...], ...]] = None) -> int:
    """Per-rank device peak: what is always held + the largest of the step's moments (`PHASES`).

    Checked against torch's FSDPMemTracker at 1B-7B (benchmarks/memory_model.py) and measured
    bytes on 2 ranks. `host_*` entries (CPU offload) are not device memory. `phases` restricts
    the moments considered (e.g. `PHASES[:-1]`: forward and backward only).
    """
    device = {k: v for k, v in breakdown.items() if not k.startswith("host_")}
    in_a_phase = {k for keys in PHASES for k in keys}
    always = sum(v for k, v in device.items() if k not in in_a_phase)
    return int(always + max(sum(device.get(k, 0.0) for k in keys) for keys in (phases or PHASES)))


def model_state_bytes(breakdown: Mapping[str, float]) -> float:
    """Parameters, gradients, fp32 master weights and optimizer state on the device (the paper's model states)."""
    return sum(breakdown.get(k, 0.0) for k in MODEL_STATE_KEYS)


def resident_bytes(breakdown: Mapping[str, float]) -> float:
    """Device bytes held right after a backward pass: model states and the buffers that outlive a step."""
    return sum(breakdown.get(k, 0.0) for k in RESIDENT_KEYS)


def stage_params(shape: ModelShape, traits: StrategyTraits) -> float:
    """Parameters of the heaviest pipeline stage (the whole model without a pipeline), before tensor sharding.

    Stages are balanced by parameter count, but a stage cannot be lighter than its largest
    indivisible piece: one block plus the embedding (first stage) or the head (last).
    """
    p = traits.pipeline
    if p <= 1:
        return float(shape.num_params)
    return max(shape.num_params / p, shape.layer_params + shape.embedding_params / 2)


def memory_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                     device_type: str = "cpu") -> Dict[str, float]:
    """Per-rank bytes by kind, for the backend the traits describe.

    - replicated (DDP, torch ZeRO-1, tensor/pipeline stages): parameters, gradients and Adam
      state in the parameter dtype (`half`: 2 bytes, else fp32); torch ZeRO-1 splits the Adam
      state; DDP adds its flat gradient buckets; autocast adds half copies of the weights.
    - torch FSDP2: sharded fp32 parameters, gradients (reduced in fp32) and Adam state; the
      gathered units (in the mixed-precision dtype) and one reduce-scatter buffer on top.
    - DeepSpeed ZeRO: the module itself in the half dtype under bf16/fp16 (sharded at stage 3),
      fp32 master partitions and Adam state / data ranks, the partition's gradients in the module
      dtype and their fp32 copy for the step, DeepSpeed's reduce bucket (500M elements by default).
    - LoRA: frozen base weights have no gradients or optimizer state; adapters do.
    - CPU offload (on a GPU): the offloaded states move to `host_*` entries, outside the peak.
    """
    t = traits.tensor
    # atorch's tensor_parallel shards the embeddings and the LM head too (norms are negligible).
    base = stage_params(shape, traits) / t
    adapters = lora_params(shape, traits) / t / traits.pipeline
    params_per_rank = base + adapters
    trainable = adapters if traits.lora_rank else params_per_rank
    if traits.sharding == "deepspeed":
        out = _deepspeed_states(shape, traits, params_per_rank, trainable)
    elif traits.sharding == "fsdp2":
        out = _fsdp2_states(shape, traits, params_per_rank, trainable)
    else:
        out = _replicated_states(shape, traits, params_per_rank, trainable)
    if traits.sharding != "deepspeed":     # DeepSpeed's step: its fp32 gradient copy (step_grad_fp32)
        out["optimizer_step"] = _torch_adam_step_bytes(shape, traits, trainable, device_type)
    out["activations"] = activation_bytes(shape, traits, micro_batch, seq_len) * _in_flight_micro_batches(traits)
    if traits.pipeline_engine is None:
        # The loss's saved softmax is freed by the loss's backward, before any block's backward.
        out["loss_softmax"] = loss_softmax_bytes(shape, traits, micro_batch, seq_len)
        out["activations"] -= out["loss_softmax"]
    head_grad = 0.0
    if not traits.lora_rank:
        # The LM head's whole (unsharded) weight gradient, in the dtype backward produces it
        # (the compute dtype under FSDP2/DeepSpeed mixed precision); under autocast the half
        # gradient of the cast weight is accumulated into the fp32 one.
        head = shape.vocab_size * shape.hidden_size / t
        gbytes = traits.storage_bytes if traits.sharding != "fsdp2" else min(traits.compute_dtype_bytes,
                                                                           traits.param_dtype_bytes)
        head_grad = head * (gbytes + (2 if precision_mode(traits) == "autocast" else 0))
    out["loss_buffers"] = loss_buffer_bytes(shape, traits, micro_batch, seq_len, head_grad)
    if precision_mode(traits) == "autocast":
        # Autocast caches a half copy of every matmul weight (the head's included) for the
        # forward, and each linear saves it for backward: 2 bytes a matmul parameter.
        lookups = (shape.embedding_params - shape.vocab_size * shape.hidden_size) / t
        out["weight_casts"] = 2.0 * max(0.0, params_per_rank - lookups)
    if traits.checkpoint:
        # Backward rebuilds one block at a time, while the gradients are being produced.
        out["recompute"] = block_activation_bytes(shape, traits, micro_batch, seq_len)
    if device_type != "cpu":
        for key in _host_keys(traits):
            if key in out:
                out[f"host_{key}"] = out.pop(key)
    return out


def _host_keys(traits: StrategyTraits) -> Tuple[str, ...]:
    """Breakdown entries CPU offload keeps in host memory instead of the device's.

    - torch FSDP2 `CPUOffloadPolicy`: the sharded parameters, gradients and optimizer state (the
      optimizer steps on the host, its temporaries too); units are gathered onto the device.
    - DeepSpeed `offload_optimizer`: the fp32 master partition, Adam state and the fp32 gradient
      partition DeepSpeed reduces into; the half module (stages 1-2) or its partitions (stage 3)
      and the reduce bucket stay on the device. `offload_param` (stage 3) moves the partitions too.
    """
    if traits.sharding == "deepspeed":
        if not traits.ds_offload_optimizer and not traits.ds_offload_params:
            return ()
        moved = ("master", "optimizer", "grad_fp32", "ds_offload_host_buffers") if traits.ds_offload_optimizer else ()
        return moved + (("params",) if traits.ds_offload_params else ())
    if traits.cpu_offload:
        return ("params", "grads", "master", "optimizer", "grad_fp32", "step_grad_fp32", "optimizer_step")
    return ()


# Temporaries of torch's Adam/AdamW step, in copies of the parameters' local tensors (measured
# with PeakMemoryTracker on real tensors: tests/unit/test_cost_model_moments.py). The foreach
# implementation (torch's default on CUDA) builds one list the size of every parameter (sqrt of
# the second moment). The per-tensor one (the default on CPU) holds 2 temporaries of the
# parameter it updates; on FSDP2's DTensor shards it also keeps 3 copies of every shard it has
# updated until the step returns.
ADAM_FOREACH_COPIES = 1
ADAM_PER_TENSOR_COPIES = 2
ADAM_PER_TENSOR_DTENSOR_KEPT_COPIES = 3


def adam_step_bytes(trainable_elements: float, largest_elements: float, state_bytes: int, foreach: bool,
                    dtensor: bool) -> float:
    """Bytes torch's Adam/AdamW step allocates beyond the parameters, gradients and its state.

    `trainable_elements`: the rank's trainable parameter elements; `largest_elements`: its largest
    single parameter tensor (the local shard under FSDP2); `state_bytes`: the moments' dtype size.
    """
    if foreach:
        return ADAM_FOREACH_COPIES * trainable_elements * state_bytes
    largest = min(largest_elements, trainable_elements)
    kept = ADAM_PER_TENSOR_DTENSOR_KEPT_COPIES * trainable_elements if dtensor else 0.0
    return (kept + ADAM_PER_TENSOR_COPIES * largest) * state_bytes


def _torch_adam_step_bytes(shape: ModelShape, traits: StrategyTraits, trainable: float, device_type: str) -> float:
    """`adam_step_bytes` for the rank's local optimizer (torch's default implementation on `device_type`)."""
    shard = traits.optimizer_shard
    widest = _largest_param_elements(shape)
    if traits.lora_rank:
        widest = shape.hidden_size * traits.lora_rank
    largest = widest / traits.tensor / (traits.data if traits.sharding == "fsdp2" else 1)
    # CPU offload steps on host tensors: torch picks the per-tensor implementation there.
    on_host = device_type == "cpu" or traits.cpu_offload
    return adam_step_bytes(trainable / shard, largest, traits.param_dtype_bytes, foreach=not on_host,
                           dtensor=traits.sharding == "fsdp2")


def _replicated_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    pbytes = traits.param_dtype_bytes
    # torch's Adam keeps its two moments in the parameter dtype.
    out = {"params": params * pbytes, "grads": trainable * pbytes,
           "optimizer": trainable * ADAM_STATE_BYTES_PER_PARAM * pbytes / 4 / traits.optimizer_shard}
    if traits.ddp_buckets:
        out["ddp_buckets"] = trainable * pbytes
    return out


def _fsdp2_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    d, t, pbytes = traits.data, traits.tensor, traits.param_dtype_bytes
    # MixedPrecisionPolicy(reduce_dtype=fp32) under amp: sharded gradients in fp32 next to fp32 shards.
    gbytes = 4 if traits.autocast else pbytes
    out = {"params": params * pbytes / d, "grads": trainable * gbytes / d,
           "optimizer": trainable * ADAM_STATE_BYTES_PER_PARAM * pbytes / 4 / d}
    gathered_bytes = traits.compute_dtype_bytes if traits.compute_dtype_bytes < pbytes else pbytes
    root = shape.embedding_params / t
    block = shape.layer_params / t
    if not traits.reshard_after_forward:   # every unit stays gathered from its forward to its backward
        out["gathered_params"] = params * gathered_bytes
    else:
        # The root unit stays gathered, and the current block; in backward, the next one prefetched.
        out["gathered_params"] = (root + block) * gathered_bytes
        out["prefetch"] = block * gathered_bytes
    if not traits.lora_rank:
        # The root unit reduces last: the LM head's unsharded gradient lives through the blocks' backward.
        out["held_root_grads"] = shape.vocab_size * shape.hidden_size / t * gathered_bytes
    # A unit's backward leaves its unsharded gradients (in the compute dtype) and copies them into
    # the flat fp32 reduce-scatter input. The largest unit (the root: embeddings and head) reduces
    # last, when the activations are gone; a block reduces while most activations are still alive
    # (checked against FSDPMemTracker at 1B-7B, benchmarks/memory_model.py).
    per_param = gathered_bytes + 4
    out["reduce_scatter"] = max(root, block) * per_param
    out["unit_grads"] = block * per_param
    return out


def _deepspeed_states(shape: ModelShape, traits: StrategyTraits, params: float, trainable: float) -> Dict[str, float]:
    from atorch.auto.opt_lib._ds_config import bucket_elements

    d, stage = traits.data, traits.zero_stage
    hbytes = traits.storage_bytes           # bf16/fp16 enabled: the module is half; else fp32
    # The user's reduce_bucket_size, else the one atorch derives from the trainable elements.
    bucket = traits.ds_bucket_elements or bucket_elements(int(trainable))
    shard = d if stage >= 1 else 1
    out = {"params": params * hbytes / (d if stage >= 3 else 1),
           # the partition's reduced gradients, in the module dtype (stage 0: every gradient)
           "grads": trainable * hbytes / shard,
           # DeepSpeed clones its partition into fp32 master weights even when the module is fp32
           "master": trainable * 4 / shard,
           "optimizer": trainable * ADAM_STATE_BYTES_PER_PARAM / shard}
    largest = _largest_param_elements(shape) / traits.tensor
    if traits.ds_offload_optimizer:
        # The CPU Adam steps on a persistent fp32 gradient partition in host memory (measured on
        # 2 ranks, DeepSpeed 0.19). Stages 1-2 reduce straight into it (no half partition) and keep
        # a half copy of the partition on the host plus a gradient staging buffer of the largest
        # parameter on each side; stage 3 keeps its half gradient partition on the device.
        out["grad_fp32"] = trainable * 4 / shard
        if stage < 3:
            del out["grads"]
            out["ds_offload_host_buffers"] = (trainable / shard + largest) * hbytes
            out["ds_offload_buffers"] = largest * hbytes
    elif hbytes < 4:
        # The step upcasts the partition's gradients to fp32 and frees the copy afterwards (ZeRO-3
        # too: measured after the second backward, no fp32 gradient partition is alive).
        out["step_grad_fp32"] = trainable * 4 / shard
    if stage >= 3:
        # Parameters below the persistence threshold stay whole on every rank, next to the partitions.
        threshold = DS_STAGE3_PERSISTENCE_ELEMENTS if traits.ds_persistence_elements is None \
            else traits.ds_persistence_elements
        out["ds_persistent_params"] = min(_ds_persistent_elements(shape, threshold), params) * hbytes
        # The contiguous reduce buffer, allocated at start-up, and the layers gathered for compute.
        out["ds_reduce_buffer"] = bucket * hbytes
        unit = max(shape.embedding_params / 2, shape.layer_params) / traits.tensor
        prefetch = DS_STAGE3_PREFETCH_ELEMENTS if traits.ds_prefetch_elements is None else traits.ds_prefetch_elements
        out["gathered_params"] = min(params, unit + prefetch) * hbytes
    elif stage >= 1:
        # The reduce bucket of the backward pass (`reduce_bucket_size` elements), freed once the
        # gradients are reduced.
        out["ds_reduce_bucket"] = bucket * hbytes
    return out


def _in_flight_micro_batches(traits: StrategyTraits) -> int:
    """Micro-batches whose activations a pipeline stage holds at once (1 without a pipeline)."""
    if traits.pipeline_engine is None:
        return 1
    if traits.pipeline_schedule == "gpipe":
        return traits.pipeline_chunks
    return min(traits.pipeline, traits.pipeline_chunks)


def time_breakdown(shape: ModelShape, traits: StrategyTraits, micro_batch: int, seq_len: int,
                   rates: Mapping[str, float]) -> Dict[str, float]:
    """Per-step seconds by kind: compute, framework overhead and communication (not overlapped)."""
    tokens = micro_batch * seq_len
    L, h, t, d = shape.num_layers, shape.hidden_size, traits.tensor, traits.data
    # The LM head multiplies, lookups do not; a mixture of experts multiplies its top-k experts only.
    matmul_params = shape.compute_params - shape.embedding_params / 2
    # 2N forward + 2N backward (activations) + 2N backward (weights, trainable only), attention
    # 12*L*s*(heads x head_dim).
    weight_grad = 2 * matmul_params * traits.trainable_fraction
    q = shape.q_dim
    flops = tokens * ((4 * matmul_params + weight_grad) / t + 12 * L * seq_len * q / t)
    if traits.checkpoint:
        flops += tokens * (2 * (shape.compute_params - shape.embedding_params) / t + 4 * L * seq_len * q / t)
    rate = rates["flops_bf16"] if traits.compute_dtype_bytes == 2 else rates["flops_fp32"]
    if traits.fp8:
        rate *= 1.6
    # compute_time_factor (e.g. compile's measured compiled/eager ratio) scales what runs inside
    # the model, kernels and per-layer framework overhead alike; communication is unaffected.
    compute = flops / rate * traits.compute_time_factor
    overhead = rates["step_overhead_s"] + \
        L * rates["layer_overhead_s"] * (1.5 if traits.checkpoint else 1.0) * traits.compute_time_factor
    bw, lat = rates["comm_bytes_per_s"], rates["comm_latency_s"]
    comm = 0.0
    collectives = 0
    grad_bytes = shape.num_params / t * traits.trainable_fraction * 4
    if d > 1:
        ring = (d - 1) / d
        if traits.param_shard > 1:        # FSDP: all-gather forward, all-gather backward, reduce-scatter
            comm += 3 * ring * grad_bytes / bw
            collectives += 3 * L
        else:                             # DDP / ZeRO-1/2: one all-reduce volume (reduce-scatter + all-gather)
            comm += 2 * ring * grad_bytes / bw
            collectives += max(1, math.ceil(grad_bytes / 25e6)) * (2 if traits.optimizer_shard > 1 else 1)
    if t > 1:                             # Megatron TP: 2 all-reduces forward + 2 backward per layer
        act = micro_batch * seq_len * h * traits.compute_dtype_bytes
        comm += 4 * L * 2 * (t - 1) / t * act / bw
        collectives += 4 * L
    return {"compute": compute, "overhead": overhead, "communication": comm + collectives * lat}
