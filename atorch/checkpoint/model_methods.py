"""`model.save_parallelized(dir, merge_checkpoints=...)` / `model.from_parallelized(dir)` on the result model."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import types
import uuid
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from atorch.checkpoint import manifest as mf
from atorch.checkpoint.manifest import CheckpointError
from atorch.checkpoint.safe_load import tensor_entries
from atorch.checkpoint.save_load import (
    CheckpointState,
    TrainingObjects,
    _all_gather,
    _barrier,
    _broadcast,
    _dist,
    _quiet_single_process_dcp,
    _rank,
    check_keys,
    load_checkpoint,
    raise_checkpoint_errors,
    save_checkpoint,
)
from atorch.distributed import timeouts
from atorch.distributed.agreement import agree, agree_on_error


def save_parallelized(model: nn.Module, save_dir: str, merge_checkpoints: bool = False, **merge_kwargs: Any) -> str:
    """Save the weights of a parallelized `model` (call on every rank).

    `merge_checkpoints=False`: a sharded checkpoint (each rank its shard) in `save_dir`.
    `merge_checkpoints=True`: a Hugging Face model directory (config.json + safetensors), for
    `from_pretrained`; rank 0 merges a temporary sharded checkpoint while the other ranks wait
    for it however long it takes (not bounded by the collective timeout), and a merge failure is
    raised on every rank as the same exception. `merge_kwargs` go to `merge_checkpoint`
    (tokenizer, max_shard_size, lora, dtype).
    """
    mf.check_dir_arg("save_parallelized", "save_dir", save_dir)
    if not merge_checkpoints:
        return save_checkpoint(model, save_dir, save_optimizer=False, update_latest=False)
    from atorch.checkpoint.merge import check_merge_options, merge_checkpoint

    # Bad options raise on every rank, before the collective save.
    check_merge_options(merge_kwargs.get("lora", "merge"), merge_kwargs.get("max_shard_size", "2GB"),
                        merge_kwargs.get("dtype"), merge_kwargs.get("model_class"), save_dir,
                        func="save_parallelized", out_arg="save_dir")
    token = _broadcast(uuid.uuid4().hex[:8] if _rank() == 0 else None)
    sharded = f"{os.path.normpath(save_dir)}{mf.STAGING_MARK}sharded-{token}"
    save_checkpoint(model, sharded, save_optimizer=False, update_latest=False)
    failure: Optional[Exception] = None
    with _merge_wait_group() as group:
        if _rank() == 0:
            try:
                merge_checkpoint(sharded, save_dir, **merge_kwargs)
            except Exception as e:  # noqa: BLE001 - voted on below: every rank raises it
                failure = e
            shutil.rmtree(sharded, ignore_errors=True)
        # The other ranks wait here for as long as the merge takes, on a group whose timeout is not
        # the training's collective timeout.
        try:
            _barrier(group)
        except RuntimeError as e:
            raise RuntimeError(f"save_parallelized: rank {_rank()} stopped waiting for rank 0's merge into "
                               f"{save_dir!r}: a rank was lost (did rank 0 die while merging?): {e}") from e
        # Rank 0's failure is raised on every rank, as the same exception.
        agree(f"save_parallelized({save_dir!r}): merging the checkpoint", failure, group=group)
    return save_dir


@contextlib.contextmanager
def _merge_wait_group() -> Iterator[Optional[dist.ProcessGroup]]:
    """A gloo group of every rank whose collectives wait without a practical limit (None without a
    process group), destroyed on exit.

    The merge runs on rank 0 alone for as long as the model takes to write; under NCCL (and gloo) the
    default group's collectives give up after the collective timeout (NCCL's watchdog aborts the
    process), so the other ranks must not wait for it there.
    """
    if not _dist():
        yield None
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.MAX_TIMEOUT_S))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def from_parallelized(model: nn.Module, load_dir: str, strict: bool = True) -> Optional[CheckpointState]:
    """Load the weights `save_parallelized` wrote (either form) into `model`, in its current layout.

    An atorch checkpoint (or a directory whose `latest` names one) goes through
    `load_checkpoint` (weights only); a Hugging Face directory of safetensors is read with
    DCP's safetensors reader, so each rank reads only its shards. Returns the checkpoint
    state, or None for a Hugging Face directory.
    """
    mf.check_dir_arg("from_parallelized", "load_dir", load_dir)
    if mf.is_checkpoint(load_dir) or os.path.isfile(os.path.join(load_dir, mf.LATEST_NAME)):
        return load_checkpoint(model, load_dir, load_optimizer=False, load_rng=False, strict=strict)
    if os.path.isdir(load_dir) and any(n.endswith(".safetensors") for n in os.listdir(load_dir)):
        load_hf_weights(model, load_dir, strict=strict)
        return None
    raise CheckpointError(f"{load_dir}: neither an atorch checkpoint ({mf.MANIFEST_NAME}) nor a Hugging Face model "
                          "directory (*.safetensors)")


def load_hf_weights(model: nn.Module, hf_dir: str, strict: bool = True) -> None:
    """Load a Hugging Face safetensors directory into `model` in any layout (call on every rank).

    Keys and shapes are checked first (nothing is loaded on a mismatch). A weight the
    directory leaves out because it is tied to another (save_pretrained drops an LM head tied
    to the embedding) is filled through the tie.
    """
    mf.check_dir_arg("load_hf_weights", "hf_dir", hf_dir)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    handler = TrainingObjects.of(model).handler()
    targets = handler.model_state()
    entries = tensor_entries(HuggingFaceStorageReader(hf_dir).read_metadata())
    present = {_storage_key(v) for k, v in targets.items() if k in entries}
    to_load = {k: v for k, v in targets.items() if k in entries or _storage_key(v) not in present}
    # A pipeline stage holds some of the model: "unexpected" means held by no rank.
    known = set().union(*_all_gather(sorted(targets))) if _dist() else set(targets)
    problems = check_keys(to_load, entries, "", strict=strict, known=known, where=hf_dir)
    # Ranks may see different problems (a pipeline stage holds part of the model): all raise, before
    # any rank enters dcp.load's collectives.
    with agree_on_error(f"load_hf_weights({hf_dir!r}): checking the model against the folder"):
        mf.raise_problems(hf_dir, problems)
    with _quiet_single_process_dcp(), raise_checkpoint_errors():
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(hf_dir), no_dist=not _dist())
    handler.load_model_state(targets)
    _barrier()


def _storage_key(t: torch.Tensor) -> Tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.untyped_storage().data_ptr(), int(local.storage_offset()))


def attach_checkpoint_methods(result: Any) -> Any:
    """Give the result's model `save_parallelized` / `from_parallelized` methods; returns `result`."""
    # A module (a Hugging Face model has a `.model` attribute of its own) or an AutoAccelerateResult.
    model = result if isinstance(result, nn.Module) else getattr(result, "model", None)
    if isinstance(model, nn.Module):
        # Instance attributes (not a subclass) so DDP/FSDP/DeepSpeed wrappers keep their type.
        object.__setattr__(model, "save_parallelized", types.MethodType(save_parallelized, model))
        object.__setattr__(model, "from_parallelized", types.MethodType(from_parallelized, model))
    return result
