"""A `TPInfo` from the tensor-parallel plan that transformers ships with a model.

transformers describes how to shard most modern architectures: `config.base_model_tp_plan`
maps module patterns of the base model (`layers.*.self_attn.q_proj`) to a style
(`colwise`, `rowwise`, ...), and the model class's `_tp_plan` adds its head (`lm_head`).
`tpinfo_from_transformers_plan` translates those styles into atorch's roles:

| transformers style                       | atorch role                                                  |
|------------------------------------------|--------------------------------------------------------------|
| `colwise`                                | column-parallel linear, output kept split                     |
| `colwise_gather_output`                  | column-parallel linear, output gathered                       |
| `rowwise` (linear)                       | row-parallel linear, input already split                      |
| `rowwise_split_input`                    | row-parallel linear that splits its (replicated) input        |
| `rowwise` / `embedding_rowwise` (embedding) | vocabulary-parallel embedding                              |
| `replicated_with_grad_allreduce`         | replicated parameters, gradients summed (`reduce_grads`)      |
| `moe_tp_experts` (+ `packed_colwise` / `rowwise` on its 3-D weights) | experts split like MLPs (`shard_experts`) |

and adds what the plan leaves implicit: the input embedding (vocabulary-parallel when it is
an `nn.Embedding`, also Gemma's scaled one), the LM head (column-parallel; full logits are
gathered after the loss), the per-rank dropout stream of split attention modules, the shared
stream of the other dropout modules (the rest of the forward, functional dropout included, runs
in that stream too: `randomizer.fork_model_rng`), and the head-count attributes that split attention
modules reshape with. Plan entries that match no module of this instance (dense layers of
an all-MoE model) are skipped; a style atorch cannot honour is a ValueError naming the
module and the style.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from torch import nn

from atorch.tensor_parallel.plan import (EXPERT_WEIGHTS, TPInfo, head_dim_of, head_local_parameters,
                                         is_attention_name, output_embedding)

# Styles translated to a role, by the kind of module they apply to.
_LINEAR_STYLES = {
    "colwise": ("col", {}),
    "colwise_gather_output": ("col", {"gather_output": True}),
    "rowwise": ("row", {}),
    "rowwise_split_input": ("row", {"input_is_parallel": False}),
}
_EMBEDDING_STYLES = ("rowwise", "embedding_rowwise")
_EXPERT_WEIGHT_STYLES = {"gate_up_proj": ("packed_colwise", "colwise"), "down_proj": ("rowwise", "packed_rowwise")}
# Integer attributes that attention modules of some architectures reshape with (only present ones are shrunk).
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "hidden_size", "embed_dim",
              "split_size")


def transformers_plan(model: nn.Module) -> Dict[str, str]:
    """The model's plan with patterns relative to `model`: the base model's (prefixed) and the head's."""
    config = getattr(model, "config", None)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = ""
    base_name = _base_model_name(model)
    if base_name:
        prefix = base_name + "."
    plan = {prefix + key: style for key, style in base_plan.items()}
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    for key, style in head_plan.items():
        plan.setdefault(key, style)
    return plan


def _base_model_name(model: nn.Module) -> str:
    """The attribute holding the base model the plan's keys are relative to: `base_model_prefix`
    when the model has it, else the child sharing the model's config (Llama-4's causal LM declares
    the prefix "language_model" of its multimodal sibling but keeps its base model in `model`: the
    plan then matched no layer and tensor parallelism sharded the embedding and the head only)."""
    base_name = getattr(model, "base_model_prefix", "")
    child = getattr(model, base_name, None) if base_name else None
    if isinstance(child, nn.Module) and child is not model:
        return base_name
    config = getattr(model, "config", None)
    transformers = sys.modules.get("transformers")     # a transformers model implies it is imported
    if config is None or transformers is None:
        return ""
    for name, module in model.named_children():
        # A pretrained model of its own (not a rotary embedding, which holds the config too).
        if isinstance(module, transformers.PreTrainedModel) and getattr(module, "config", None) is config:
            return name
    return ""


def has_transformers_plan(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "base_model_tp_plan", None))


