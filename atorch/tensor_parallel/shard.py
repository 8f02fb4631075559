"""Shard a model as a `TPPlan` says: replace linears and embeddings with tensor-parallel layers, re-class
experts and per-head norms, hook dropouts and per-head inputs, and rebuild full state dicts.

`shard_model` shards a real model in place over an explicit process group, or marks a meta
model (built under `record_module_init`) so `materialize_tp_module` builds only this rank's
slices. `gather_tp_state_dict` / `load_tp_state_dict` convert to and from the unsharded
model's state dict. Nothing here reads atorch's process-global parallel groups unless no
group is passed (the compatibility entry point `tp_manual_shard_custom_fn`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from atorch.tensor_parallel.cross_entropy import VocabParallelCausalLMLoss
from atorch.tensor_parallel.experts import reduce_grads, shard_experts
from atorch.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallelModule,
    VocabParallelEmbedding,
    pad_to_multiple,
    shard_tensor,
    unshard_tensors,
)
from atorch.tensor_parallel.logits import gather_output_logits, gather_tp_logits, unwrap_data_parallel
from atorch.tensor_parallel.mappings import Group, group_rank, group_size
from atorch.tensor_parallel.plan import (
    COL,
    EXPERTS,
    GRAD_REDUCE,
    PARALLEL_DROP,
    REPLIC_DROP,
    ROW,
    TPAction,
    TPInfo,
    TPPlan,
    _linear_sizes,
    resolve_tp_plan,
)
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, fork_model_rng, fork_module_rng
from atorch.utils.meta_model_utils import (
    TP_MARK_ATTR,
    is_meta_module,
    materialize_module,
    register_tensor_parallel_builder,
)
from atorch.utils.module_utils import find_transformer_block_classes

__all__ = ["gather_tp_logits", "gather_tp_state_dict", "load_tp_state_dict", "materialize_tp_module", "shard_model",
           "tp_manual_shard_custom_fn", "tp_param_bytes", "tp_plan_of"]

_ACTION_ATTR = TP_MARK_ATTR
_SHRINK_ATTR = "_atorch_tp_shrink"
_HEADS_ATTR = "_atorch_tp_head_inputs"
_PLAN_ATTR = "_atorch_tp_plan"

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
                              gather_logits: Optional[bool] = True) -> nn.Module:
    """`shard_model` with `group` defaulting to atorch's "tensor" parallel group (the ATorch entry point)."""
    if group is None:
        group = _default_group()
    return shard_model(model, tpinfo, group, randomizer=randomizer, gather_logits=gather_logits)


def shard_model(model: nn.Module, tpinfo: TPInfo, group: Group, *,
                randomizer: Optional[MultiDimParallelRandomizer] = None,
                gather_logits: Optional[bool] = True) -> nn.Module:
    """Shard `model` over `group` as `tpinfo` says; a meta model is only marked.

    A real model is sharded in place (its matched modules are replaced by tensor-parallel
    layers holding this rank's slices; the returned module is `model` unless `model` itself
    was matched). It must hold the same weights on every rank of the group. A meta model
    (built under `record_module_init`) gets the plan attached to its modules and is
    returned unchanged; `materialize_tp_module` then builds only the slices (and takes the
    randomizer). `group` is the tensor-parallel process group (None: a group of one, the
    current process alone); `randomizer` (for the dropout roles) defaults to the process
    default, looked up at forward time. `gather_logits` (see `resolve_tp_plan`): True, the
    default, makes the model return the unsharded model's full logits while its own loss is
    computed from the vocabulary slices. All checks run before anything changes.
    """
    plan = resolve_tp_plan(model, tpinfo, group_size(group), gather_logits=gather_logits)
    if is_meta_module(model):
        _mark(model, plan)
        return model
    model = _apply_plan(model, "", plan.actions, plan.shrink, plan.head_inputs, group, randomizer, {})
    _finish_root(model, plan, group, randomizer)
    return model


