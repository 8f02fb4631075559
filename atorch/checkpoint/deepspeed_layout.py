"""DeepSpeed ZeRO engines (stages 1, 2 and 3) and DeepSpeed's BF16_Optimizer in the layout-independent
checkpoint keys.

Decision: DeepSpeed's own `engine.save_checkpoint` is not used. It writes pickles that its
loader opens with `weights_only=False`, and its files are tied to the data-parallel size.
Instead the engine's partitioned fp32 master weights and optimizer moments are assembled
per parameter with DeepSpeed's public tensor-fragment API (`safe_get_full_*` /
`safe_set_full_*`, collectives over the data-parallel group) and saved under the
parameter's name, exactly like a torch optimizer's flattened state: a DeepSpeed checkpoint
loads into DDP / FSDP and back, at any data-parallel size. The cost is one full tensor per
parameter in memory at a time on every rank while saving and loading.

DeepSpeed's BF16_Optimizer (bf16 at ZeRO stage 0, as DeepSpeed 3D's pipeline engine runs it, and
ZeRO-1 with bf16 weights and fp32 gradient accumulation) keeps the same flat fp32 partitions over the
data-parallel group and links its parameters to them as ZeRO-1/2 do, so it is read the same way,
through its own names for the groups. Any other optimizer wrapper an engine may hold (DeepSpeed's
FP16_Optimizer at stage 0) is refused when its state is asked for, rather than saved without it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch import nn

import torch

from atorch.checkpoint.layout_handlers import (
    LayoutHandler,
    TPShards,
    flatten_optimizer,
    init_optimizer_state,
    load_flat_optimizer,
)
from atorch.distributed.agreement import agree_on_error

# Loss-scaler fields of fp16 engines worth restoring (numbers only).
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_factor", "scale_window")
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


class DeepSpeedHandler(LayoutHandler):
    """A DeepSpeed engine with a ZeRO stage 1, 2 or 3 optimizer, DeepSpeed's BF16_Optimizer, or a torch optimizer."""

    name = "deepspeed"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
        optimizer = getattr(engine, "optimizer", None)
        # bf16 without ZeRO (DeepSpeed 3D's pipeline engine), or ZeRO-1 with fp32 gradient accumulation:
        # flat fp32 master partitions like ZeRO-1/2's, under other attribute names (see `_groups`).
        self.bf16_optim = _is_bf16_optimizer(optimizer)
        # DeepSpeed's ZeRO optimizer or BF16_Optimizer (untyped): its flat groups are read through attributes below.
        self.zero: Any = optimizer if self.stage in (1, 2, 3) or self.bf16_optim else None
        # Without ZeRO (DeepSpeed's pipeline engine at stage 0, fp32) the engine steps a torch optimizer.
        self.plain_optim: Optional[torch.optim.Optimizer] = optimizer if self.zero is None and isinstance(
            optimizer, torch.optim.Optimizer) else None
        # An optimizer wrapper none of the above reads (DeepSpeed's FP16_Optimizer at stage 0): its class name.
        self.unreadable_optimizer: Optional[str] = type(optimizer).__name__ if optimizer is not None and \
            self.zero is None and self.plain_optim is None else None
        self.entries, named_modules = _checkpoint_entries(engine.module)
        self.names: Dict[int, str] = {}
        for name, value, is_param in self.entries:
            if is_param:
                # A tied parameter is named once, by its first name, as torch's state-dict tools name it.
                self.names.setdefault(id(value), name)
        self.tp = TPShards(named_modules)

    @property
    def has_optimizer(self) -> bool:
        return self.zero is not None or self.plain_optim is not None

    def check_optimizer_readable(self, caller: str) -> None:
        """Raise ValueError when the engine has an optimizer whose state this handler cannot read or write.

        Saved or loaded without it, the checkpoint would drop the optimizer's state (and its fp32 master
        weights) silently and the resumed run would train from a fresh optimizer. `caller` is
        "save_checkpoint" or "load_checkpoint"; the same on every rank (one ds_config builds every engine).
        """
        if self.unreadable_optimizer is None:
            return
        flag, verb = ("save_optimizer", "save") if caller == "save_checkpoint" else ("load_optimizer", "restore")
        raise ValueError(
            f"{caller}: the DeepSpeed engine's optimizer is {self.unreadable_optimizer}, whose state (fp32 master "
            f"weights and moments) atorch's checkpoints cannot {verb}; pass {flag}=False to {verb} the model's "
            "weights alone (the optimizer then starts afresh). Checkpoints hold the optimizers of ZeRO stages 1 "
            "to 3 (fp16 included), of bf16 (BF16_Optimizer) and of fp32 engines")

    # -- model -------------------------------------------------------------------------
    def model_state(self) -> Dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        state: Dict[str, torch.Tensor] = {}
        for name, value, is_param in self.entries:
            if not is_param:
                state[name] = value.detach()       # a buffer: never partitioned
            elif self.zero is not None and value.requires_grad and (self.stage == 3 or value.dtype != torch.float32):
                # The fp32 master copy holds the exact weights (and the only full copy under ZeRO-3).
                state[name] = safe_get_full_fp32_param(value).reshape(_shape(value))
            elif self.stage == 3:
                state[name] = _gathered(value)     # a frozen ZeRO-3 parameter
            else:
                state[name] = value.detach()
        return self.tp.to_global(state)

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        state = self.tp.to_local(state)
        with torch.no_grad():
            for name, value, is_param in self.entries:
                if is_param and self.stage == 3:
                    _scatter(value, state[name])
                elif state[name] is not value:
                    value.copy_(state[name].to(value.dtype))
                if is_param and value.requires_grad and self.zero is not None:
                    _set_full_master(value, state[name])

    # -- optimizer ---------------------------------------------------------------------
    def _groups(self) -> List[Tuple[Dict[str, Any], List[torch.nn.Parameter], torch.Tensor]]:
        """(inner param group, its model parameters, its flat fp32 partition) per ZeRO (sub-)group."""
        inner = self.zero.optimizer
        if self.bf16_optim:
            # One group per inner param group, as ZeRO-1/2, whatever the engine's ZeRO stage (0 or 1).
            return [(group, list(self.zero.bf16_groups[i]), self.zero.fp32_groups_flat_partition[i])
                    for i, group in enumerate(inner.param_groups)]
        if self.stage == 3:
            # ZeRO-3 splits groups into sub-groups and hands the optimizer one flat at a time.
            return [(inner.param_groups[self.zero.sub_group_to_group_id[i]], list(params),
                     self.zero.fp32_partitioned_groups_flat[i]) for i, params in enumerate(self.zero.fp16_groups)]
        return [(group, list(self.zero.bit16_groups[i]), self.zero.single_partition_of_fp32_groups[i])
                for i, group in enumerate(inner.param_groups)]

    def tied_weights(self) -> List[Tuple[str, ...]]:
        """The names of each Parameter the engine's module holds under several (a tied embedding/head): each is
        read and written once per name (`model_state` gives separate full copies), so they must agree."""
        names: Dict[int, List[str]] = {}
        for name, value, is_param in self.entries:
            if is_param:
                names.setdefault(id(value), []).append(name)
        return [tuple(group) for group in names.values() if len(group) > 1]

    def param_group_names(self) -> List[List[str]]:
        if not self.has_optimizer:
            return []
        if self.zero is None:
            assert self.plain_optim is not None, "has_optimizer: a ZeRO or a plain optimizer"
            return [[self.names[id(p)] for p in g["params"] if id(p) in self.names]
                    for g in self.plain_optim.param_groups]
        inner = self.zero.optimizer.param_groups
        names: List[List[str]] = [[] for _ in inner]
        for group, params, _ in self._groups():   # ZeRO-3's sub-groups add up to their group
            index = next(i for i, g in enumerate(inner) if g is group)
            names[index] += [self.names[id(p)] for p in params]
        return names

    def _ensure_state(self) -> None:
        """Create the inner optimizer's state (built lazily at the first step) and link DeepSpeed's views of it."""
        inner = self.zero.optimizer
        groups = self._groups()
        # ZeRO-3 registers no state before the first step; stages 1 and 2 neither.
        if not all(self._state_keys(flat) for _, _, flat in groups):
            # One zero-gradient step at lr 0 over every flat partition creates the state without
            # changing any weight; everything it touches is put back.
            saved_groups = [(g, g["params"], g["lr"]) for g in inner.param_groups]
            saved_grads = [(flat, flat.grad) for _, _, flat in groups]
            for g in inner.param_groups:
                g["lr"] = 0.0
                if self.stage == 3:
                    g["params"] = []
            for g, _, flat in groups:
                flat.grad = torch.zeros_like(flat)
                if self.stage == 3:
                    g["params"].append(flat)
            inner.step()
            for g, params, lr in saved_groups:
                g["params"], g["lr"] = params, lr
            for flat, grad in saved_grads:
                flat.grad = grad
        if self.stage != 3:
            # Stages 1 and 2 (and BF16_Optimizer) address the state through per-parameter views, linked once,
            # after the first group's step: ZeRO-1/2 step one group at a time, so with several groups
            # every later group's parameters were linked to no state. Relinking every group is cheap and
            # local (views of the flat state).
            from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

            for _, params, flat in groups:
                lazy_init_hp_params_optimizer_state(params, flat, inner.state)

    def _state_keys(self, flat: torch.Tensor) -> List[str]:
        state = self.zero.optimizer.state.get(flat) or {}
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape)

    def _state_plan(self) -> List[Tuple[Dict[str, Any], List[torch.nn.Parameter], torch.Tensor, List[str]]]:
        """(group, its parameters, its flat partition, the state keys to gather) per group, once every
        parameter this rank holds a fragment of is checked to address each key (collective-free).

        `safe_get_full_optimizer_state` raises on a rank whose fragment lacks the key, before the
        all-reduce that the ranks without a fragment of that parameter are already waiting in.
        """
        self._ensure_state()
        plan = []
        for group, params, flat in self._groups():
            keys = self._state_keys(flat)
            for p in params:
                mapping = getattr(p, "_hp_mapping", None)
                linked = getattr(mapping, "optim_fragment", None)
                missing = [k for k in keys if linked is not None and k not in linked]
                if mapping is not None and (linked is None or missing):
                    raise ValueError(
                        f"the DeepSpeed optimizer state of {self.names[id(p)]!r} is not linked to its "
                        f"parameter (missing {missing or keys}); the checkpoint cannot gather it. This is a "
                        "bug in atorch's DeepSpeed checkpoint layout: please report it")
            plan.append((group, params, flat, keys))
        return plan

    def optim_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        from deepspeed.utils import safe_get_full_optimizer_state

        tensors: Dict[str, torch.Tensor]
        values: Dict[str, Any]
        if self.zero is None:
            assert self.plain_optim is not None, "has_optimizer is checked before the optimizer state is read"
            init_optimizer_state(self.plain_optim)
            tensors, values = flatten_optimizer(self.plain_optim, self.names)
            return self.tp.to_global(tensors), values
        # Local; a rank that fails here would leave the others in the first gather below: agreed first.
        with agree_on_error("checkpoint: reading the DeepSpeed optimizer state (to save it, or to load into it)"):
            plan = self._state_plan()
        tensors = {}
        values = {}
        for group, params, flat, keys in plan:
            flat_state = self.zero.optimizer.state[flat]
            for p in params:
                name = self.names[id(p)]
                for key in keys:
                    tensors[f"state.{name}.{key}"] = safe_get_full_optimizer_state(p, key).reshape(_shape(p))
                # Scalars (Adam's step) are one per flat partition; saved per parameter like torch does,
                # as 0-dim tensors whatever the optimizer keeps (DeepSpeed's CPU Adam: a Python int).
                for key, v in flat_state.items():
                    if torch.is_tensor(v) and v.dim() == 0:
                        tensors[f"state.{name}.{key}"] = v.detach().clone()
                    elif _is_number(v):
                        tensors[f"state.{name}.{key}"] = torch.tensor(float(v))
                for key, v in group.items():
                    if key != "params":
                        values[f"param_groups.{name}.{key}"] = v
        return self.tp.to_global(tensors), values

    def load_optim_state(self, tensors: Dict[str, torch.Tensor], values: Dict[str, Any]) -> None:
        tensors = self.tp.to_local(tensors)
        if self.zero is None:
            assert self.plain_optim is not None, "has_optimizer is checked before the optimizer state is loaded"
            load_flat_optimizer(self.plain_optim, self.names, values)  # its tensors were filled in place
            return
        self._ensure_state()
        for group, params, flat in self._groups():
            flat_state = self.zero.optimizer.state[flat]
            keys = self._state_keys(flat)
            for p in params:
                name = self.names[id(p)]
                for key in keys:
                    _set_full_master(p, tensors[f"state.{name}.{key}"], key)
            first = self.names[id(params[0])]
            for key, v in list(flat_state.items()):
                if torch.is_tensor(v) and v.dim() == 0:
                    v.copy_(tensors[f"state.{first}.{key}"])
                elif _is_number(v):   # a Python scalar: the step count of DeepSpeed's CPU Adam
                    flat_state[key] = type(v)(tensors[f"state.{first}.{key}"].item())
            for key in list(group):
                saved = values.get(f"param_groups.{first}.{key}")
                if key != "params" and saved is not None:
                    group[key] = saved

    # -- engine counters ---------------------------------------------------------------
    def extra_state(self) -> Dict[str, Any]:
        e = self.engine
        state: Dict[str, Any] = {k: getattr(e, k) for k in _COUNTERS if isinstance(getattr(e, k, None), int)}
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            state["loss_scaler"] = {f: float(getattr(scaler, f)) for f in _SCALER_FIELDS
                                    if isinstance(getattr(scaler, f, None), (int, float))}
        return state

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        for key in _COUNTERS:
            if key in state:
                setattr(self.engine, key, int(state[key]))
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        for f, v in (state.get("loss_scaler") or {}).items():
            if scaler is not None and hasattr(scaler, f):
                setattr(scaler, f, type(getattr(scaler, f))(v))