def _pattern(key: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def _suffix(name: str) -> str:
    """The name after its last numeric component ('model.layers.3.mlp.up_proj' -> 'mlp.up_proj')."""
    parts = name.split(".")
    last_index = max((i for i, p in enumerate(parts) if p.isdigit()), default=-1)
    return ".".join(parts[last_index + 1:]) or name


def _unique_suffix(name: str, modules: Mapping[str, nn.Module]) -> str:
    """The shortest trailing part of `name` that names this module only ('model.embed_tokens' -> 'embed_tokens')."""
    parts = name.split(".")
    for start in range(len(parts) - 1, -1, -1):
        suffix = ".".join(parts[start:])
        if sum(1 for n in modules if n == suffix or n.endswith("." + suffix)) == 1:
            return suffix
    return name


def _has_embed_scale_only(module: nn.Module) -> bool:
    """Gemma's scaled word embedding: an nn.Embedding whose forward multiplies by an `embed_scale` buffer."""
    return isinstance(getattr(module, "embed_scale", None), (int, float)) or (
        hasattr(module, "embed_scale") and getattr(module.embed_scale, "dim", lambda: 1)() == 0)


def shardable_embedding(module: Optional[nn.Module]) -> bool:
    """An embedding `VocabParallelEmbedding` reproduces: nn.Embedding itself, or one that only scales its output."""
    if not isinstance(module, nn.Embedding):
        return False
    return type(module) is nn.Embedding or _has_embed_scale_only(module)


def tpinfo_from_transformers_plan(model: nn.Module) -> TPInfo:
    """Translate the model's transformers tensor-parallel plan (see the module docstring); ValueError if impossible."""
    plan = transformers_plan(model)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no transformers tensor-parallel plan (config.base_model_tp_plan)")
    modules = dict(model.named_modules())
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    head = output_embedding(model)
    head_name = next((n for n, m in modules.items() if m is head), None) if head is not None else None

    # Each matched module (or parameter) -> its style, most specific key first (transformers' rule too).
    styled: Dict[str, Tuple[str, str]] = {}
    for key in sorted(plan, key=len, reverse=True):
        style = plan[key]
        regex = _pattern(key)
        for name in list(modules) + list(params):
            if name and regex.match(name) and name not in styled:
                styled[name] = (key, style)

    tpinfo = TPInfo()
    experts: Set[str] = {n for n, (_, style) in styled.items() if style == "moe_tp_experts" and n in modules}
    split_attention: Set[str] = set()
    gathered_attention: Set[str] = set()
    ordered = [n for n in modules if n in styled] + [n for n in params if n in styled and n not in modules]
    for name in ordered:  # model order, so errors name the first module a reader would look at
        key, style = styled[name]
        if name == head_name:
            continue  # the head is added below, whatever its plan says
        if name in params and name not in modules:
            _check_expert_weight(name, style, experts)
            continue
        module = modules[name]
        suffix = _suffix(name)
        if style == "moe_tp_experts":
            tpinfo.shard_experts(suffix)
        elif style == "replicated_with_grad_allreduce":
            tpinfo.reduce_grads(suffix)
        elif isinstance(module, nn.Embedding) and style in _EMBEDDING_STYLES:
            if not shardable_embedding(module):
                raise ValueError(f"tensor parallel: {name!r} ({type(module).__name__}) has style {style!r}, but its "
                                 "forward is not a plain (or scaled) embedding lookup; pass a TPInfo that leaves it "
                                 "replicated")
            tpinfo.shard_vocab(suffix)
        elif style in _LINEAR_STYLES and _is_linear(module):
            kind, options = _LINEAR_STYLES[style]
            spec = {suffix: options} if options else suffix
            (tpinfo.shard_col if kind == "col" else tpinfo.shard_row)(spec)
            parent = name.rpartition(".")[0]
            if kind == "col" and is_attention_name(parent):
                (gathered_attention if options.get("gather_output") else split_attention).add(parent)
        else:
            raise ValueError(f"tensor parallel: cannot honour transformers plan entry {key!r} -> {style!r} on "
                             f"{name!r} ({type(module).__name__}); atorch translates {sorted(_LINEAR_STYLES)} on "
                             f"linears, {list(_EMBEDDING_STYLES)} on embeddings, 'replicated_with_grad_allreduce' and "
                             "'moe_tp_experts'. Pass your own TPInfo ('tensor_parallel', {'tpinfo': ...})")

    # get_input_embeddings is a transformers PreTrainedModel method, unseen through nn.Module's type.
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]
    embedding_name = next((n for n, m in modules.items() if m is embedding), None) if embedding is not None else None
    embedding_sharded = embedding_name is not None and embedding_name in styled
    if embedding_name is not None and not embedding_sharded and shardable_embedding(embedding):
        tpinfo.shard_vocab(_unique_suffix(embedding_name, modules))
        embedding_sharded = True
    if head_name is not None and head is not None and _is_linear(head):
        tied = embedding is not None and head.weight is getattr(embedding, "weight", None)
        if embedding_sharded or not tied:
            tpinfo.shard_col(_unique_suffix(head_name, modules))

    head_suffix = _unique_suffix(head_name, modules) if head_name is not None else None
    if not tpinfo.experts and not tpinfo.row and not [k for k in tpinfo.col if k != head_suffix]:
        raise ValueError(f"tensor parallel: the transformers plan of {type(model).__name__} shards no layer of its "
                         f"transformer blocks (plan: {sorted(plan)}), so every block would be replicated on every "
                         "rank. Pass your own TPInfo ('tensor_parallel', {'tpinfo': ...}) or leave tensor "
                         "parallelism out for this model")
    for attention in sorted(split_attention):
        _cover_head_local_parameters(tpinfo, model, attention, modules, styled)
        tpinfo.parallel_drop(_suffix(attention))
        present = sorted(a for a in HEAD_ATTRS if _int_attr(modules[attention], a))
        if present:
            tpinfo.shrink({_suffix(attention): present})
    _add_dropouts(tpinfo, modules, split_attention, gathered_attention)
    return tpinfo


