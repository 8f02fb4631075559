"""DeepSpeed ZeRO-1/2 engines in the layout-independent checkpoint keys.

Decision: DeepSpeed's own `engine.save_checkpoint` is not used. It writes pickles that its
loader opens with `weights_only=False`, and its files are tied to the data-parallel size.
Instead the engine's partitioned fp32 master weights and optimizer moments are assembled
per parameter with DeepSpeed's public tensor-fragment API (`safe_get_full_*`, a collective
over the data-parallel group) and saved under the parameter's name, exactly like a torch
optimizer's flattened state: a DeepSpeed checkpoint loads into DDP/FSDP and back.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from atorch.checkpoint.layout import LayoutHandler

# Loss-scaler fields of fp16 engines worth restoring (numbers only).
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_factor", "scale_window")


class DeepSpeedHandler(LayoutHandler):
    """A DeepSpeed engine with a ZeRO stage 1 or 2 optimizer (or no ZeRO: a plain wrapped optimizer)."""

    name = "deepspeed"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        if stage >= 3:
            raise ValueError("DeepSpeed ZeRO stage 3 engines are not supported by atorch.checkpoint; use the "
                             "'fsdp' optimization for fully sharded training, or ZeRO stage 1/2")
        self.zero = engine.optimizer if stage in (1, 2) else None
        self.names = {id(p): n for n, p in engine.module.named_parameters()}

    @property
    def has_optimizer(self) -> bool:
        return self.engine.optimizer is not None

    # -- model -------------------------------------------------------------------------
    def model_state(self) -> Dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        state = dict(self.engine.module.state_dict())
        if self.zero is None:
            return state
        for name, p in self.engine.module.named_parameters():
            # Low-precision training keeps the exact weights in the fp32 master copy.
            if p.requires_grad and p.dtype != torch.float32 and name in state:
                state[name] = safe_get_full_fp32_param(p)
        return state

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        params = dict(self.engine.module.named_parameters())
        with torch.no_grad():
            for name, value in self.engine.module.state_dict(keep_vars=True).items():
                value.copy_(state[name].to(value.dtype))
            if self.zero is not None:
                for name, p in params.items():
                    if p.requires_grad:
                        safe_set_full_fp32_param(p, state[name].to(torch.float32))

    # -- optimizer ---------------------------------------------------------------------
    def _groups(self) -> List[Tuple[Dict[str, Any], List[torch.nn.Parameter], Any]]:
        """(inner param group, its model parameters, its flat fp32 partition) per ZeRO group."""
        inner = self.zero.optimizer
        return [(group, list(self.zero.bit16_groups[i]), self.zero.single_partition_of_fp32_groups[i])
                for i, group in enumerate(inner.param_groups)]

    def _ensure_state(self) -> None:
        """Create the inner optimizer's state (lazily built at the first step) and link the fragments."""
        inner = self.zero.optimizer
        if not inner.state:
            # A zero-gradient, zero-lr step creates the state without changing any weight.
            lrs = [g["lr"] for g in inner.param_groups]
            for _, _, flat in self._groups():
                flat.grad = torch.zeros_like(flat)
            for g in inner.param_groups:
                g["lr"] = 0.0
            inner.step()
            for g, lr in zip(inner.param_groups, lrs):
                g["lr"] = lr
            for _, _, flat in self._groups():
                flat.grad = None
        self.zero._lazy_init_hp_params_optimizer_state()

    def _state_keys(self, flat: torch.Tensor) -> List[str]:
        state = self.zero.optimizer.state[flat]
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape)

    def optim_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        from deepspeed.utils import safe_get_full_optimizer_state

        if self.zero is None:
            raise ValueError("a DeepSpeed engine without ZeRO stage 1/2 has no supported optimizer state layout; "
                             "use ZeRO stage 1 or 2, or torch DDP")
        self._ensure_state()
        tensors: Dict[str, torch.Tensor] = {}
        values: Dict[str, Any] = {}
        for group, params, flat in self._groups():
            flat_state = self.zero.optimizer.state[flat]
            for p in params:
                name = self.names[id(p)]
                for key in self._state_keys(flat):
                    tensors[f"state.{name}.{key}"] = safe_get_full_optimizer_state(p, key)
                for key, v in flat_state.items():
                    if torch.is_tensor(v) and v.dim() == 0:
                        tensors[f"state.{name}.{key}"] = v.detach().clone()
                for key, v in group.items():
                    if key != "params":
                        values[f"param_groups.{name}.{key}"] = v
        return tensors, values

    def load_optim_state(self, tensors: Dict[str, torch.Tensor], values: Dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        self._ensure_state()
        for group, params, flat in self._groups():
            flat_state = self.zero.optimizer.state[flat]
            keys = self._state_keys(flat)
            for p in params:
                name = self.names[id(p)]
                for key in keys:
                    safe_set_full_optimizer_state(p, tensors[f"state.{name}.{key}"].to(torch.float32), key)
            # Scalars (Adam's step) are one per flat partition; every parameter of it saved the same value.
            first = self.names[id(params[0])]
            for key, v in flat_state.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    v.copy_(tensors[f"state.{first}.{key}"])
            for key in list(group):
                saved = values.get(f"param_groups.{first}.{key}")
                if key != "params" and saved is not None:
                    group[key] = saved

    # -- engine counters ---------------------------------------------------------------
    def extra_state(self) -> Dict[str, Any]:
        e = self.engine
        state: Dict[str, Any] = {k: getattr(e, k) for k in ("global_steps", "global_samples", "skipped_steps",
                                                              "micro_steps") if isinstance(getattr(e, k, None), int)}
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            state["loss_scaler"] = {f: float(getattr(scaler, f)) for f in _SCALER_FIELDS
                                    if isinstance(getattr(scaler, f, None), (int, float))}
        return state

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            if key in state:
                setattr(self.engine, key, int(state[key]))
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        for f, v in (state.get("loss_scaler") or {}).items():
            if scaler is not None and hasattr(scaler, f):
                setattr(scaler, f, type(getattr(scaler, f))(v))