def _is_bf16_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeed's BF16_Optimizer (False where DeepSpeed cannot be imported)."""
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:
        return False
    return isinstance(optimizer, BF16_Optimizer)


def _checkpoint_entries(module: nn.Module) -> Tuple[List[Tuple[str, torch.Tensor, bool]], List[Tuple[str, nn.Module]]]:
    """(name, tensor, is_parameter) for every state-dict entry under Hugging Face names, and (name, module) pairs.

    A DeepSpeed `PipelineModule` names its layers by index; atorch's pipeline stages
    (`local_layers()`) know each piece's original path, so the names are the HF model's.
    """
    if hasattr(module, "local_layers"):
        # local_layers is a method of atorch's pipeline stages, unseen through nn.Module's type.
        pieces = [(layer.path, layer.module) for layer in module.local_layers()]  # type: ignore[operator]
    else:
        pieces = [("", module)]
    entries = []
    named_modules: List[Tuple[str, nn.Module]] = []
    for prefix, piece in pieces:
        params = {id(p) for p in piece.parameters()}
        for key, value in piece.state_dict(keep_vars=True).items():
            entries.append((f"{prefix}.{key}" if prefix else key, value, id(value) in params))
        named_modules += [(f"{prefix}.{n}" if prefix and n else (prefix or n), m)
                          for n, m in piece.named_modules(remove_duplicate=False)]
    return entries, named_modules


