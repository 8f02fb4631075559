"""Tensor parallelism for unmodified models: say which modules to split, by name suffix, and shard.

A `TPInfo` lists module-name suffixes per role (column/row-parallel linear, vocabulary
embedding, replicated/parallel dropout, attributes to divide). `resolve_tp_plan` matches it
against a model (on the meta device or real) and checks everything that can be checked
without a process group: every suffix matches, each match has the right type, and the
tensor size divides heads, kv heads, hidden and intermediate sizes. `tp_manual_shard_custom_fn`
shards a real model in place, or marks a meta model so `materialize_tp_module` builds only
this rank's slices. `gather_tp_state_dict` rebuilds the full Hugging Face state dict.

Usage::

    with record_module_init():
        model = GPT2LMHeadModel(config)            # meta, construction recorded
    tpinfo = TPInfo()
    tpinfo.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc")
    tpinfo.shard_row("attn.c_proj", "mlp.c_proj")
    tpinfo.shard_vocab("wte")
    tpinfo.replic_drop("resid_dropout", "mlp.dropout", "drop")
    tpinfo.parallel_drop("attn")
    tpinfo.shrink({".attn": {"embed_dim", "split_size", "num_heads"}})
    tp_manual_shard_custom_fn(model, tpinfo)       # marks
    model = materialize_tp_module(model, base_seed=0)   # this rank's shards, on the CPU
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from atorch.modules.distributed_modules.cross_entropy import VocabParallelCausalLMLoss
from atorch.modules.distributed_modules.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallelModule,
    VocabParallelEmbedding,
    pad_to_multiple,
    shard_tensor,
    unshard_tensors,
)
from atorch.modules.distributed_modules.mappings import Group, gather_from_group, group_size
from atorch.modules.distributed_modules.randomizer import MultiDimParallelRandomizer, fork_module_rng
from atorch.utils.meta_model_utils import is_meta_module, materialize_module
from atorch.utils.module_utils import find_transformer_block_classes

COL, ROW, VOCAB, REPLIC_DROP, PARALLEL_DROP = "col", "row", "vocab", "replic_drop", "parallel_drop"
_KINDS = (COL, ROW, VOCAB, REPLIC_DROP, PARALLEL_DROP)
# Layer options a TPInfo entry may carry, with their types.
_VALID_KWARGS: Dict[str, Dict[str, type]] = {
    COL: {"stride": int, "gather_output": bool},
    ROW: {"input_is_parallel": bool},
    VOCAB: {},
    REPLIC_DROP: {},
    PARALLEL_DROP: {},
}
_ACTION_ATTR = "_atorch_tp_action"
_SHRINK_ATTR = "_atorch_tp_shrink"
_PLAN_ATTR = "_atorch_tp_plan"

SuffixSpec = Union[str, Mapping[str, Any]]


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
    `shrink_attrs` names integer attributes divided by the tensor size on matching modules
    (head counts and widths that a module uses to reshape). A dataclass, so strategies that
    hold one round-trip through JSON.
    """

    col: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    row: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    vocab: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    replic: Tuple[str, ...] = ()
    parallel: Tuple[str, ...] = ()
    shrink_attrs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

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

    def replic_drop(self, *suffixes: str) -> "TPInfo":
        """Modules whose random draws must be identical across the tensor group."""
        self.replic = tuple(dict.fromkeys(self.replic + tuple(_normalize_suffix(s) for s in suffixes)))
        return self

    def parallel_drop(self, *suffixes: str) -> "TPInfo":
        """Modules whose random draws must differ across the tensor group."""
        self.parallel = tuple(dict.fromkeys(self.parallel + tuple(_normalize_suffix(s) for s in suffixes)))
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
        out.extend((REPLIC_DROP, s, {}) for s in self.replic)
        out.extend((PARALLEL_DROP, s, {}) for s in self.parallel)
        return out


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


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _linear_sizes(module: nn.Module) -> Tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def _name_hint(names: Iterable[str]) -> str:
    tails = sorted({n.split(".")[-1] for n in names if n})
    return f"module names end in {tails[:16]}{' ...' if len(tails) > 16 else ''}"


