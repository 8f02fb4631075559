"""What to shard: `TPInfo` (module-name suffixes per role) and its resolution against one model.

A `TPInfo` lists module-name suffixes per role (column/row-parallel linear, vocabulary
embedding, experts, replicated parameters whose gradients are summed, replicated/parallel
dropout, attributes to divide, per-head inputs to slice). `resolve_tp_plan` matches it
against a model (on the meta device or real) and checks everything that can be checked
without a process group: every suffix matches, each match has the right type, and the
tensor size divides hidden and intermediate sizes, and heads and kv heads where the plan splits
attention's heads. It is pure: the
sharding itself is `atorch.tensor_parallel.shard`.

Usage::

    tpinfo = TPInfo()
    tpinfo.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc")
    tpinfo.shard_row("attn.c_proj", "mlp.c_proj")
    tpinfo.shard_vocab("wte")
    tpinfo.replic_drop("resid_dropout", "mlp.dropout", "drop")
    tpinfo.parallel_drop("attn")
    tpinfo.shrink({".attn": {"embed_dim", "split_size", "num_heads"}})
    plan = resolve_tp_plan(model, tpinfo, tp_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch import nn
from atorch.utils.tp_checks import check_tp_suffixes


COL, ROW, VOCAB, REPLIC_DROP, PARALLEL_DROP = "col", "row", "vocab", "replic_drop", "parallel_drop"
EXPERTS, GRAD_REDUCE = "experts", "grad_reduce"
_KINDS = (COL, ROW, VOCAB, EXPERTS, GRAD_REDUCE, REPLIC_DROP, PARALLEL_DROP)
# Roles that replace or re-class a module (the dropout roles only add hooks).
SHARDING_KINDS = (COL, ROW, VOCAB, EXPERTS)
# Layer options a TPInfo entry may carry, with their types.
_VALID_KWARGS: Dict[str, Dict[str, type]] = {
    COL: {"stride": int, "gather_output": bool},
    ROW: {"input_is_parallel": bool},
    VOCAB: {},
    EXPERTS: {},
    GRAD_REDUCE: {},
    REPLIC_DROP: {},
    PARALLEL_DROP: {},
}

SuffixSpec = Union[str, Mapping[str, Any]]
# The 3-D parameters of a mixture of experts' weight holder, in transformers' packed layout.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _normalize_suffix(suffix: str) -> str:
    if not isinstance(suffix, str) or not suffix.strip("."):
        raise ValueError(f"TPInfo suffix {suffix!r} must be a non-empty module-name suffix such as 'mlp.c_fc'")
    return suffix.strip(".")


@dataclass
class TPInfo:
    """Which modules of a model to split, by module-name suffix ('mlp.c_fc' matches 'h.0.mlp.c_fc').

    Each role maps a suffix to options of the layer that replaces the match:
    `col` -> ColumnParallelLinear (stride, gather_output), `row` -> RowParallelLinear
    (input_is_parallel), `vocab` -> VocabParallelEmbedding. `replic` modules run their forward
    with the dropout stream shared by the tensor group (they see replicated activations);
    `parallel` modules with a stream distinct per tensor rank (split activations, e.g. the
    attention module, whose attention-probability dropout acts on this rank's heads; in
    transformers 5 that dropout is functional inside the attention forward, so name the
    attention module, e.g. GPT-2's "attn": its `attn_dropout` module is no longer called).
    `experts` modules hold a mixture of experts' weights as 3-D tensors in transformers'
    packed layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]): every expert is split
    like a dense MLP (its intermediate dimension), the router stays replicated. `grad_reduce`
    modules keep replicated parameters that act on this rank's heads only (Qwen3's per-head
    q/k norms): their gradients are summed over the group.
    `shrink_attrs` names integer attributes divided by the tensor size on matching modules
    (head counts and widths that a module uses to reshape). `head_inputs` names keyword
    inputs of a module laid out [batch * heads, ...] over *all* heads (Bloom's ALiBi bias),
    sliced to this rank's heads. A dataclass, so strategies that hold one round-trip
    through JSON.
    """

    col: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    row: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    vocab: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    experts: Tuple[str, ...] = ()
    grad_reduce: Tuple[str, ...] = ()
    replic: Tuple[str, ...] = ()
    parallel: Tuple[str, ...] = ()
    shrink_attrs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    head_inputs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

    def _add(self, table: Dict[str, Dict[str, Any]], kind: str, specs: Iterable[SuffixSpec]) -> "TPInfo":
        for spec in specs:
            items = spec.items() if isinstance(spec, Mapping) else [(spec, {})]
            for suffix, options in items:
                options = dict(options or {})
                _check_options(kind, suffix, options)
                table[_normalize_suffix(suffix)] = options
        return self

    def shard_col(self, *specs: SuffixSpec) -> "TPInfo":
        """Column-parallel linears: a suffix, or {suffix: {"stride": 3, "gather_output": False}}."""
        return self._add(self.col, COL, specs)

    def shard_row(self, *specs: SuffixSpec) -> "TPInfo":
        """Row-parallel linears: a suffix, or {suffix: {"input_is_parallel": True}}."""
        return self._add(self.row, ROW, specs)

    def shard_vocab(self, *specs: SuffixSpec) -> "TPInfo":
        """Vocabulary-parallel embeddings (the vocabulary is padded to a multiple of the tensor size)."""
        return self._add(self.vocab, VOCAB, specs)

    def shard_experts(self, *suffixes: str) -> "TPInfo":
        """Mixture-of-experts weight holders (3-D `gate_up_proj` / `down_proj`): each expert split like an MLP."""
        self.experts = _extend(self.experts, suffixes)
        return self

    def reduce_grads(self, *suffixes: str) -> "TPInfo":
        """Modules with replicated parameters that see split activations: their gradients are summed over the group."""
        self.grad_reduce = _extend(self.grad_reduce, suffixes)
        return self

    def split_head_inputs(self, spec: Mapping[str, Iterable[str]]) -> "TPInfo":
        """{suffix: {keyword, ...}}: keyword inputs laid out [batch * all heads, ...], sliced to this rank's heads."""
        for suffix, names in spec.items():
            if isinstance(names, str):
                raise ValueError(f"TPInfo.split_head_inputs[{suffix!r}] = {names!r} must be a collection of keyword "
                                 f"names, e.g. {{{names!r}}}")
            key = _normalize_suffix(suffix)
            self.head_inputs[key] = tuple(sorted(set(self.head_inputs.get(key, ())) | set(names)))
        return self

    def replic_drop(self, *suffixes: str) -> "TPInfo":
        """Modules whose random draws must be identical across the tensor group."""
        self.replic = _extend(self.replic, suffixes)
        return self

    def parallel_drop(self, *suffixes: str) -> "TPInfo":
        """Modules whose random draws must differ across the tensor group."""
        self.parallel = _extend(self.parallel, suffixes)
        return self

    def shrink(self, spec: Mapping[str, Iterable[str]]) -> "TPInfo":
        """{suffix: {attribute, ...}}: integer attributes divided by the tensor size on matching modules."""
        for suffix, attrs in spec.items():
            if isinstance(attrs, str):
                raise ValueError(f"TPInfo.shrink[{suffix!r}] = {attrs!r} must be a collection of attribute names, "
                                 f"e.g. {{{attrs!r}}}")
            key = _normalize_suffix(suffix)
            self.shrink_attrs[key] = tuple(sorted(set(self.shrink_attrs.get(key, ())) | set(attrs)))
        return self

    def entries(self) -> List[Tuple[str, str, Dict[str, Any]]]:
        """(kind, suffix, options) for every role, in a fixed order."""
        out: List[Tuple[str, str, Dict[str, Any]]] = []
        for kind, table in ((COL, self.col), (ROW, self.row), (VOCAB, self.vocab)):
            out.extend((kind, s, dict(o)) for s, o in table.items())
        out.extend((EXPERTS, s, {}) for s in self.experts)
        out.extend((GRAD_REDUCE, s, {}) for s in self.grad_reduce)
        out.extend((REPLIC_DROP, s, {}) for s in self.replic)
        out.extend((PARALLEL_DROP, s, {}) for s in self.parallel)
        return out


def _extend(existing: Tuple[str, ...], suffixes: Iterable[str]) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(existing + tuple(_normalize_suffix(s) for s in suffixes)))