def _mark(model: nn.Module, plan: TPPlan) -> None:
    for name, module in model.named_modules():
        module.__dict__.pop(_ACTION_ATTR, None)
        module.__dict__.pop(_SHRINK_ATTR, None)
        module.__dict__.pop(_HEADS_ATTR, None)
        if name in plan.actions:
            module.__dict__[_ACTION_ATTR] = plan.actions[name]
        if name in plan.shrink:
            module.__dict__[_SHRINK_ATTR] = plan.shrink[name]
        if name in plan.head_inputs:
            module.__dict__[_HEADS_ATTR] = plan.head_inputs[name]
    model.__dict__[_PLAN_ATTR] = plan


def tp_plan_of(model: nn.Module) -> Optional[TPPlan]:
    """The plan attached by `tp_manual_shard_custom_fn` (on a marked meta model or a sharded model)."""
    return model.__dict__.get(_PLAN_ATTR)


HeadInputs = Mapping[str, Tuple[Tuple[str, ...], int]]


def _marks(meta: nn.Module) -> Tuple[Dict[str, TPAction], Dict[str, Dict[str, int]], Dict[str, Any]]:
    actions, shrink, heads = {}, {}, {}
    for name, module in meta.named_modules():
        if _ACTION_ATTR in module.__dict__:
            actions[name] = module.__dict__[_ACTION_ATTR]
        if _SHRINK_ATTR in module.__dict__:
            shrink[name] = module.__dict__[_SHRINK_ATTR]
        if _HEADS_ATTR in module.__dict__:
            heads[name] = module.__dict__[_HEADS_ATTR]
    return actions, shrink, heads


def _apply_plan(root: nn.Module, prefix: str, actions: Mapping[str, TPAction], shrink: Mapping[str, Dict[str, int]],
                head_inputs: HeadInputs, group: Group, randomizer: Optional[MultiDimParallelRandomizer],
                shared: Dict[int, _Shared]) -> nn.Module:
    """Replace/annotate the modules of `root` named in `actions` (names relative to `root`)."""
    tp_size = group_size(group)
    for name, values in shrink.items():
        module = root.get_submodule(name) if name else root
        for attr, value in values.items():
            setattr(module, attr, value)
    for name, (keywords, heads) in head_inputs.items():
        module = root.get_submodule(name) if name else root
        module.register_forward_pre_hook(_head_slicer(keywords, heads, tp_size, group_rank(group)), with_kwargs=True)
    replaced_root: Optional[nn.Module] = None
    for name, action in actions.items():
        module = root.get_submodule(name) if name else root
        if action.kind in (REPLIC_DROP, PARALLEL_DROP):
            fork_module_rng(module, randomizer, "tensor", replicated=action.kind == REPLIC_DROP)
            continue
        if action.kind == GRAD_REDUCE:
            reduce_grads(module, group)
            continue
        if action.kind == EXPERTS:
            if tp_size > 1:
                shard_experts(module, group)
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


