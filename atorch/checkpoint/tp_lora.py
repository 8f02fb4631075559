"""LoRA adapters kept as parameters of tensor-parallel layers: recorded in checkpoints, folded or exported on merge.

atorch's tensor-parallel LoRA (`atorch/tensor_parallel/lora.py`; peft cannot wrap sharded layers)
stores each adapter as `<layer>.lora_A` [r, in] and `<layer>.lora_B` [out, r] next to
`<layer>.weight`, and its scale alpha / r as a plain attribute of the layer, in no state dict.
A checkpoint records the scales (`adapters_of`, in meta.json); a merge then either folds the
adapters into the weights (W + scale * B @ A, what peft's `merge_and_unload` computes) or writes
them in peft's adapter format, which `PeftModel.from_pretrained(base_model, dir)` loads.
Found by duck typing (tensors named `lora_A`/`lora_B` and a number `lora_scaling`), so this
layer needs no import of tensor parallelism; peft's own layers hold module dicts there instead.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, cast

import torch
from torch import nn

from atorch.checkpoint.manifest import CheckpointError

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def adapters_of(model: nn.Module) -> Optional[Dict[str, Dict[str, float]]]:
    """{layer name: {"r": rank, "scaling": alpha / r}} of the tensor-parallel LoRA layers in `model`; None if none."""
    found: Dict[str, Dict[str, float]] = {}
    for name, module in model.named_modules():
        a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        scaling = getattr(module, "lora_scaling", None)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(scaling, (int, float)):
            found[name] = {"r": int(a.shape[0]), "scaling": float(scaling)}
    return found or None


def _adapter_pair(state: Dict[str, torch.Tensor], layer: str, ckpt_dir: str) -> "tuple[torch.Tensor, torch.Tensor]":
    """The (A, B) matrices of the adapter on `layer`."""
    try:
        return state[f"{layer}.lora_A"], state[f"{layer}.lora_B"]
    except KeyError:
        raise CheckpointError(f"{ckpt_dir}: meta.json records a LoRA adapter on {layer} but the checkpoint has no "
                              f"{layer}.lora_A / {layer}.lora_B") from None


def fold_adapters(state: Dict[str, torch.Tensor], adapters: Dict[str, Dict[str, float]],
                  ckpt_dir: str) -> Dict[str, torch.Tensor]:
    """`state` with every adapter folded into its layer's weight (computed in fp32, stored in the weight's dtype)."""
    out = dict(state)
    for layer, info in adapters.items():
        a, b = _adapter_pair(out, layer, ckpt_dir)
        del out[f"{layer}.lora_A"], out[f"{layer}.lora_B"]
        weight = out.get(f"{layer}.weight")
        if weight is None:
            raise CheckpointError(f"{ckpt_dir}: LoRA adapter on {layer} but no {layer}.weight to fold it into")
        delta = float(info["scaling"]) * (b.float() @ a.float())
        out[f"{layer}.weight"] = (weight.float() + delta).to(weight.dtype)
    return out


def save_peft_adapters(state: Dict[str, torch.Tensor], adapters: Dict[str, Dict[str, float]], hf_prefix: str,
                       out_dir: str, ckpt_dir: str) -> None:
    """The adapters alone, as peft writes them: adapter_config.json and adapter_model.safetensors with keys
    `base_model.model.<layer>.lora_A.weight` (layer names relative to the Hugging Face model)."""
    import peft
    from safetensors.torch import save_file

    ranks = {int(info["r"]) for info in adapters.values()}
    scalings = {float(info["scaling"]) for info in adapters.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise CheckpointError(f"{ckpt_dir}: the LoRA adapters have ranks {sorted(ranks)} and scales "
                              f"{sorted(scalings)}; one adapter_config.json holds one of each: merge with "
                              "lora='merge' instead")
    r, scaling = ranks.pop(), scalings.pop()
    tensors: Dict[str, torch.Tensor] = {}
    leaves = set()
    for layer in adapters:
        a, b = _adapter_pair(state, layer, ckpt_dir)
        name = layer[len(hf_prefix):] if hf_prefix and layer.startswith(hf_prefix) else layer
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        leaves.add(name.rpartition(".")[2])
    alpha = scaling * r
    # peft types lora_alpha as int; a float alpha (atorch allows one) works the same at run time.
    config = peft.LoraConfig(r=r, lora_alpha=cast(int, int(alpha) if alpha.is_integer() else alpha),
                             lora_dropout=0.0, target_modules=sorted(leaves), task_type="CAUSAL_LM")
    config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