def _check_options(kind: str, suffix: str, options: Dict[str, Any]) -> None:
    valid = _VALID_KWARGS[kind]
    for key, value in options.items():
        if key not in valid:
            raise ValueError(f"TPInfo {kind} entry {suffix!r}: unknown option {key!r}; valid options are "
                             f"{sorted(valid)}")
        expected = valid[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"TPInfo {kind} entry {suffix!r}: option {key}={value!r} must be {expected.__name__}")
    if kind == COL and options.get("stride", 1) < 1:
        raise ValueError(f"TPInfo col entry {suffix!r}: stride={options['stride']} must be >= 1")


# -- plan: pure matching and checks ------------------------------------------------

@dataclass(frozen=True)
class TPAction:
    """What to do with one module: its role and the options of its tensor-parallel layer."""

    kind: str
    suffix: str
    options: Tuple[Tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


@dataclass
class TPPlan:
    """A TPInfo matched against one model for one tensor size: actions and new attribute values by module name."""

    tp_size: int
    actions: Dict[str, TPAction]
    shrink: Dict[str, Dict[str, int]]
    output_embedding: Optional[str] = None     # qualified name of the model's LM head, if any
    vocab_parallel_loss: bool = False          # the LM head keeps its output split: use the parallel loss
    vocab_size: Optional[int] = None
    gather_logits: bool = False                # the model's output carries full logits, gathered after the loss
    # module name -> (keyword inputs laid out [batch * heads, ...], the model's number of heads)
    head_inputs: Dict[str, Tuple[Tuple[str, ...], int]] = field(default_factory=dict)


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _linear_sizes(module: nn.Module) -> Tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return cast(int, module.nx), cast(int, module.nf)  # transformers' Conv1D: input and output sizes


def _name_hint(names: Iterable[str]) -> str:
    tails = sorted({n.split(".")[-1] for n in names if n})
    return f"module names end in {tails[:16]}{' ...' if len(tails) > 16 else ''}"


def resolve_tp_plan(model: nn.Module, tpinfo: TPInfo, tp_size: int, world_size: Optional[int] = None,
                    gather_logits: Optional[bool] = None) -> TPPlan:
    """Match `tpinfo` against `model` (real or meta) for tensor size `tp_size`; pure, raises ValueError.

    `gather_logits` applies to a column-parallel LM head: True (what `auto_accelerate` does)
    keeps the head's output split, computes the model's own loss from that split with the
    vocabulary-parallel cross entropy, and then gathers the logits the model returns (they
    equal the unsharded model's); False keeps the split everywhere (`output.logits` is this
    rank's vocabulary slice, for `vocab_parallel_cross_entropy`); None keeps what the TPInfo
    says (a head with `gather_output=True` gathers before the loss).
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor parallel size {tp_size!r} must be an integer >= 1")
    if world_size is not None and (tp_size > world_size or world_size % tp_size != 0):
        raise ValueError(f"tensor parallel size {tp_size} must divide the world size {world_size} (and so be at "
                         f"most {world_size})")
    if not isinstance(tpinfo, TPInfo):
        raise ValueError(f"tpinfo must be a TPInfo, got {type(tpinfo).__name__}")
    # A suffix matching modules of different shapes (GPT-2's bare "c_proj") would fail at the
    # first forward with a shape error: refused here, naming the modules.
    check_tp_suffixes(model, tpinfo)
    modules = dict(model.named_modules())
    model_name = type(model).__name__
    head = output_embedding(model)
    head_name = next((n for n, m in modules.items() if m is head), None) if head is not None else None

    actions: Dict[str, TPAction] = {}
    for kind, suffix, options in tpinfo.entries():
        matched = [n for n in modules if n and _matches(n, suffix)]
        if not matched:
            raise ValueError(f"TPInfo {kind} suffix {suffix!r} matches no module of {model_name}; "
                             f"{_name_hint(modules)}")
        for name in matched:
            opts = dict(options)
            if kind == COL and name == head_name and opts.get("stride", 1) == 1:
                # The LM head's vocabulary is padded like the embedding's (their weights may be tied).
                opts["pad_vocab"] = True
            action = TPAction(kind, suffix, tuple(sorted(opts.items())))
            previous = actions.get(name)
            if previous is not None and previous != action:
                raise ValueError(f"module {name!r} is matched by TPInfo {previous.kind} {previous.suffix!r} and by "
                                 f"{kind} {suffix!r}; give each module one role")
            _check_module_type(name, modules[name], action)
            actions[name] = action

    vocab_parallel_loss = gathered = False
    if head_name in actions and actions[head_name].kind == COL:
        head_action = actions[head_name]
        if gather_logits is not None:
            options = dict(head_action.options)
            options["gather_output"] = False
            actions[head_name] = TPAction(COL, head_action.suffix, tuple(sorted(options.items())))
        vocab_parallel_loss = tp_size > 1 and not actions[head_name].option("gather_output", False)
        gathered = bool(gather_logits) and tp_size > 1
    # Config sizes first: "num_key_value_heads=2" says more than the width of one projection.
    if any(a.kind in (COL, ROW, EXPERTS) for a in actions.values()):
        _check_config_divisibility(model, actions, tp_size)
    for name, action in list(actions.items()):
        _check_module_sizes(name, modules[name], action, tp_size)
    _cover_split_attention(model, modules, actions)

    shrink: Dict[str, Dict[str, int]] = {}
    for suffix, attrs in tpinfo.shrink_attrs.items():
        matched = [n for n in modules if n and _matches(n, suffix)]
        if not matched:
            raise ValueError(f"TPInfo shrink suffix {suffix!r} matches no module of {model_name}; "
                             f"{_name_hint(modules)}")
        for name in matched:
            shrink[name] = _shrunk_values(name, modules[name], attrs, tp_size)
    head_inputs: Dict[str, Tuple[Tuple[str, ...], int]] = {}
    for suffix, names in tpinfo.head_inputs.items():
        matched = [n for n in modules if n and _matches(n, suffix)]
        if not matched:
            raise ValueError(f"TPInfo split_head_inputs suffix {suffix!r} matches no module of {model_name}; "
                             f"{_name_hint(modules)}")
        heads = config_sizes(getattr(model, "config", None)).get("num_attention_heads")
        if heads is None or heads % tp_size != 0:
            raise ValueError(f"TPInfo split_head_inputs {suffix!r}: the model config's num_attention_heads={heads} "
                             f"must be known and divisible by tensor size {tp_size}")
        head_inputs.update({name: (tuple(names), heads) for name in matched})
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return TPPlan(tp_size, actions, shrink, head_name, vocab_parallel_loss, vocab_size, gathered, head_inputs)


def is_attention_name(name: str) -> bool:
    """A module named like an attention module (`attn`, `self_attention`, ...), by its last name component."""
    last = name.rpartition(".")[2].lower()
    return "attn" in last or "attention" in last


def head_dim_of(attention: nn.Module, config: Any) -> Optional[int]:
    """The width of one head: the module's `head_dim`, else the config's (given, or hidden / heads)."""
    for source in (attention, config):
        value = getattr(source, "head_dim", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def head_local_parameters(attention: nn.Module, name: str, covered: Iterable[str], head_dim: Optional[int]
                          ) -> Tuple[List[str], List[Tuple[str, str, List[str]]]]:
    """Parameters inside `attention` (named `name`, its heads split) that no role in `covered` accounts for.

    They act on this rank's heads only. Returns the children that are one norm shared by all heads
    (their own parameters only, each 1-D of `head_dim`: Phi's `q_layernorm`), whose gradients must
    be summed over the group, and (name, class, parameters) of everything else, which would need a
    split nobody described: one weight row per head (Cohere's `q_norm`, [heads, head_dim]) or one
    norm module per head in a list (StableLM's `q_layernorm.norms` with `qk_layernorm=True`), which
    each rank would zip with its own heads starting from the first norm.
    """
    prefixes = [c + "." for c in covered]

    def is_covered(full: str) -> bool:
        return any(full.startswith(p) for p in prefixes)

    shared: List[str] = []
    rest: List[Tuple[str, str, List[str]]] = []
    own = [f"{n} {tuple(p.shape)}" for n, p in attention.named_parameters(recurse=False)]
    if own:
        rest.append((name, type(attention).__name__, own))
    for child_name, child in attention.named_children():
        full = f"{name}.{child_name}"
        params = [(n, p) for n, p in child.named_parameters() if not is_covered(f"{full}.{n}")]
        if not params:
            continue
        if head_dim and all("." not in n and p.dim() == 1 and p.numel() == head_dim for n, p in params):
            shared.append(full)
        else:
            rest.append((full, type(child).__name__, [f"{n} {tuple(p.shape)}" for n, p in params]))
    return shared, rest


def _cover_split_attention(model: nn.Module, modules: Mapping[str, nn.Module], actions: Dict[str, TPAction]) -> None:
    """Sum the gradients of shared per-head norms inside attention modules whose heads the TPInfo splits
    (column-parallel projections kept split), and refuse any other parameter there that no role covers."""
    split: Dict[str, str] = {}
    for name, action in actions.items():
        parent = name.rpartition(".")[0]
        if action.kind == COL and not action.option("gather_output", False) and parent and is_attention_name(parent):
            split.setdefault(parent, name)
    config = getattr(model, "config", None)
    for attention, projection in split.items():
        covered = [n for n, a in actions.items() if a.kind in (COL, ROW, VOCAB, EXPERTS, GRAD_REDUCE)
                   and n.startswith(attention + ".")]
        head_dim = head_dim_of(modules[attention], config)
        shared, rest = head_local_parameters(modules[attention], attention, covered, head_dim)
        if rest:
            name, kind, params = rest[0]
            per_head = f" (not one weight of head_dim={head_dim} shared by the heads)" if head_dim else ""
            shown = params[:4] + (["..."] if len(params) > 4 else [])
            raise ValueError(f"tensor parallel: the TPInfo splits the heads of {attention!r} (column-parallel "
                             f"{projection!r}), but not {name!r} ({kind}, parameters {shown}{per_head}), which acts "
                             "on them; atorch cannot tell how to split it. Leave the attention whole in the TPInfo "
                             "(split only the MLP projections), or leave tensor parallelism out for this model "
                             "(fsdp shards it)")
        for name in shared:
            actions.setdefault(name, TPAction(GRAD_REDUCE, name))


def whole_parameter_count(model: nn.Module, plan: TPPlan) -> int:
    """Elements of `model`'s parameters that `plan` leaves whole on every tensor rank (each counted once).

    Split: the weights of column- and row-parallel linears, a column-parallel bias (a row-parallel
    one is added after the reduction, so it stays whole), vocabulary embeddings, and the experts'
    `gate_up_proj` / `down_proj`. Everything else (norms, routers, a shared expert a plan leaves
    out, learned position embeddings) is replicated: what the memory model counts once per rank.
    """
    modules = dict(model.named_modules())
    split = set()
    for name, action in plan.actions.items():
        module = modules.get(name)
        if module is None:
            continue
        if action.kind in (COL, VOCAB):
            split |= {id(p) for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None}
        elif action.kind == ROW:
            split.add(id(module.weight))
        elif action.kind == EXPERTS:
            split |= {id(getattr(module, k)) for k in EXPERT_WEIGHTS}
    return sum(p.numel() for p in model.parameters() if id(p) not in split)


def output_embedding(model: nn.Module) -> Optional[nn.Module]:
    """The model's LM head (`get_output_embeddings()`), or None for a model without one."""
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None:
        return None
    try:
        return getter()
    except (NotImplementedError, AttributeError):
        return None


def _check_module_type(name: str, module: nn.Module, action: TPAction) -> None:
    cls = type(module).__name__
    if action.kind in (COL, ROW) and not (isinstance(module, nn.Linear) or _is_conv1d(module)):
        raise ValueError(f"TPInfo {action.kind} suffix {action.suffix!r} matches {name!r}, a {cls}; "
                         "column/row-parallel sharding applies to nn.Linear or transformers' Conv1D only")
    if action.kind == EXPERTS:
        weights = {k: getattr(module, k, None) for k in EXPERT_WEIGHTS}
        if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights.values()):
            found = {k: tuple(w.shape) if w is not None and hasattr(w, "shape") else None for k, w in weights.items()}
            raise ValueError(f"TPInfo experts suffix {action.suffix!r} matches {name!r}, a {cls} whose expert weights "
                             f"are {found}; expert sharding needs 3-D parameters gate_up_proj [experts, 2 x "
                             "intermediate, hidden] and down_proj [experts, hidden, intermediate] (transformers' "
                             "packed layout)")
    if action.kind == VOCAB and not isinstance(module, nn.Embedding):
        raise ValueError(f"TPInfo vocab suffix {action.suffix!r} matches {name!r}, a {cls}; vocabulary-parallel "
                         "sharding applies to nn.Embedding only")


def _check_module_sizes(name: str, module: nn.Module, action: TPAction, tp_size: int) -> None:
    if action.kind == EXPERTS:
        # Both are 3-D parameters (checked by _check_module_type).
        down_proj = cast(torch.Tensor, module.down_proj)
        gate_up_proj = cast(torch.Tensor, module.gate_up_proj)
        intermediate = down_proj.shape[2]
        if intermediate % tp_size != 0 or gate_up_proj.shape[1] != 2 * intermediate:
            raise ValueError(f"experts {name!r} ({type(module).__name__}): intermediate size {intermediate} "
                             f"(gate_up_proj {tuple(gate_up_proj.shape)}) must be divisible by tensor size {tp_size}")
        return
    if action.kind not in (COL, ROW):
        return  # embeddings and the LM head are padded to a multiple of the tensor size
    cls = type(module).__name__
    in_f, out_f = _linear_sizes(module)
    if action.kind == ROW:
        if in_f % tp_size != 0:
            raise ValueError(f"row-parallel {name!r} ({cls}) has {in_f} input features, not divisible by tensor "
                             f"size {tp_size}")
        return
    stride = action.option("stride", 1)
    if not action.option("pad_vocab", False) and out_f % (tp_size * stride) != 0:
        raise ValueError(f"column-parallel {name!r} ({cls}) has {out_f} output features, not divisible by "
                         f"tensor size {tp_size} x stride {stride} = {tp_size * stride}")


def config_sizes(config: Any) -> Dict[str, int]:
    """Head counts and widths of a model config that a tensor size must divide, under their Hugging Face
    names (GPT-2's `n_inner` and Falcon's `num_kv_heads` included); sizes the config does not set are left
    out."""
    sizes: Dict[str, int] = {}
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                "moe_intermediate_size"):
        value = getattr(config, key, None)
        if key == "intermediate_size" and value is None:
            value = getattr(config, "n_inner", None)
        falcon_kv = getattr(config, "num_kv_heads", None)
        if key == "num_key_value_heads" and value is None and isinstance(falcon_kv, int):
            # Falcon, as its attention reads it: multi-query without the new architecture has one kv head.
            multi_query = getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture",
                                                                                False)
            key, value = "num_kv_heads", 1 if multi_query else falcon_kv
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            sizes[key] = value
    return sizes


def _check_config_divisibility(model: nn.Module, actions: Dict[str, TPAction], tp_size: int) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    sharded = [n for n, a in actions.items() if a.kind in (COL, ROW, EXPERTS)]
    # Head counts matter only where attention's projections split the heads over the ranks (a column
    # split that keeps its output split, a row split of split input): a plan that leaves attention
    # whole (DeepSeek-V3's MLA, GraniteMoE's experts-only plan) or gathers the projections' outputs
    # (OLMo-3's) runs every head on every rank.
    attention = [n for n in sharded if any(is_attention_name(part) for part in n.split(".")[:-1]) and (
        (actions[n].kind == COL and not actions[n].option("gather_output", False))
        or (actions[n].kind == ROW and actions[n].option("input_is_parallel", True)))]
    mlp = [n for n in sharded if "mlp" in n] or sharded
    for key, value in config_sizes(config).items():
        if value % tp_size == 0 or ("heads" in key and not attention):
            continue
        where = attention if "heads" in key else mlp if "intermediate_size" in key else sharded
        # Name the projection whose heads are counted: the keys' for key/value heads, the queries' else.
        kv_heads = key in ("num_key_value_heads", "num_kv_heads")
        hints = _KV_PROJECTIONS if kv_heads else _Q_PROJECTIONS if "heads" in key else ()
        module = next((n for n in where if any(h in n.rsplit(".", 1)[-1] for h in hints)), where[0])
        sizes = [d for d in range(2, value + 1) if value % d == 0]
        fix = (f"use a tensor size that divides {value} ({', '.join(map(str, sizes[:6]))}"
               f"{', ...' if len(sizes) > 6 else ''})" if sizes else
               f"{key}={value} cannot be split across ranks (atorch does not replicate heads), so tensor "
               "parallelism does not apply to this model; use data parallelism, FSDP or pipeline stages instead")
        raise ValueError(f"tensor parallel size {tp_size} does not divide {key}={value} of "
                         f"{type(config).__name__}: sharding {module!r} would split it unevenly; {fix}")


# Substrings of the projection names whose output counts the key/value heads, or the query heads
# (fused projections count both): the module an indivisible head count is reported against.
_KV_PROJECTIONS = ("k_proj", "key", "kv", "qkv", "c_attn", "query_key_value")
_Q_PROJECTIONS = ("q_proj", "query", "qkv", "c_attn", "query_key_value")


def _shrunk_values(name: str, module: nn.Module, attrs: Iterable[str], tp_size: int) -> Dict[str, int]:
    values = {}
    for attr in attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"TPInfo shrink: {name!r} ({type(module).__name__}) has no integer attribute {attr!r} "
                             f"(found {value!r})")
        if value % tp_size != 0:
            raise ValueError(f"TPInfo shrink: {name}.{attr}={value} is not divisible by tensor size {tp_size}")
        values[attr] = value // tp_size
    return values