def _shape(p: torch.Tensor) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _gathered(p: torch.Tensor) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        return p.detach().clone()


def _set_full_master(p: torch.Tensor, full: torch.Tensor, optim_state_key: Optional[str] = None) -> None:
    """Write the whole-parameter `full` (every rank holds the same) into `p`'s fp32 master partition, or
    into its optimizer state `optim_state_key`.

    Under ZeRO-3 each rank writes its own slice through DeepSpeed's local API: its full-tensor setter
    slices `partition numel x rank` out of the unpadded tensor, which runs past the end on the last
    rank when the parameter's size is not a multiple of the group's (a bias of an odd vocabulary
    on 2 ranks). The padding past the end of the parameter is written as zeros, as DeepSpeed pads.
    """
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    full = full.to(torch.float32)
    if hasattr(p, "ds_id"):            # a ZeRO-3 partitioned parameter
        import torch.distributed as dist

        partition: torch.Tensor = getattr(p, "ds_tensor")     # this rank's slice, padded on the last rank
        part = partition.numel()
        start = part * dist.get_rank(group=getattr(p, "ds_process_group", None))
        local = full.reshape(-1)[start:start + part]
        local = torch.cat([local, local.new_zeros(part - local.numel())]) if local.numel() < part else local
        local = local.to(partition.device)
        if optim_state_key is None:
            safe_set_local_fp32_param(p, local)
        else:
            safe_set_local_optimizer_state(p, local, optim_state_key)
    elif optim_state_key is None:
        safe_set_full_fp32_param(p, full)
    else:
        safe_set_full_optimizer_state(p, full, optim_state_key)


def _scatter(p: torch.Tensor, full: torch.Tensor) -> None:
    """Write `full` into a ZeRO-3 parameter's partitions (every rank holds the same `full`).

    On exit DeepSpeed broadcasts the gathered parameter from `modifier_rank`, a rank of
    `p.ds_process_group` (global rank 0 need not be in it, nor be its rank 0): every rank copies,
    so the source holds `full` whichever process it is.
    """
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
        p.data.copy_(full.to(p.dtype).reshape(p.shape))


def _is_number(value: Any) -> bool:
    """A Python int or float optimizer-state entry (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
