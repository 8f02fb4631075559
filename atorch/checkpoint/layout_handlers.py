"""Layout handlers: each parallel layout's model and optimizer state in one layout-independent form.

Every handler produces the same keys for the same model: `model/<fqn>` with the original
(Hugging Face) parameter names and full logical shapes, and a flattened optimizer state
`optim/state.<fqn>.<name>` (tensors, saved with DCP) plus `param_groups.<fqn>.<name>`
hyperparameters (JSON). Sharded values are DTensors (FSDP2 shards, atorch tensor-parallel
slices viewed as `Shard(dim)`) that DCP reshards on load, or full tensors (DDP, ZeRO
optimizers, DeepSpeed) that DCP saves once; a pipeline stage contributes its own keys. So a
checkpoint written by any layout loads into any other. One exception is a model change, not a
layout's: LoRA under tensor parallelism names its adapters `<layer>.lora_A` (parameters of atorch's
own layers), peft names them `<layer>.lora_A.<adapter>.weight`, so such a checkpoint loads into
tensor-parallel LoRA at any tensor size; `merge_checkpoint` writes it as a plain model (folded) or as
peft adapters, which `PeftModel.from_pretrained` loads anywhere. DeepSpeed engines: deepspeed_layout.py.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import nn

from atorch.utils.memory import innermost_optimizer

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
_PARAM_GROUPS = "param_groups."
_STATE = "state."


def is_deepspeed_engine(obj: Any) -> bool:
    # An engine exists only if deepspeed was imported; importing it here would cost seconds.
    deepspeed = sys.modules.get("deepspeed")
    engine_cls = getattr(deepspeed, "DeepSpeedEngine", None)
    return engine_cls is not None and isinstance(obj, engine_cls)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP, DeepSpeed engines and torch.compile wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        if is_deepspeed_engine(model) or isinstance(model, nn.parallel.DistributedDataParallel):
            model = cast(nn.Module, model.module)  # both wrappers hold the user's module there
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def find_hf_model(model: nn.Module) -> Tuple[Optional[nn.Module], str]:
    """The outermost Hugging Face `PreTrainedModel` inside `model` and its name prefix ('' when it is the root)."""
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001 - transformers is optional for plain models
        return None, ""
    root = unwrap_model(model)
    for name, module in root.named_modules():
        if isinstance(module, PreTrainedModel):
            return module, (name + "." if name else "")
    return None, ""


def find_hf_config(model: nn.Module) -> Any:
    """The Hugging Face config of `model`: its PreTrainedModel's, else any submodule's `.config`.

    Pipeline stages hold pieces of a model (decoder layers, attention modules) rather than the
    PreTrainedModel; those pieces keep a reference to the model's config.
    """
    hf_model, _ = find_hf_model(model)
    if hf_model is not None:
        return hf_model.config
    try:
        from transformers import PretrainedConfig
    except Exception:  # noqa: BLE001 - transformers is optional for plain models
        return None
    for module in unwrap_model(model).modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            return config
    return None


def peft_model_of(model: nn.Module) -> Optional[nn.Module]:
    """The `peft.PeftModel` at the root of `model` (under wrappers), or None."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported
    peft_cls = getattr(peft, "PeftModel", None)
    root = unwrap_model(model)
    return root if peft_cls is not None and isinstance(root, peft_cls) else None


class LayoutHandler(ABC):
    """Reads and writes one layout's state in the common keys (without the model/ and optim/ prefixes)."""

    name: str = ""

    @abstractmethod
    def model_state(self) -> Dict[str, torch.Tensor]:
        """Tensors (possibly DTensors) to save; on load, the tensors DCP fills before `load_model_state`."""

    @abstractmethod
    def optim_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """(tensors, JSON-able hyperparameters) of the optimizer; on load, the tensors to fill."""

    @abstractmethod
    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Install the filled `model_state()` tensors."""

    @abstractmethod
    def load_optim_state(self, tensors: Dict[str, torch.Tensor], values: Dict[str, Any]) -> None:
        """Install the filled `optim_state()` tensors and the saved hyperparameters."""

    @property
    def has_optimizer(self) -> bool:
        return False

    def tied_weights(self) -> List[Tuple[str, ...]]:
        """Groups of names (common keys) that are one logical weight of the target: a Parameter shared by
        several modules (a tied embedding/head), or a pipeline's two copies of one (see `_tie_groups`)."""
        return []

    def param_group_names(self) -> List[List[str]]:
        """The names (common keys) of the parameters in each of the optimizer's param groups, by group index;
        a parameter shared by several modules under each of its names. [] without an optimizer."""
        return []

    def optim_load_problems(self, values: Dict[str, Any]) -> List[str]:
        """What would make `load_optim_state` refuse `values` (the hyperparameters to install), found before
        anything is loaded; [] when nothing would."""
        return []

    def extra_state(self) -> Optional[Dict[str, Any]]:
        """Layout-specific counters (JSON data) to restore with the optimizer; None when there are none."""
        return None

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""


