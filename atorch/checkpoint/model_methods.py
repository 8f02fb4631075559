"""`model.save_parallelized(dir, merge_checkpoints=...)` / `model.from_parallelized(dir)` on the result model."""

from __future__ import annotations

import os
import shutil
import types
import uuid
from typing import Any

from torch import nn

from atorch.checkpoint import manifest as mf
from atorch.checkpoint.save_load import CheckpointState, _barrier, _broadcast, _rank, load_checkpoint, save_checkpoint


def save_parallelized(model: nn.Module, save_dir: str, merge_checkpoints: bool = False, **merge_kwargs: Any) -> str:
    """Save the weights of a parallelized `model` (call on every rank).

    `merge_checkpoints=False`: a sharded checkpoint (each rank its shard) in `save_dir`.
    `merge_checkpoints=True`: a Hugging Face model directory (config.json + safetensors), for
    `from_pretrained`; rank 0 merges a temporary sharded checkpoint. `merge_kwargs` go to
    `merge_checkpoint` (tokenizer, max_shard_size, lora, dtype).
    """
    if not merge_checkpoints:
        return save_checkpoint(model, save_dir, save_optimizer=False, update_latest=False)
    from atorch.checkpoint.merge import merge_checkpoint

    token = _broadcast(uuid.uuid4().hex[:8] if _rank() == 0 else None)
    sharded = f"{os.path.normpath(save_dir)}{mf.STAGING_MARK}sharded-{token}"
    save_checkpoint(model, sharded, save_optimizer=False, update_latest=False)
    try:
        if _rank() == 0:
            merge_checkpoint(sharded, save_dir, **merge_kwargs)
    finally:
        _barrier()
        if _rank() == 0:
            shutil.rmtree(sharded, ignore_errors=True)
    return save_dir


def from_parallelized(model: nn.Module, load_dir: str, strict: bool = True) -> CheckpointState:
    """Load weights saved by `save_parallelized(..., merge_checkpoints=False)` (or any checkpoint) into `model`."""
    return load_checkpoint(model, load_dir, load_optimizer=False, load_rng=False, strict=strict)


def attach_checkpoint_methods(result: Any) -> Any:
    """Give the result's model `save_parallelized` / `from_parallelized` methods; returns `result`."""
    # A module (a Hugging Face model has a `.model` attribute of its own) or an AutoAccelerateResult.
    model = result if isinstance(result, nn.Module) else getattr(result, "model", None)
    if isinstance(model, nn.Module):
        # Instance attributes (not a subclass) so DDP/FSDP/DeepSpeed wrappers keep their type.
        object.__setattr__(model, "save_parallelized", types.MethodType(save_parallelized, model))
        object.__setattr__(model, "from_parallelized", types.MethodType(from_parallelized, model))
    return result