def resolve_tp_plan(model: nn.Module, tpinfo: TPInfo, tp_size: int, world_size: Optional[int] = None,
                    gather_logits: Optional[bool] = None) -> TPPlan:
    """Match `tpinfo` against `model` (real or meta) for tensor size `tp_size`; pure, raises ValueError.

    `gather_logits=True` makes the LM head gather its output (full logits for a user loss),
    False keeps it split (vocabulary-parallel loss), None keeps what the TPInfo says.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor parallel size {tp_size!r} must be an integer >= 1")
    if world_size is not None and (tp_size > world_size or world_size % tp_size != 0):
        raise ValueError(f"tensor parallel size {tp_size} must divide the world size {world_size} (and so be at "
                         f"most {world_size})")
    if not isinstance(tpinfo, TPInfo):
        raise ValueError(f"tpinfo must be a TPInfo, got {type(tpinfo).__name__}")
    modules = dict(model.named_modules())
    model_name = type(model).__name__
    head = _output_embedding(model)
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

    vocab_parallel_loss = False
    if head_name in actions and actions[head_name].kind == COL:
        head_action = actions[head_name]
        if gather_logits is not None:
            options = dict(head_action.options)
            options["gather_output"] = gather_logits
            actions[head_name] = TPAction(COL, head_action.suffix, tuple(sorted(options.items())))
        vocab_parallel_loss = tp_size > 1 and not actions[head_name].option("gather_output", False)
    # Config sizes first: "num_key_value_heads=2" says more than the width of one projection.
    if any(a.kind in (COL, ROW) for a in actions.values()):
        _check_config_divisibility(model, actions, tp_size)
    for name, action in actions.items():
        _check_module_sizes(name, modules[name], action, tp_size)

    shrink: Dict[str, Dict[str, int]] = {}
    for suffix, attrs in tpinfo.shrink_attrs.items():
        matched = [n for n in modules if n and _matches(n, suffix)]
        if not matched:
            raise ValueError(f"TPInfo shrink suffix {suffix!r} matches no module of {model_name}; "
                             f"{_name_hint(modules)}")
        for name in matched:
            shrink[name] = _shrunk_values(name, modules[name], attrs, tp_size)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return TPPlan(tp_size, actions, shrink, head_name, vocab_parallel_loss, vocab_size)


def _output_embedding(model: nn.Module) -> Optional[nn.Module]:
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
    if action.kind == VOCAB and not isinstance(module, nn.Embedding):
        raise ValueError(f"TPInfo vocab suffix {action.suffix!r} matches {name!r}, a {cls}; vocabulary-parallel "
                         "sharding applies to nn.Embedding only")


def _check_module_sizes(name: str, module: nn.Module, action: TPAction, tp_size: int) -> None:
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


def _config_sizes(config: Any) -> Dict[str, int]:
    """Head counts and widths of a model config, under their Hugging Face names (GPT-2 aliases included)."""
    sizes: Dict[str, int] = {}
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
        value = getattr(config, key, None)
        if key == "intermediate_size" and value is None:
            value = getattr(config, "n_inner", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            sizes[key] = value
    return sizes


def _check_config_divisibility(model: nn.Module, actions: Dict[str, TPAction], tp_size: int) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    sharded = [n for n, a in actions.items() if a.kind in (COL, ROW)]
    attention = [n for n in sharded if "attn" in n or "attention" in n] or sharded
    mlp = [n for n in sharded if "mlp" in n] or sharded
    for key, value in _config_sizes(config).items():
        if value % tp_size == 0:
            continue
        where = attention if "heads" in key else mlp if key == "intermediate_size" else sharded
        raise ValueError(f"tensor parallel size {tp_size} does not divide {key}={value} of "
                         f"{type(config).__name__}: sharding {where[0]!r} would split it unevenly; use a tensor size "
                         f"that divides {value}")


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


# -- sharding ---------------------------------------------------------------------

# (full parameter, its shard, how it was cut), by id of the full parameter.
_Shared = Tuple[torch.Tensor, nn.Parameter, ShardSpec]


def _default_group() -> Group:
    from atorch.distributed import is_parallel_group_created, parallel_layout, parallel_group

    if is_parallel_group_created() and "tensor" in parallel_layout().names:
        return parallel_group("tensor")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("no 'tensor' parallel group: call atorch.distributed.create_parallel_group(([('tensor', T), "
                         "...], None)) first, or pass group=")
    return None


def tp_manual_shard_custom_fn(model: nn.Module, tpinfo: TPInfo, group: Group = None,
                              randomizer: Optional[MultiDimParallelRandomizer] = None,
                              gather_logits: Optional[bool] = None) -> nn.Module:
    """Shard `model` over the tensor group as `tpinfo` says; a meta model is only marked.

    A real model is sharded in place (its matched modules are replaced by tensor-parallel
    layers holding this rank's slices; the returned module is `model` unless `model` itself
    was matched). It must hold the same weights on every rank of the group. A meta model
    (built under `record_module_init`) gets the plan attached to its modules and is
    returned unchanged; `materialize_tp_module` then builds only the slices (and takes the
    randomizer). `group` defaults to atorch's "tensor" group; `randomizer` (for the dropout
    roles) to the process default, looked up at forward time. All checks run before
    anything changes.
    """
    if group is None:
        group = _default_group()
    plan = resolve_tp_plan(model, tpinfo, group_size(group), gather_logits=gather_logits)
    if is_meta_module(model):
        _mark(model, plan)
        return model
    model = _apply_plan(model, "", plan.actions, plan.shrink, group, randomizer, {})
    _finish_root(model, plan, group)
    return model


def _mark(model: nn.Module, plan: TPPlan) -> None:
    for name, module in model.named_modules():
        module.__dict__.pop(_ACTION_ATTR, None)
        module.__dict__.pop(_SHRINK_ATTR, None)
        if name in plan.actions:
            module.__dict__[_ACTION_ATTR] = plan.actions[name]
        if name in plan.shrink:
            module.__dict__[_SHRINK_ATTR] = plan.shrink[name]
    model.__dict__[_PLAN_ATTR] = plan


def tp_plan_of(model: nn.Module) -> Optional[TPPlan]:
    """The plan attached by `tp_manual_shard_custom_fn` (on a marked meta model or a sharded model)."""
    return model.__dict__.get(_PLAN_ATTR)


def _marks(meta: nn.Module) -> Tuple[Dict[str, TPAction], Dict[str, Dict[str, int]]]:
    actions, shrink = {}, {}
    for name, module in meta.named_modules():
        if _ACTION_ATTR in module.__dict__:
            actions[name] = module.__dict__[_ACTION_ATTR]
        if _SHRINK_ATTR in module.__dict__:
            shrink[name] = module.__dict__[_SHRINK_ATTR]
    return actions, shrink


def _apply_plan(root: nn.Module, prefix: str, actions: Mapping[str, TPAction], shrink: Mapping[str, Dict[str, int]],
                group: Group, randomizer: Optional[MultiDimParallelRandomizer],
                shared: Dict[int, _Shared]) -> nn.Module:
    """Replace/annotate the modules of `root` named in `actions` (names relative to `root`)."""
    tp_size = group_size(group)
    for name, values in shrink.items():
        module = root.get_submodule(name) if name else root
        for attr, value in values.items():
            setattr(module, attr, value)
    replaced_root: Optional[nn.Module] = None
    for name, action in actions.items():
        module = root.get_submodule(name) if name else root
        if action.kind in (REPLIC_DROP, PARALLEL_DROP):
            fork_module_rng(module, randomizer, "tensor", replicated=action.kind == REPLIC_DROP)
            continue
        new = _tp_layer(module, action, group, tp_size)
        _share_tied(module, new, shared, f"{prefix}.{name}".strip("."))
        if name:
            parent_name, _, child = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            parent._modules[child] = new
        else:
            replaced_root = new
    return replaced_root if replaced_root is not None else root


def _tp_layer(module: nn.Module, action: TPAction, group: Group, tp_size: int) -> nn.Module:
    if action.kind == COL:
        _, out_f = _linear_sizes(module)
        padded = pad_to_multiple(out_f, tp_size) if action.option("pad_vocab", False) else None
        return ColumnParallelLinear.from_full(module, group, gather_output=action.option("gather_output", False),
                                              stride=action.option("stride", 1), padded_out_features=padded)
    if action.kind == ROW:
        return RowParallelLinear.from_full(module, group, input_is_parallel=action.option("input_is_parallel", True))
    return VocabParallelEmbedding.from_full(module, group)


def _share_tied(full: nn.Module, layer: TensorParallelModule, shared: Dict[int, _Shared], name: str) -> None:
    """Keep weights tied: a full parameter sharded twice (embedding and LM head) becomes one shard."""
    for pname, spec in layer.shard_specs().items():
        original = getattr(full, pname)
        entry = shared.get(id(original))
        if entry is None:
            # Holding `original` keeps its id from being reused by a later tensor of this call.
            shared[id(original)] = (original, getattr(layer, pname), spec)
            continue
        _, existing, existing_spec = entry
        if existing_spec != spec:
            raise ValueError(f"{name}.{pname} is tied to another sharded parameter but would be cut differently "
                             f"({spec} vs {existing_spec}); shard both with the same role")
        setattr(layer, pname, existing)


def _finish_root(model: nn.Module, plan: TPPlan, group: Group) -> None:
    if plan.vocab_parallel_loss and hasattr(model, "loss_function"):
        model.loss_function = VocabParallelCausalLMLoss(group, plan.vocab_size)
    model.__dict__[_PLAN_ATTR] = plan


def materialize_tp_module(module: nn.Module, base_seed: int, device: Optional[torch.device] = None,
                          per_block: bool = False, group: Group = None,
                          randomizer: Optional[MultiDimParallelRandomizer] = None,
                          block_classes: Optional[Tuple[type, ...]] = None,
                          init_fn: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """Build a marked meta module (the whole model or a sub-module, e.g. a pipeline stage) as this rank's shards.

    `per_block=False`: the module's recorded construction is replayed under `base_seed` on
    the CPU (one full copy per rank while building), so a whole model gets the weights of
    `torch.manual_seed(base_seed); Model(config)`, sliced for this rank. (A sub-module built
    alone gets `cls(*args)` under `base_seed`, not its slice of the whole model's stream.)
    `per_block=True`: one block at full size at a time, each from its own seed
    (`meta_model_utils.unit_seed`), so the full weights are the same for every tensor size
    and for any split into stages; `block_classes` defaults to the model's transformer
    blocks and `init_fn` to its Hugging Face `_init_weights` (pass the root model's for a
    sub-module). Unmarked parts are built too; `randomizer` (default: one seeded with
    `base_seed`) drives the dropout roles. Returns the new module; the meta one is unchanged.
    """
    if group is None:
        group = _default_group()
    if randomizer is None:
        randomizer = MultiDimParallelRandomizer(base_seed)
    plan = tp_plan_of(module)

    def shard(prefix: str, real: nn.Module, meta: nn.Module) -> nn.Module:
        # Ties inside this piece are kept here; ties across per-block pieces by materialize_module.
        actions, shrink = _marks(meta)
        return _apply_plan(real, prefix, actions, shrink, group, randomizer, {})

    if block_classes is None:
        block_classes = tuple(find_transformer_block_classes(module)) if per_block else ()
    real = materialize_module(module, base_seed, device=device, transform=shard, per_block=per_block,
                              block_classes=block_classes, init_fn=init_fn)
    if plan is not None:
        _finish_root(real, plan, group)
    return real


# -- gathering --------------------------------------------------------------------

def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module) and (
            type(model).__name__ in ("DistributedDataParallel", "DataParallel")):
        model = model.module
    return model


@torch.no_grad()
def gather_tp_state_dict(model: nn.Module, to_cpu: bool = True) -> Dict[str, torch.Tensor]:
    """The full state dict of a tensor-parallel model: the keys and shapes of the unsharded model.

    Collective over each tensor group (every rank of the group must call it); every rank gets
    the whole dict (moved to the CPU by default), vocabulary padding removed. A DDP wrapper
    is looked through, so the keys have no "module." prefix.
    """
    model = _unwrap(model)
    state = model.state_dict()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TensorParallelModule):
            continue
        for pname, spec in module.shard_specs().items():
            key = f"{mod_name}.{pname}" if mod_name else pname
            local = getattr(module, pname).detach().contiguous()
            if module.tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(module.tp_size)]
                dist.all_gather(shards, local, group=module.group)
            else:
                shards = [local]
            state[key] = unshard_tensors(shards, spec).clone()
    if to_cpu:
        state = {k: v.cpu() for k, v in state.items()}
    return state


@torch.no_grad()
def load_tp_state_dict(model: nn.Module, full_state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full (unsharded, e.g. Hugging Face) state dict into a tensor-parallel model: each rank copies its slices."""
    model = _unwrap(model)
    local: Dict[str, torch.Tensor] = dict(full_state)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TensorParallelModule):
            continue
        for pname, spec in module.shard_specs().items():
            key = f"{mod_name}.{pname}" if mod_name else pname
            if key in full_state:
                local[key] = shard_tensor(full_state[key], spec, module.tp_rank)
    model.load_state_dict(local, strict=strict)


def gather_tp_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from a model whose LM head kept its output split (differentiable)."""
    model = _unwrap(model)
    head = _output_embedding(model)
    if not isinstance(head, ColumnParallelLinear) or head.gather_output or head.tp_size == 1:
        return logits
    full = gather_from_group(logits, head.group)
    return full[..., :head.out_features]


def tp_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds under `module` (shared parameters counted once)."""
    seen = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