def _head_slicer(keywords: Tuple[str, ...], heads: int, tp_size: int, rank: int) -> Callable:
    """A forward pre-hook keeping this rank's heads of keyword inputs laid out [batch * heads, ...]."""
    local = heads // tp_size

    def hook(module: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
        for key in keywords:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and tp_size > 1:
                rest = value.shape[1:]
                per_head = value.reshape(-1, heads, *rest)
                kwargs[key] = per_head[:, rank * local:(rank + 1) * local].reshape(-1, *rest)
        return args, kwargs

    return hook


def _tp_layer(module: nn.Module, action: TPAction, group: Group, tp_size: int) -> TensorParallelModule:
    if action.kind == COL:
        _, out_f = _linear_sizes(module)
        padded = pad_to_multiple(out_f, tp_size) if action.option("pad_vocab", False) else None
        return ColumnParallelLinear.from_full(module, group, gather_output=action.option("gather_output", False),
                                              stride=action.option("stride", 1), padded_out_features=padded)
    if action.kind == ROW:
        return RowParallelLinear.from_full(module, group, input_is_parallel=action.option("input_is_parallel", True))
    return VocabParallelEmbedding.from_full(cast(nn.Embedding, module), group)  # checked by _check_module_type


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


def _finish_root(model: nn.Module, plan: TPPlan, group: Group,
                 randomizer: Optional[MultiDimParallelRandomizer]) -> None:
    # Draws that no forked module claims (functional dropout in a module the plan leaves whole)
    # must agree across the group: the whole forward runs in the shared stream.
    fork_model_rng(model, randomizer, "tensor")
    if plan.vocab_parallel_loss and hasattr(model, "loss_function"):
        # An HF model (it has loss_function) has a config, so plan.vocab_size is known; setattr because the
        # loss is a plain callable, not a Module or Tensor (nn.Module.__setattr__'s declared types).
        setattr(model, "loss_function", VocabParallelCausalLMLoss(group, cast(int, plan.vocab_size)))
    if plan.gather_logits:
        # After the model's forward (and so after its loss, computed from the slices).
        model.register_forward_hook(gather_output_logits)
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
        actions, shrink, heads = _marks(meta)
        return _apply_plan(real, prefix, actions, shrink, heads, group, randomizer, {})

    if block_classes is None:
        block_classes = tuple(find_transformer_block_classes(module)) if per_block else ()
    real = materialize_module(module, base_seed, device=device, transform=shard, per_block=per_block,
                              block_classes=block_classes, init_fn=init_fn)
    if plan is not None:
        _finish_root(real, plan, group, randomizer)
    return real


# -- gathering --------------------------------------------------------------------


@torch.no_grad()
def gather_tp_state_dict(model: nn.Module, to_cpu: bool = True) -> Dict[str, torch.Tensor]:
    """The full state dict of a tensor-parallel model: the keys and shapes of the unsharded model.

    Collective over each tensor group (every rank of the group must call it), and over the data
    group when FSDP2 shards the slices (2-D); every rank gets the whole dict (moved to the CPU
    by default), vocabulary padding removed. DDP and activation-checkpointing wrappers are
    looked through, so the keys are the unsharded model's.
    """
    model = unwrap_data_parallel(model)
    state = {_strip_wrappers(k): _full_over_data(v) for k, v in model.state_dict().items()}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TensorParallelModule):
            continue
        for pname, spec in module.shard_specs().items():
            key = _strip_wrappers(f"{mod_name}.{pname}" if mod_name else pname)
            local = _full_over_data(getattr(module, pname).detach()).contiguous()
            if module.tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(module.tp_size)]
                dist.all_gather(shards, local, group=module.group)
            else:
                shards = [local]
            state[key] = unshard_tensors(shards, spec).clone()
    out = {}
    for key, value in state.items():
        copy = value.detach().cpu() if to_cpu else value.detach()
        # A snapshot: replicated entries would otherwise share storage with the live parameters.
        out[key] = copy.clone() if copy.data_ptr() == value.data_ptr() else copy
    return out


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _strip_wrappers(key: str) -> str:
    for wrapper in _WRAPPER_PREFIXES:
        key = key.replace(wrapper, "")
    return key


def _full_over_data(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2 DTensor shard (over the data mesh) is all-gathered, others returned as they are."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def load_tp_state_dict(model: nn.Module, full_state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full (unsharded, e.g. Hugging Face) state dict into a tensor-parallel model: each rank
    copies its slices.

    Keys are matched without wrapper names (activation checkpointing's, torch.compile's), as
    `gather_tp_state_dict` writes them, so its output loads back into the wrapped model.
    """
    model = unwrap_data_parallel(model)
    # The model's own key for each unwrapped name (torch.compile's `_orig_mod.` stays in state_dict keys).
    own_keys = {_strip_wrappers(k): k for k in model.state_dict()}
    specs: Dict[str, Tuple[ShardSpec, int]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TensorParallelModule):
            for pname, spec in module.shard_specs().items():
                specs[_strip_wrappers(f"{mod_name}.{pname}" if mod_name else pname)] = (spec, module.tp_rank)
    local: Dict[str, torch.Tensor] = {}
    for key, value in full_state.items():
        name = _strip_wrappers(key)
        if name in specs:
            value = shard_tensor(value, *specs[name])
        local[own_keys.get(name, key)] = value
    model.load_state_dict(local, strict=strict)


def tp_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds under `module` (shared parameters counted once)."""
    seen = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


register_tensor_parallel_builder(lambda module, base_seed: materialize_tp_module(module, base_seed))