def _cover_head_local_parameters(tpinfo: TPInfo, model: nn.Module, attention: str,
                                 modules: Mapping[str, nn.Module], styled: Mapping[str, Tuple[str, str]]) -> None:
    """Parameters inside an attention module whose heads are split, which the plan does not mention.

    They act on this rank's heads only. A per-head norm shared by all heads (Phi's `q_layernorm`
    with `qk_layernorm=True`, weights of `head_dim`) is replicated and its gradients summed over
    the group, as the plans of Qwen3 and Gemma-3 say for their `q_norm`; left alone, each rank
    kept its own partial gradient and the copies drifted apart without an error. Anything else
    (Cohere's `q_norm` with `use_qk_norm=True` holds one weight row per head, [heads, head_dim])
    would need a split the plan does not describe: refused, naming the module, rather than a
    shape error in the first forward or silently wrong training.
    """
    module = modules[attention]
    head_dim = head_dim_of(module, getattr(model, "config", None))
    covered = [name for name in styled if name == attention or name.startswith(attention + ".")]
    if attention in covered:
        return
    shared, rest = head_local_parameters(module, attention, covered, head_dim)
    if rest:
        name, kind, params = rest[0]
        raise _uncovered(model, attention, name, kind, params, head_dim if name != attention else None)
    for name in shared:
        tpinfo.reduce_grads(_suffix(name))


def _uncovered(model: nn.Module, attention: str, name: str, kind: str, params: List[str],
               head_dim: Optional[int] = None) -> ValueError:
    per_head = f" (not one weight of head_dim={head_dim} shared by the heads)" if head_dim else ""
    return ValueError(f"tensor parallel: the transformers plan of {type(model).__name__} splits the heads of "
                      f"{attention!r}, but not {name!r} ({kind}, parameters {params}{per_head}), which acts on "
                      "them; atorch cannot tell how to split it. Leave tensor parallelism out for this model "
                      "(fsdp shards it) or pass your own TPInfo ('tensor_parallel', {'tpinfo': ...})")


def _check_expert_weight(name: str, style: str, experts: Set[str]) -> None:
    owner, _, weight = name.rpartition(".")
    if owner in experts and weight in EXPERT_WEIGHTS and style in _EXPERT_WEIGHT_STYLES[weight]:
        return  # split by the experts role of its module
    raise ValueError(f"tensor parallel: cannot honour style {style!r} on parameter {name!r}: atorch shards 3-D expert "
                     f"weights {list(EXPERT_WEIGHTS)} only as part of a 'moe_tp_experts' module")


def _is_linear(module: Any) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _int_attr(module: nn.Module, attr: str) -> bool:
    value = getattr(module, attr, None)
    return isinstance(value, int) and not isinstance(value, bool)


def _add_dropouts(tpinfo: TPInfo, modules: Mapping[str, nn.Module], split: Set[str], gathered: Set[str]) -> None:
    """Dropouts outside split attention modules draw from the stream the tensor group shares."""
    for attention in sorted(gathered - split):
        tpinfo.replic_drop(_suffix(attention))
    inside = [n for n in modules if any(n.startswith(a + ".") for a in split)]
    outside = [n for n, m in modules.items()
               if isinstance(m, nn.modules.dropout._DropoutNd) and n not in inside
               and not any(n.startswith(a + ".") for a in gathered)]
    suffixes: List[str] = []
    for name in outside:
        suffix = _suffix(name)
        clash = any(n == suffix or n.endswith("." + suffix) for n in inside)
        suffixes.append(name if clash else suffix)
    if suffixes:
        tpinfo.replic_drop(*suffixes)