def split_flat_optim(flat: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Tensors go to DCP, everything else (hyperparameters, python-number states) to JSON."""
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return tensors, values


class TorchHandler(LayoutHandler):
    """Plain modules, DDP, FSDP2 (`fully_shard`), tensor parallel and torch ZeRO optimizers.

    Uses `torch.distributed.checkpoint.state_dict`, which strips wrapper prefixes (DDP's
    `module.`, compile's `_orig_mod.`, activation checkpointing's wrapper) and returns FSDP2
    shards as DTensors. atorch's tensor-parallel slices become DTensor views (`TPShards`). A
    `ZeroRedundancyOptimizer` is handled through its local optimizer: each rank contributes the
    full states of the parameters it owns, keyed by name.
    """

    name = "torch"

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizer = optimizer
        # The optimizer holding this rank's state: a ZeroRedundancyOptimizer's local one; wrappers that
        # share their inner optimizer's state (fp16 gradient scaling) are looked through.
        self._local_optim: Optional[torch.optim.Optimizer] = (
            innermost_optimizer(optimizer) if optimizer is not None else None)
        self.tp = TPShards.of_model(model)

    @property
    def has_optimizer(self) -> bool:
        return self._local_optim is not None

    def _options(self, **kw: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(**kw)

    def model_state(self) -> Dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = cast(Dict[str, torch.Tensor], get_model_state_dict(self.model, options=self._options()))
        return self.tp.to_global(state)

    def optim_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self._local_optim is None:
            return {}, {}
        if self.optimizer is not None and self._local_optim is not self.optimizer:
            # ZeroRedundancyOptimizer copies its hyperparameters into the local optimizer only at the
            # start of a step, so the local lr lags an lr scheduler by one step: take the outer ones.
            _copy_hyperparameters(self.optimizer.param_groups, self._local_optim.param_groups)
        flat = get_optimizer_state_dict(self.model, self._local_optim,
                                        options=self._options(flatten_optimizer_state_dict=True))
        tensors, values = split_flat_optim(flat)
        return self.tp.to_global(tensors), values

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        local: Dict[str, Any] = self.tp.to_local(state)
        set_model_state_dict(self.model, local, options=self._options(strict=True))

    def load_optim_state(self, tensors: Dict[str, torch.Tensor], values: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if self._local_optim is None:
            return
        flat: Dict[str, Any] = {**self.tp.to_local(tensors), **values}
        optim = self._local_optim
        # A ZeroRedundancyOptimizer gives a rank an empty parameter group where all of the group's
        # parameters are owned elsewhere (a small no-decay group on 2+ ranks). torch's flattened
        # loader reads a group's hyperparameters from its first parameter and raises IndexError on an
        # empty one, so it sees only the groups holding parameters; the empty ones are put back at
        # their places (nothing of theirs was saved from this rank, and nothing steps them here).
        empty = [(i, g) for i, g in enumerate(optim.param_groups) if not g["params"]]
        if empty:
            optim.param_groups = [g for g in optim.param_groups if g["params"]]
        try:
            set_optimizer_state_dict(self.model, optim, flat, options=self._options(flatten_optimizer_state_dict=True))
        finally:
            for i, group in empty:
                optim.param_groups.insert(i, group)
        for i, group in empty:
            # Its hyperparameters (the scheduled lr) as saved by the ranks owning its parameters, so that
            # the outer optimizer's groups read the same on every rank.
            group.update(self._saved_hyperparameters(i, values))
        if self.optimizer is not None and self._local_optim is not self.optimizer:
            # ZeroRedundancyOptimizer copies its own param_groups into the local optimizer at
            # every step, so the restored hyperparameters (the scheduled lr) must go there too.
            _copy_hyperparameters(self._local_optim.param_groups, self.optimizer.param_groups)

    def drop_optim_state(self, names: List[str]) -> None:
        """Drop the optimizer state of the parameters `names` (flattened-key names): a checkpoint saved before
        they had a gradient held none, and torch's loader gave them a fresh one (save_load._stateless_parameters)."""
        optim = self._local_optim
        if optim is None:
            return
        mapping = self._state_dict_info(optim).fqn_param_mapping
        wanted = set(names)
        for group in optim.param_groups:
            for param in group["params"]:
                if wanted.intersection(mapping.get(param, ())):
                    optim.state.pop(param, None)

    def tied_weights(self) -> List[Tuple[str, ...]]:
        return _tie_groups(self.model)

    def optim_load_problems(self, values: Dict[str, Any]) -> List[str]:
        """torch's flattened loader builds each group's parameter list from `values`: a shared parameter counts
        once per name whose `param_groups.<name>.*` is there (two for a tied head loaded from a pipeline's
        checkpoint holding both copies), and `Optimizer.load_state_dict` refuses a group of another size only
        after the model was loaded. The same count, done first."""
        optim = self._local_optim
        if optim is None:
            return []
        info = self._state_dict_info(optim)
        problems = []
        for index, group in enumerate(optim.param_groups):
            first_key = next((k for k in group if k != "params"), None)
            names = [fqn for p in group["params"] for fqn in info.fqn_param_mapping[p]
                     if fqn not in info.shared_params_mapping or f"{_PARAM_GROUPS}{fqn}.{first_key}" in values]
            if group["params"] and len(names) != len(group["params"]):
                problems.append(f"optimizer param group {index} has {len(group['params'])} parameters, but the "
                                f"checkpoint's hyperparameters name {len(names)} of them ({sorted(names)[:6]}): "
                                "the checkpoint's parameters are tied (shared) differently from this model's")
        return problems

    def param_group_names(self) -> List[List[str]]:
        if self._local_optim is None:
            return []
        names = self._state_dict_info(self._local_optim).fqn_param_mapping
        # The outer optimizer's groups: a ZeroRedundancyOptimizer's local one holds only this rank's parameters.
        groups = getattr(self.optimizer, "param_groups", None) or self._local_optim.param_groups
        return [[fqn for p in group["params"] for fqn in sorted(names.get(p, ()))] for group in groups]

    def _state_dict_info(self, optim: torch.optim.Optimizer) -> Any:
        """torch's own record of the model's parameter names (`fqn_param_mapping`: parameter -> the names its
        flattened optimizer keys use; `shared_params_mapping`), as its state-dict functions build it."""
        from torch.distributed.checkpoint.state_dict import _verify_options  # private; how torch names them

        return _verify_options(self.model, (optim,), optim_only=True,
                               options=self._options(flatten_optimizer_state_dict=True))

    def _saved_hyperparameters(self, index: int, values: Dict[str, Any]) -> Dict[str, Any]:
        """Group `index`'s hyperparameters in `values` (flattened `param_groups.<fqn>.<key>`), found
        through the outer optimizer's parameters of that group; {} if none is there."""
        if self.optimizer is None or self._local_optim is None or index >= len(self.optimizer.param_groups):
            return {}
        outer = self.optimizer.param_groups[index]
        names = self._state_dict_info(self._local_optim).fqn_param_mapping
        for param in outer["params"]:
            for fqn in names.get(param, ()):
                found = {k: values[f"{_PARAM_GROUPS}{fqn}.{k}"] for k in outer if k != "params"
                         and f"{_PARAM_GROUPS}{fqn}.{k}" in values}
                if found:
                    return found
        return {}


def _tie_groups(model: nn.Module) -> List[Tuple[str, ...]]:
    """The names of each Parameter that several modules share (a tied embedding/head, in named_parameters
    order), and the pair a pipeline stage records as split over two stages (`tied_weight_names`)."""
    root = unwrap_model(model)
    names: Dict[int, List[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        for wrapper in _WRAPPER_NAMES:
            name = name.replace(wrapper, "")
        if name not in names.setdefault(id(param), []):
            names[id(param)].append(name)
    groups = [tuple(n) for n in names.values() if len(n) > 1]
    for path, module in root.named_modules():
        pair = getattr(module, "tied_weight_names", None)  # a native pipeline's PipelineStageModule
        if pair:
            groups.append(tuple(f"{path}.{n}" if path else n for n in pair))
    return groups


def _copy_hyperparameters(src: List[Dict[str, Any]], dst: List[Dict[str, Any]]) -> None:
    for s, d in zip(src, dst):
        d.update({k: v for k, v in s.items() if k != "params"})


def flatten_optimizer(optimizer: torch.optim.Optimizer, name_of: Dict[int, str]
                      ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A torch optimizer's state in the common flattened keys, for parameters named by `name_of[id(p)]`.

    The tensors are the optimizer's own (a load fills them in place); call `init_optimizer_state`
    first on a fresh optimizer.
    """
    tensors: Dict[str, torch.Tensor] = {}
    values: Dict[str, Any] = {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = _param_name(name_of, p, index)
            for key, v in optimizer.state.get(p, {}).items():
                (tensors if isinstance(v, torch.Tensor) else values)[f"{_STATE}{name}.{key}"] = v
            for key, v in group.items():
                if key != "params":
                    values[f"{_PARAM_GROUPS}{name}.{key}"] = v
    return tensors, values


def _param_name(name_of: Dict[int, str], p: torch.Tensor, group_index: int) -> str:
    name = name_of.get(id(p))
    if name is None:
        raise ValueError(f"the optimizer's param group {group_index} holds a tensor of shape {tuple(p.shape)} that is "
                         "not a parameter of the model, so its state cannot be saved under a parameter name; "
                         "build the optimizer over the model's own parameters (model.parameters())")
    return name


def load_flat_optimizer(optimizer: torch.optim.Optimizer, name_of: Dict[int, str], values: Dict[str, Any]) -> None:
    """Install the non-tensor part of `flatten_optimizer`'s keys (the tensors were filled in place)."""
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = _param_name(name_of, p, index)
            for key in list(optimizer.state.get(p, {})):
                v = values.get(f"{_STATE}{name}.{key}")
                if v is not None and not isinstance(optimizer.state[p][key], torch.Tensor):
                    optimizer.state[p][key] = v
        if group["params"]:
            first = _param_name(name_of, group["params"][0], index)
            for key in list(group):
                saved = values.get(f"{_PARAM_GROUPS}{first}.{key}")
                if key != "params" and saved is not None:
                    group[key] = saved


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state with a zero-gradient step at lr 0 (weights unchanged).

    Adam-like optimizers build their state at the first step; a load needs it to exist.
    Parameters that already have gradients or state are left as they are.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p in params:
        p.grad = None


_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class TPShards:
    """atorch tensor-parallel slices (`TensorParallelModule.shard_specs`) as global tensors for DCP.

    A slice cut the way DTensor's `Shard(dim)` cuts (stride 1, any vocabulary padding at the
    end) becomes a DTensor view on the "tensor" mesh with the full Hugging Face shape, so
    each rank writes and reads only its slice and DCP reshards to any other layout. Other
    slices (fused q|k|v with stride > 1) are gathered to the full tensor on save and sliced
    again on load. Optimizer states with the slice's shape are handled like the parameter.
    Under tensor x FSDP (2-D), a slice is itself an FSDP `Shard(0)` DTensor over the data mesh:
    it is all-gathered over the data group to the plain slice first, and on load each rank
    copies its data-chunk of the loaded slice back into its FSDP shard.
    """

    def __init__(self, named_modules: Iterable[Tuple[str, nn.Module]]) -> None:
        """`named_modules`: (checkpoint name prefix, module) pairs covering the model."""
        self.specs: Dict[str, Tuple[Any, Any]] = {}   # fqn -> (TensorParallelModule, ShardSpec)
        self._locals: Dict[str, torch.Tensor] = {}
        self._slices: Dict[str, torch.Tensor] = {}   # key -> the plain tensor-parallel slice of an FSDP shard
        try:
            from atorch.modules.distributed_modules.layers import TensorParallelModule
        except Exception:  # noqa: BLE001 - tensor parallel is optional
            return
        for mod_name, module in named_modules:
            if isinstance(module, TensorParallelModule) and module.tp_size > 1:
                for pname, spec in module.shard_specs().items():
                    fqn = f"{mod_name}.{pname}" if mod_name else pname
                    for wrapper in _WRAPPER_NAMES:
                        fqn = fqn.replace(wrapper, "")
                    self.specs[fqn] = (module, spec)

    @classmethod
    def of_model(cls, model: nn.Module) -> "TPShards":
        return cls(unwrap_model(model).named_modules(remove_duplicate=False))

    def _param_of(self, key: str) -> Optional[str]:
        if key in self.specs:
            return key
        if key.startswith(_STATE):
            fqn = key[len(_STATE):].rsplit(".", 1)[0]
            if fqn in self.specs:
                return fqn
        return None

    def to_global(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if not self.specs:
            return state
        out = dict(state)
        for key, local in state.items():
            fqn = self._param_of(key)
            if fqn is None or not isinstance(local, torch.Tensor) or local.dim() == 0:
                continue
            module, spec = self.specs[fqn]
            self._locals[key] = local
            if _is_dtensor(local):  # an FSDP shard (data mesh) of the tensor-parallel slice
                local = self._slices[key] = _gather_data_shards(local)
            out[key] = _dtensor_view(local, module, spec)
            if out[key] is None:
                out[key] = _gather_full(local, module, spec)
        return out

    def to_local(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The local slices to install, after DCP filled the tensors `to_global` returned."""
        from atorch.modules.distributed_modules.layers import shard_tensor

        if not self.specs:
            return state
        out = dict(state)
        for key, value in state.items():
            local = self._locals.get(key)
            if local is None:
                continue
            module, spec = self.specs[cast(str, self._param_of(key))]  # a key with a local slice has a spec
            tp_slice = self._slices.get(key, local)
            with torch.no_grad():
                if not _is_dtensor(value):
                    # A gathered tensor: this rank keeps its slice.
                    tp_slice.copy_(shard_tensor(value, spec, module.tp_rank).to(tp_slice.dtype))
                if tp_slice is not local:
                    _copy_into_data_shard(local, tp_slice)
            out[key] = local
        return out


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _gather_data_shards(shard: Any) -> torch.Tensor:
    """The plain tensor an FSDP2 parameter (or optimizer state) shards over the data mesh (collective)."""
    from torch.distributed.tensor import Shard

    if tuple(shard.placements) != (Shard(0),):
        raise ValueError(f"tensor-parallel slice sharded as {shard.placements} over {shard.device_mesh}; only FSDP2's "
                         "Shard(0) over the data mesh is supported")
    return shard.full_tensor().detach()


def _copy_into_data_shard(shard: Any, full: torch.Tensor) -> None:
    """Copy this rank's Shard(0) chunk of `full` into the FSDP2 DTensor `shard` (torch.chunk's cut, as DTensor's)."""
    local = shard.to_local()
    chunks = torch.chunk(full, shard.device_mesh.size(), dim=0)
    index = shard.device_mesh.get_local_rank()
    if index < len(chunks) and local.numel():
        local.copy_(chunks[index].to(local.dtype))


def _tensor_mesh_for(module: Any):
    """A 1-D DeviceMesh over the module's own tensor-parallel group (no global layout is consulted)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from atorch.distributed import collective_device

    group = module.group
    key = tuple(dist.get_process_group_ranks(group))
    mesh = _MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = _MESHES[key] = DeviceMesh.from_group(group, collective_device(group).type)
    return mesh


# One mesh per tensor group: DTensor views of one module must share their mesh object.
_MESHES: Dict[Tuple[int, ...], Any] = {}


def _dtensor_view(local: torch.Tensor, module: Any, spec: Any):
    """`local` as a DTensor `Shard(spec.dim)` of the unpadded full tensor, or None when the cut differs."""
    from torch.distributed.tensor import DTensor, Shard

    if spec.stride != 1:
        return None
    chunk = -(-spec.full_size // spec.world)  # DTensor's torch.chunk cut: ceil(full / world) per rank
    if spec.local_size != chunk or local.shape[spec.dim] != spec.local_size:
        return None
    mesh = _tensor_mesh_for(module)
    if mesh is None:
        return None
    start = module.tp_rank * chunk
    rows = max(0, min(chunk, spec.full_size - start))
    view = local.narrow(spec.dim, 0, rows)  # drops vocabulary padding rows, keeps storage shared
    shape = list(local.shape)
    shape[spec.dim] = spec.full_size
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(view, mesh, [Shard(spec.dim)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _gather_full(local: torch.Tensor, module: Any, spec: Any) -> torch.Tensor:
    import torch.distributed as dist

    from atorch.modules.distributed_modules.layers import unshard_tensors

    shards = [torch.empty_like(local) for _ in range(module.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=module.group)
    return unshard_tensors(shards, spec).clone()
