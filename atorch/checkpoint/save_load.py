"""`save_checkpoint` / `load_checkpoint`: every rank its own shard, any layout in, any layout out.

A checkpoint directory holds
  dcp/            model and optimizer tensors (torch.distributed.checkpoint), keyed by HF names
  meta.json       step, data position, the dataset's length, lr scheduler, grad scaler, optimizer
                  hyperparameters, strategy, layout, model class (JSON, never pickle)
  rng/rank_N.json each rank's Python / NumPy / torch / CUDA generator states (and tensor-parallel dropout streams)
  config.json     the Hugging Face config, adapter_config.json for a LoRA model
  manifest.json   sizes and checksums (xxh3_128 or sha256) of all of the above, written last (see manifest.py)

With `async_save=True` the tensors are copied to host memory in the foreground and the rest of
the save runs on a background thread (see async_save.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from atorch.checkpoint import manifest as mf
from atorch.checkpoint.async_save import checkpointer
from atorch.checkpoint.hashing_writer import DATA_SUFFIX, HashingFileSystemWriter
from atorch.checkpoint.layout_handlers import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    LayoutHandler,
    TorchHandler,
    find_hf_config,
    find_hf_model,
    is_deepspeed_engine,
    peft_model_of,
    unwrap_model,
)
from atorch.checkpoint.manifest import CheckpointError
from atorch.checkpoint.safe_load import SafeFileSystemReader, load_dcp_metadata, tensor_entries
from atorch.checkpoint.state import (
    DataPosition,
    convert_position,
    dataset_change_message,
    from_json_value,
    len_or_none,
    loader_global_batch_size,
    parallel_streams_state,
    position_in_epoch,
    resume_dataloader,
    rng_state,
    set_parallel_streams_state,
    set_rng_state,
    to_json_value,
)
from atorch.checkpoint.tokenizer_files import check_tokenizer, record_tokenizer
from atorch.checkpoint.tp_lora import adapters_of
from atorch.data.samplers import SET_EPOCH_CALLED
from atorch.distributed.agreement import agree_on_error, agree_on_values
from atorch.utils.memory import innermost_optimizer

if TYPE_CHECKING:
    from atorch.distributed.mesh import ParallelMesh
    from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer

logger = logging.getLogger(__name__)

DCP_DIR = "dcp"
META_NAME = "meta.json"
RNG_DIR = "rng"
# Key of the tensor-parallel dropout streams in a rank's RNG file.
PARALLEL_STREAMS = "parallel_streams"
CONFIG_NAME = "config.json"
# meta.json's key of the samples in the saving run's dataset (absent from checkpoints of older atorch versions).
DATASET_LENGTH = "dataset_length"
ADAPTER_CONFIG_NAME = "adapter_config.json"

# Test hook: called on every rank after all shards are written and before the manifest
# exists (the crash-safety test kills a process here). Never set in production code.
_before_commit_hook: Optional[Callable[[str], None]] = None


@dataclass
class TrainingObjects:
    """What a checkpoint saves, taken from an `AutoAccelerateResult` or given one by one."""

    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    lr_scheduler: Any = None
    grad_scaler: Any = None
    engine: Any = None
    dataloader: Any = None
    global_batch_size: Optional[int] = None
    strategy: Optional[List[str]] = None
    # Dataloader items one optimizer step consumes (DeepSpeed 3D's dataloader yields micro-batches).
    batches_per_step: int = 1
    # The strategy's parallel groups (recorded in the checkpoint's metadata); None: atorch's default layout.
    parallel: Optional[ParallelMesh] = None
    # Tensor parallelism's dropout streams, saved with each rank's RNG states.
    randomizer: Optional[MultiDimParallelRandomizer] = None
    # (step, DataPosition) of the last resume (AutoAccelerateResult.data_origin), or None.
    data_origin: Optional[Tuple[Optional[int], DataPosition]] = None

    @classmethod
    def of(cls, target: Any, optimizer: Any = None, lr_scheduler: Any = None) -> "TrainingObjects":
        from atorch.auto.result import AutoAccelerateResult

        if isinstance(target, AutoAccelerateResult):
            engine = target.engine
            # DeepSpeed 3D's dataloader yields micro-batches: one step takes gradient_accumulation_steps.
            per_step = target.gradient_accumulation_steps if target.micro_batch_size is not None else 1
            return cls(model=target.model, optimizer=optimizer or target.optim,
                       lr_scheduler=lr_scheduler or target.lr_scheduler or getattr(engine, "lr_scheduler", None),
                       grad_scaler=target.grad_scaler, engine=engine, dataloader=target.dataloader,
                       global_batch_size=target.global_batch_size, strategy=list(target.applied) or None,
                       batches_per_step=per_step, parallel=target.parallel, randomizer=target.randomizer,
                       data_origin=getattr(target, "data_origin", None))
        if isinstance(target, nn.Module):
            if optimizer is not None and not callable(getattr(optimizer, "state_dict", None)):
                raise TypeError(f"optimizer={optimizer!r} must be the torch.optim.Optimizer training the model "
                                "(or None)")
            engine = target if is_deepspeed_engine(target) else None
            return cls(model=target, optimizer=optimizer, engine=engine,
                       lr_scheduler=lr_scheduler or getattr(engine, "lr_scheduler", None))
        raise TypeError(f"save/load target is a {type(target).__name__}; pass the AutoAccelerateResult that "
                        "auto_accelerate returned, or an nn.Module (with optimizer=/lr_scheduler= as needed)")

    def item_global_batch_size(self) -> Optional[int]:
        """Samples in one dataloader item over all data ranks (the unit of `DataPosition.batches_in_epoch`)."""
        if self.global_batch_size is not None:
            return self.global_batch_size // self.batches_per_step
        return loader_global_batch_size(self.dataloader) if self.dataloader is not None else None

    def handler(self, optimizer_for: Optional[str] = None) -> LayoutHandler:
        """The layout handler of these objects. `optimizer_for` ("save_checkpoint" / "load_checkpoint", where the
        optimizer's state is to be saved or restored): a DeepSpeed engine whose optimizer no handler can read
        raises ValueError rather than have its state dropped silently."""
        if self.engine is not None:
            from atorch.checkpoint.deepspeed_layout import DeepSpeedHandler

            handler = DeepSpeedHandler(self.engine)
            if optimizer_for is not None:
                handler.check_optimizer_readable(optimizer_for)
            return handler
        return TorchHandler(self.model, self.optimizer)


@dataclass
class CheckpointState:
    """What `load_checkpoint` restored, and what the training loop needs to go on."""

    path: str
    step: Optional[int]
    # Where the data stream stands, counted in this run's global batches (they may differ from the saving run's).
    data_position: Optional[DataPosition]
    extra: Dict[str, Any] = field(default_factory=dict)
    strategy: Optional[List[str]] = None
    saved_world_size: int = 1
    rng_restored: bool = False
    optimizer_restored: bool = False
    # The result's dataloader, started at `data_position` (None without a dataloader or position); when
    # loading into an AutoAccelerateResult it is also `result.dataloader` from then on.
    dataloader: Any = None


# -- process-group helpers (every one is a no-op in a single process) ----------------------

def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    # Not atorch.distributed.rank(): without a process group a save or load is a single-process one
    # (this process does rank 0's part), whatever RANK the launcher set.
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


# `group`: None is the default group; the background part of an async save passes its own.

def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if _dist():
        dist.barrier(group=group)


def _broadcast(value: Any, group: Optional[dist.ProcessGroup] = None) -> Any:
    if not _dist():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_gather(value: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    if not _dist():
        return [value]
    out: List[Any] = [None] * _world()
    dist.all_gather_object(out, value, group=group)
    return out


def _parallel_dims(parallel: Optional[ParallelMesh]) -> Optional[List[List[Any]]]:
    from atorch import distributed as adist

    if parallel is None:
        parallel = adist.default_parallel_mesh()
    if parallel is None:
        return None
    return [[n, s] for n, s in parallel.layout.dims]


# -- argument checks (local: raised on every rank given the mistake, then voted on) -----------

def _check_flag(func: str, name: str, value: Any) -> None:
    """Raise TypeError unless `value` is a bool: a string such as "no" would otherwise count as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{func}: {name}={value!r} ({type(value).__name__}) must be True or False")


def _check_save_args(path: Any, *, step: Any, data_position: Any, keep_last: Any, save_optimizer: Any,
                     update_latest: Any, async_save: Any, checksum: Any, tokenizer: Any) -> None:
    """`save_checkpoint`'s checks of its arguments' types and values (no filesystem access but the tokenizer's)."""
    mf.check_dir_arg("save_checkpoint", "path", path)
    if not path:
        raise ValueError("path is empty; pass the checkpoint directory, e.g. 'ckpt/step_100'")
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}; it must be an int >= 1, or None to keep every checkpoint")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step={step!r} must be a non-negative int (the optimizer step), or None")
    if data_position is not None and not isinstance(data_position, DataPosition):
        raise ValueError(f"data_position={data_position!r} must be an atorch.checkpoint.DataPosition")
    for name, flag in (("save_optimizer", save_optimizer), ("update_latest", update_latest),
                       ("async_save", async_save)):
        _check_flag("save_checkpoint", name, flag)
    mf.check_checksum(checksum)
    if tokenizer is not None:
        check_tokenizer(tokenizer)


def _check_optimizer_holds_model_parameters(func: str, objs: TrainingObjects) -> None:
    """ValueError when the optimizer holds a parameter that is not one of the model's (by identity), e.g. the model
    was rebuilt after its optimizer was created: torch's state-dict code then fails with a bare `KeyError: 0`.

    Local (no collective): called inside the argument checks that every rank votes on. A DeepSpeed engine's
    optimizer steps its own fp32 partitions, not the model's parameters: it is left to its handler."""
    if objs.optimizer is None or objs.engine is not None:
        return
    own = {id(p) for p in objs.model.parameters()}
    foreign = [(g, i, tuple(p.shape)) for g, group in enumerate(innermost_optimizer(objs.optimizer).param_groups)
               for i, p in enumerate(group["params"]) if id(p) not in own]
    if foreign:
        g, i, shape = foreign[0]
        verb = "load into" if func == "load_checkpoint" else "save"
        raise ValueError(f"{func}: the optimizer holds {len(foreign)} parameter(s) that are not the model's (e.g. "
                         f"param_groups[{g}]['params'][{i}], shape {list(shape)}): it was built over another "
                         "model's parameters (was the model rebuilt after the optimizer was created?); build the "
                         f"optimizer from the model you {verb}, e.g. torch.optim.AdamW(model.parameters())"
                         + (", or pass load_optimizer=False to load the weights only" if verb == "load into" else ""))


def _optimizer_flag(flag: bool, handler: LayoutHandler) -> str:
    """`save_optimizer` / `load_optimizer` as the ranks compare it: True on a rank whose target has no optimizer
    does nothing there, which is as different from the other ranks as False (a sharded optimizer's state
    would be saved or restored on some ranks only)."""
    return repr(flag) if not flag or handler.has_optimizer else "True, but the target has no optimizer"


# -- save ----------------------------------------------------------------------------------

def save_checkpoint(target: Any, path: str, *, step: Optional[int] = None,
                    data_position: Optional[DataPosition] = None, extra: Optional[Dict[str, Any]] = None,
                    keep_last: Optional[int] = None, save_optimizer: bool = True, update_latest: bool = True,
                    optimizer: Any = None, lr_scheduler: Any = None, async_save: bool = False,
                    checksum: str = mf.DEFAULT_CHECKSUM, tokenizer: Any = None) -> str:
    """Save model, optimizer, lr scheduler, grad scaler, RNG states, step and data position to `path`.

    Call on every rank, with the same `path`, `step`, `data_position`, `keep_last`, `save_optimizer`,
    `update_latest`, `async_save` and `checksum` (and an optimizer on every rank or none): they are
    compared across ranks first, and a difference raises the same ValueError on every rank, naming the
    argument and each rank's value (ranks given different ones would run different collectives, or
    silently save rank 0's). `extra` and `tokenizer` are rank 0's and not compared (`extra` may hold
    per-rank values such as timings, of which the checkpoint keeps rank 0's). A path inside an existing
    checkpoint is refused. Each rank writes its own shards; the directory appears under `path`
    only when complete, `<parent>/latest` then names it, and with `keep_last=N` only the N
    most recently saved checkpoints in the parent directory are kept (by commit time, not step: a run
    restarted from an earlier checkpoint keeps its own new ones and rotates out the abandoned higher
    steps; the one `latest` names is never deleted). `data_position` defaults to `step`
    optimizer steps into the result's dataloader (epoch = step // len(dataloader), the loop
    calling `sampler.set_epoch(epoch)` at each epoch). `extra` is any JSON data, returned by
    `load_checkpoint`. `save_optimizer=False` leaves the optimizer's state out: the checkpoint then
    loads with `load_optimizer=False` only, which restores no lr scheduler or grad scaler either
    (see `load_checkpoint`). `optimizer` / `lr_scheduler` are for a bare `nn.Module` target. Every rank
    must see the same filesystem (as DCP assumes). `checksum`: the manifest's per-file checksum,
    "xxh3_128" (fast corruption detection, the default) or "sha256". `tokenizer` (a tokenizer
    object or a directory of its files) is recorded with the checkpoint, and `merge_checkpoint`
    copies it into the Hugging Face folder.

    `async_save=True` returns once the tensors are copied to host memory (a copy that fails on one
    rank raises here on every rank, and nothing goes to the background); the write, fsync,
    checksums, manifest, rename, `latest` and rotation go on in the background, and until they
    finish the checkpoint does not exist (a crash leaves the previous one as `latest`). The next
    save (or `wait_for_checkpoint()`) waits for it and raises its error if it failed; call
    `wait_for_checkpoint()` before `destroy_process_group()`. Returns the checkpoint directory
    (the path it will have once committed).
    """
    # One save at a time: a previous async save must be committed (or its error raised, on every rank) first;
    # the path checks below then see what it committed.
    checkpointer().wait()
    objs, handler, final_dir = _agree_on_save_args(
        target, path, optimizer=optimizer, lr_scheduler=lr_scheduler, step=step, data_position=data_position,
        keep_last=keep_last, save_optimizer=save_optimizer, update_latest=update_latest, async_save=async_save,
        checksum=checksum, tokenizer=tokenizer)
    data_position = _data_position_to_save(objs, step, data_position)
    small_state = _small_state(objs, handler, extra)
    staging = _create_staging(final_dir)
    plan = _SavePlan(final_dir=final_dir, staging=staging, step=step, update_latest=update_latest,
                     keep_last=keep_last, checksum=checksum, rank=_rank(), world=_world())
    # A failure from here on (agreed, so raised on every rank at the same point) removes the staging directory.
    with _removing_staging_on_error(plan.staging, plan.rank):
        has_optimizer = save_optimizer and handler.has_optimizer
        tensors, optim_values, optim_groups = _gather_state(handler, has_optimizer)
        _write_rng_and_metadata(plan, objs, handler, data_position, small_state, has_optimizer,
                                {"values": optim_values, "param_groups": optim_groups},
                                tokenizer)
        if async_save:
            _write_in_background(plan, tensors)
        else:
            _write_and_commit(plan, tensors, None)
    return final_dir


@dataclass(frozen=True)
class _SavePlan:
    """Where one save writes and how it commits, fixed once its arguments are agreed on."""

    final_dir: str
    staging: str
    step: Optional[int]
    update_latest: bool
    keep_last: Optional[int]
    checksum: str
    rank: int
    world: int

    @property
    def parent(self) -> str:
        """The directory holding the checkpoint, its `latest` pointer and the checkpoints `keep_last` rotates."""
        return os.path.dirname(os.path.abspath(self.final_dir))


def _agree_on_save_args(target: Any, path: Any, *, optimizer: Any, lr_scheduler: Any, step: Any, data_position: Any,
                        keep_last: Any, save_optimizer: Any, update_latest: Any, async_save: Any, checksum: Any,
                        tokenizer: Any) -> Tuple[TrainingObjects, LayoutHandler, str]:
    """Check `save_checkpoint`'s arguments on every rank, then agree: (objects, layout handler, checkpoint dir).

    Input mistakes raise here, on every rank, before any other collective: the local checks are voted on,
    then what must be the same on every rank is compared (a mistake only some ranks make raises everywhere).
    """
    with agree_on_error("save_checkpoint: checking the arguments"):
        objs = TrainingObjects.of(target, optimizer, lr_scheduler)
        _check_save_args(path, step=step, data_position=data_position, keep_last=keep_last,
                         save_optimizer=save_optimizer, update_latest=update_latest, async_save=async_save,
                         checksum=checksum, tokenizer=tokenizer)
        final_dir = os.path.normpath(path)
        _check_save_path(final_dir)
        handler = objs.handler("save_checkpoint" if save_optimizer else None)
        if save_optimizer is True:
            _check_optimizer_holds_model_parameters("save_checkpoint", objs)
    # Named without the path: the message must be the same on every rank, and the path may be what differs.
    # The path as given, not made absolute: nodes may run in different working directories or mount the
    # shared filesystem at different places, and only a path that differs as given is a mistake.
    agree_on_values("save_checkpoint", {
        "path": os.fspath(path), "step": repr(step), "data_position": repr(data_position),
        "keep_last": repr(keep_last), "save_optimizer": _optimizer_flag(save_optimizer, handler),
        "update_latest": repr(update_latest), "async_save": repr(async_save), "checksum": repr(checksum)})
    return objs, handler, final_dir


def _data_position_to_save(objs: TrainingObjects, step: Optional[int], data_position: Optional[DataPosition]
                           ) -> Optional[DataPosition]:
    """`data_position` as given, else (with a step and a dataloader) `step` optimizer steps into the dataloader,
    with the epoch its sampler was last set to (which decides the resumed epoch's order)."""
    if data_position is None and step is not None and objs.dataloader is not None:
        data_position = _position_at_step(objs, step)
        sampler_epoch = _sampler_epoch(objs.dataloader)
        if sampler_epoch is not None and data_position.batches_in_epoch == 0 \
                and sampler_epoch == data_position.epoch - 1 and _sets_epochs(objs.dataloader):
            # Saved right after an epoch's last batch, before the loop set the sampler to the next epoch:
            # the resume starts that epoch, in the order the loop's next set_epoch would have given it
            # (recording the finished epoch's made the resume replay its order).
            sampler_epoch += 1
        data_position = dataclasses.replace(data_position, sampler_epoch=sampler_epoch)
    return data_position


def _sets_epochs(dataloader: Any) -> bool:
    """Whether the loop sets the sampler's epoch: `set_epoch` was called on a sampler auto_accelerate built
    (`record_set_epoch`); for another sampler, assumed (the documented loop calls it at every epoch)."""
    called = getattr(getattr(dataloader, "sampler", None), SET_EPOCH_CALLED, None)
    return True if called is None else bool(called)


def _small_state(objs: TrainingObjects, handler: LayoutHandler, extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """`extra`, the lr scheduler's, grad scaler's and engine's states as JSON data (meta.json's small state).

    Every rank encodes the small state now, so a value JSON cannot hold raises everywhere, not
    on rank 0 alone while the others wait in a collective.
    """
    return {"extra": to_json_value(dict(extra or {}), "extra"),
            "lr_scheduler": _stateful_json(objs.lr_scheduler, "lr_scheduler"),
            "grad_scaler": _stateful_json(objs.grad_scaler, "grad_scaler"),
            "engine": to_json_value(handler.extra_state(), "engine")}


def _create_staging(final_dir: str) -> str:
    """Create the staging directory every rank writes into (its name, shared by rank 0, is unique to this save)."""
    rank = _rank()
    token = _broadcast(uuid.uuid4().hex[:12] if rank == 0 else None)
    staging = mf.staging_dir(final_dir, token)
    # Each local step ends in a vote instead of a barrier: a failure on one rank raises the same
    # exception on every rank, and no rank waits for one that has given up.
    with agree_on_error(f"save_checkpoint({final_dir!r}): creating the staging directory"):
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(final_dir)), exist_ok=True)
            mf.remove_stale_staging(final_dir)
            os.makedirs(os.path.join(staging, RNG_DIR))
    return staging


def _gather_state(handler: LayoutHandler, has_optimizer: bool
                  ) -> Tuple[Dict[str, Any], Dict[str, Any], List[List[str]]]:
    """This rank's model (and optimizer) tensors keyed as in the checkpoint, every rank's optimizer
    hyperparameters and the names in each parameter group (by group index, merged over the ranks; a collective
    when `has_optimizer`, which every rank agreed on)."""
    tensors = {MODEL_PREFIX + k: v for k, v in handler.model_state().items()}
    optim_values: Dict[str, Any] = {}
    optim_groups: List[List[str]] = []
    if has_optimizer:
        optim_tensors, local_values = handler.optim_state()
        tensors.update({OPTIM_PREFIX + k: v for k, v in optim_tensors.items()})
        # A sharded optimizer (ZeRO-1, pipeline stages) knows only its own parameters'
        # hyperparameters: merge all ranks'.
        gathered = _all_gather((to_json_value(local_values, "optimizer"), handler.param_group_names()))
        for values, _ in gathered:
            optim_values.update(values)
        optim_groups = merge_param_groups(gathered)
    return tensors, optim_values, optim_groups


def merge_param_groups(per_rank: List[Tuple[Dict[str, Any], List[List[str]]]]) -> List[List[str]]:
    """One list of parameter names per optimizer group, merged over the ranks' (values, groups): each rank's
    flattened hyperparameters (`param_groups.<name>.<key>`) and the names in each of its groups.

    Ranks with as many groups as each other are merged by index. A pipeline stage can have fewer: an
    `optim_param_func` that leaves out a group with no parameter on this stage (the embedding's own learning
    rate on a stage without the embedding; DeepSpeed refuses empty groups). By index, the later stages' groups
    would then be merged into the wrong ones, and loading the checkpoint into another layout (one process, a
    merge) refused as "grouped differently" a model grouped exactly as it was. So when the counts differ,
    a group joins the merged group with the same hyperparameters (the first such one it has not joined yet);
    a group whose hyperparameters no merged group has starts a new one."""
    counts = {len(groups) for _, groups in per_rank}
    merged: List[List[str]] = []
    if len(counts) <= 1:
        for _, groups in per_rank:
            merged += [[] for _ in range(len(groups) - len(merged))]
            for into, names in zip(merged, groups):
                into += [n for n in names if n not in into]
        return merged
    settings: List[Optional[str]] = []     # each merged group's hyperparameters (JSON), None when unknown
    for values, groups in per_rank:
        joined: Set[int] = set()          # merged groups this rank's groups have joined
        for names in groups:
            if not names:
                continue                   # an empty group: nothing to record
            key = _group_settings(values, names)
            index = next((i for i, k in enumerate(settings) if key is not None and k == key and i not in joined),
                         None)
            if index is None:
                merged.append([])
                settings.append(key)
                index = len(merged) - 1
            joined.add(index)
            merged[index] += [n for n in names if n not in merged[index]]
    return merged


def _group_settings(values: Dict[str, Any], names: List[str]) -> Optional[str]:
    """A group's hyperparameters as JSON, from the first of its parameters that has them in `values`; None when
    none has."""
    for name in names:
        prefix = f"param_groups.{name}."
        found = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        if found:
            return json.dumps(found, sort_keys=True, default=str)
    return None


def _write_rng_and_metadata(plan: _SavePlan, objs: TrainingObjects, handler: LayoutHandler,
                            data_position: Optional[DataPosition], small_state: Dict[str, Any], has_optimizer: bool,
                            optim_meta: Dict[str, Any], tokenizer: Any) -> None:
    """Write this rank's RNG states, and on rank 0 meta.json, the model's configs and the tokenizer (voted on)."""
    with agree_on_error(f"save_checkpoint({plan.final_dir!r}): writing RNG states and metadata"):
        _write_json(os.path.join(plan.staging, RNG_DIR, f"rank_{plan.rank:05d}.json"), _rank_rng_state(objs))
        if plan.rank == 0:
            meta = _meta(objs, handler, plan.step, data_position, small_state, has_optimizer, optim_meta,
                         plan.world)
            _write_json(os.path.join(plan.staging, META_NAME), meta)
            _write_model_configs(objs.model, plan.staging)
            if tokenizer is not None:
                record_tokenizer(tokenizer, plan.staging)


def _write_in_background(plan: _SavePlan, tensors: Dict[str, Any]) -> None:
    """An async save's foreground part: copy the tensors to host memory, then hand the write to the background."""
    saver = checkpointer()
    group = saver.background_group()
    # Voted like every local step: a rank that cannot copy its tensors (host memory exhausted)
    # makes every rank raise here, before any rank hands its write to the background.
    with agree_on_error(f"save_checkpoint({plan.final_dir!r}): copying the tensors to host memory"):
        staged = saver.stage(tensors)
    del tensors

    def in_background() -> None:
        with _removing_staging_on_error(plan.staging, plan.rank):
            _write_and_commit(plan, staged, group)

    saver.submit(in_background)


def _write_and_commit(plan: _SavePlan, tensors: Dict[str, Any], group: Optional[dist.ProcessGroup]) -> None:
    """Write the tensors, checksum every file, and on rank 0 commit the manifest, `latest` and the rotation.

    Collectives here run on `group` only: None (the default group) in a synchronous save, the
    background gloo group in an async one (the training step owns the default group then).
    Every local step ends in a vote on that group, so a failure on one rank (in the
    background too) raises the same error, naming the rank, on every rank at once.
    """
    # The data files are checksummed while DCP writes them (no second read of the state).
    written = _dcp_save(tensors, os.path.join(plan.staging, DCP_DIR), group, plan.checksum)
    del tensors
    with _agreed(plan, "writing the tensors", group):
        if _before_commit_hook is not None:
            _before_commit_hook(plan.staging)
    names, records = _record_files(plan, written, group)
    with _agreed(plan, "committing", group):
        unrecorded = sorted(set(names) - set(records))
        if unrecorded:
            raise CheckpointError(f"{plan.staging}: no checksum for {unrecorded[:5]}; a file appeared during the save")
        if plan.rank == 0:
            _commit(plan, records)
    _barrier(group)


def _agreed(plan: _SavePlan, what: str, group: Optional[dist.ProcessGroup]) -> Any:
    """`agree_on_error` for one local step of writing the checkpoint, voted on `group`."""
    return agree_on_error(f"save_checkpoint({plan.final_dir!r}): {what}", group=group)


def _record_files(plan: _SavePlan, written: Dict[str, mf.FileRecord], group: Optional[dist.ProcessGroup]
                  ) -> Tuple[List[str], Dict[str, mf.FileRecord]]:
    """The staging directory's files (listed by rank 0) and every rank's records of them: each rank fsyncs and
    hashes an interleaved share of the small files."""
    names = _broadcast(mf.list_files(plan.staging) if plan.rank == 0 else None, group)
    with _agreed(plan, "hashing the files", group):
        # Data files are hashed by the rank that wrote them (any rank's, not only this one's).
        small = [n for n in names[plan.rank::plan.world] if not n.endswith(DATA_SUFFIX)]
        own_records = {**written, **mf.record_files(plan.staging, small, plan.checksum)}
    records: Dict[str, mf.FileRecord] = {}
    for part in _all_gather(own_records, group):
        records.update(part)
    return names, records


def _commit(plan: _SavePlan, records: Dict[str, mf.FileRecord]) -> None:
    """Rank 0: write the manifest and rename the staging directory, then point `latest` at it and rotate."""
    mf.commit(plan.staging, plan.final_dir, mf.Manifest(files=records, step=plan.step))
    if plan.update_latest:
        mf.write_latest(plan.parent, os.path.basename(plan.final_dir))
    if plan.keep_last is not None:
        mf.rotate(plan.parent, plan.keep_last, protect=[plan.final_dir])


@contextlib.contextmanager
def _removing_staging_on_error(staging: str, rank: int) -> Iterator[None]:
    """Rank 0 deletes the staging directory of a save that failed (on every rank: the failures are agreed)."""
    try:
        yield
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _sampler_epoch(dataloader: Any) -> Optional[int]:
    """The epoch the dataloader's sampler was last set to (`set_epoch`), None for a sampler without one."""
    sampler = getattr(dataloader, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    return epoch if hasattr(sampler, "set_epoch") and isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _position_at_step(objs: TrainingObjects, step: int) -> DataPosition:
    """Where the data stream stands after `step` optimizer steps (one or `batches_per_step` batches each).

    After a resume, counted from the resumed position (`data_origin`) in this run's batches: the
    steps before it may have been of another global batch size, so `step` x this run's batches
    from the start would put the position elsewhere in the epoch."""
    # A resumed loader's len() is what is left of the resumed epoch; positions count whole epochs.
    per_epoch = getattr(objs.dataloader, "batches_per_epoch", None) or len_or_none(objs.dataloader)
    batch = objs.item_global_batch_size()
    start_step, start = objs.data_origin or (None, None)
    if start_step is not None and start is not None and start_step <= step:
        done = start.batches_in_epoch + (step - start_step) * objs.batches_per_step
        return DataPosition.after_steps(done, per_epoch, epoch=start.epoch, global_batch_size=batch)
    return DataPosition.after_steps(step * objs.batches_per_step, per_epoch, global_batch_size=batch)


def _rank_rng_state(objs: TrainingObjects) -> Dict[str, Any]:
    """This rank's generator states, with the tensor-parallel dropout streams when there are any."""
    state = rng_state()
    if objs.randomizer is not None:
        state[PARALLEL_STREAMS] = parallel_streams_state(objs.randomizer)
    return state


def _set_rank_rng_state(objs: TrainingObjects, state: Dict[str, Any], ckpt_dir: str) -> None:
    """Restore `_rank_rng_state`; a checkpoint saved without dropout streams leaves them as they are."""
    set_rng_state(state)
    if objs.randomizer is None:
        return
    if PARALLEL_STREAMS in state:
        set_parallel_streams_state(objs.randomizer, state[PARALLEL_STREAMS])
    else:
        logger.warning("%s: the checkpoint has no tensor-parallel dropout streams (saved without tensor parallelism "
                       "or by an older atorch); they go on from their current state", ckpt_dir)


def _check_save_path(final_dir: str) -> None:
    """Refuse (before any collective) a path under a file, onto a file, inside a checkpoint, or onto a
    directory that holds something other than a checkpoint (the commit replaces the whole directory)."""
    if os.path.exists(final_dir) and not os.path.isdir(final_dir):
        raise ValueError(f"path={final_dir!r} is an existing file; a checkpoint is a directory")
    if os.path.isdir(final_dir) and not mf.is_checkpoint(final_dir):
        contents = sorted(os.listdir(final_dir))
        if contents:
            raise ValueError(f"path={final_dir!r} is an existing directory that is not a checkpoint (it holds "
                             f"{contents[:5]}{' ...' if len(contents) > 5 else ''}); saving would replace it and "
                             "delete those files. Save into a new directory, e.g. "
                             f"{os.path.join(final_dir, 'step_100')!r}")
    enclosing = mf.enclosing_checkpoint(final_dir)
    if enclosing is not None:
        raise ValueError(f"path={final_dir!r} is inside the checkpoint {enclosing} (it holds {mf.MANIFEST_NAME}); "
                         "saving there would put files and a 'latest' pointer among that checkpoint's files. Save "
                         f"next to it instead, e.g. {os.path.join(os.path.dirname(enclosing), 'step_100')!r}")
    ancestor = os.path.dirname(os.path.abspath(final_dir))
    while ancestor and not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if ancestor and not os.path.isdir(ancestor):
        raise ValueError(f"path={final_dir!r} lies under {ancestor!r}, which is a file, not a directory")


@contextlib.contextmanager
def _quiet_single_process_dcp():
    # DCP warns on every call without a process group; one process is a supported case here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp_save(tensors: Dict[str, torch.Tensor], dcp_dir: str, group: Optional[dist.ProcessGroup] = None,
              checksum: str = mf.DEFAULT_CHECKSUM) -> Dict[str, mf.FileRecord]:
    """Write the tensors with DCP (fsynced); returns the records of this rank's data files, relative
    to the checkpoint directory (the parent of `dcp_dir`)."""
    import torch.distributed.checkpoint as dcp

    writer = HashingFileSystemWriter(dcp_dir, checksum, single_file_per_rank=True, sync_files=True, overwrite=True)
    with _quiet_single_process_dcp():
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not _dist())
    return writer.records(os.path.dirname(os.path.normpath(dcp_dir)))


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def _qualname(obj: Any) -> Optional[str]:
    if obj is None:
        return None
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _model_class_name(model: nn.Module) -> Optional[str]:
    """The model's class as `_qualname`, or the transformers class it derives from where a wrapper swapped the
    instance's class for a subclass (FSDP2's `FSDP<Name>`, tensor parallelism's `SliceLogits<Name>`): merge
    imports the recorded class by name, and only from transformers."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return _user_class_name(model)
    if isinstance(model, PreTrainedModel):
        for cls in type(model).__mro__:
            if cls.__module__.startswith("transformers.") and issubclass(cls, PreTrainedModel):
                return _qualname(cls)
    return _user_class_name(model)


def _user_class_name(model: nn.Module) -> Optional[str]:
    """The user's class of a model that is not a transformers model, under DDP / DeepSpeed / compile wrappers,
    peft's PeftModel, and FSDP2's swapped-in `FSDP<Name>` subclass."""
    from torch.distributed.fsdp import FSDPModule

    root = unwrap_model(model)
    peft = peft_model_of(root)
    if peft is not None:
        root = cast(Any, peft).get_base_model()
    return _qualname(next(c for c in type(root).__mro__ if not issubclass(c, FSDPModule)))


def _meta(objs: TrainingObjects, handler: LayoutHandler, step: Optional[int], position: Optional[DataPosition],
          small_state: Dict[str, Any], has_optimizer: bool, optim_meta: Dict[str, Any], world: int
          ) -> Dict[str, Any]:
    """meta.json: everything but tensors and RNG states (all values already JSON data). `optim_meta`: the
    optimizer's hyperparameters (`values`) and the parameter names of each of its groups (`param_groups`)."""
    hf_model, hf_prefix = find_hf_model(objs.model)
    hf_config = find_hf_config(objs.model)
    return {
        "format": mf.FORMAT_NAME, "version": mf.FORMAT_VERSION, "step": step,
        "data_position": position.to_json() if position is not None else None,
        DATASET_LENGTH: _dataset_length(objs.dataloader),
        "world_size": world, "parallel_dims": _parallel_dims(objs.parallel), "layout": handler.name,
        "strategy": objs.strategy,
        "model": {"class": _model_class_name(hf_model if hf_model is not None else objs.model),
                  "hf_prefix": hf_prefix, "has_config": hf_config is not None, **_lora_meta(objs.model)},
        "has_optimizer": has_optimizer,
        "optimizer": {"class": _qualname(objs.optimizer), **optim_meta} if has_optimizer else None,
        **small_state, "torch_version": torch.__version__, "created": time.time(),
    }


def _dataset_length(dataloader: Any) -> Optional[int]:
    """len() of the dataloader's dataset, which `load_checkpoint` compares with the resuming run's; None when
    unknown (no dataloader, an iterable dataset). The dataset's length, not the sampler's: a
    `DistributedSampler` pads its epoch to a multiple of the data-parallel size, which may change on resume."""
    return len_or_none(getattr(dataloader, "dataset", None)) if dataloader is not None else None


def _lora_meta(model: nn.Module) -> Dict[str, Any]:
    """meta.json's record of the model's LoRA adapters: peft's active adapter, or tensor-parallel LoRA's
    {layer: {"r", "scaling"}} (what a merge needs to fold them); None for what the model does not have."""
    peft = peft_model_of(model)
    return {"peft_adapter": getattr(peft, "active_adapter", None) if peft is not None else None,
            "tp_lora": adapters_of(model)}


def _lora_kind(model_meta: Dict[str, Any]) -> Optional[str]:
    """"peft", "tensor-parallel" or None: which LoRA adapters a `_lora_meta` record names."""
    return "peft" if model_meta.get("peft_adapter") else "tensor-parallel" if model_meta.get("tp_lora") else None


def _stateful_json(obj: Any, where: str) -> Optional[Dict[str, Any]]:
    if obj is None or not hasattr(obj, "state_dict"):
        return None
    return {"class": _qualname(obj), "state": to_json_value(obj.state_dict(), where)}


def _write_model_configs(model: nn.Module, staging: str) -> None:
    config = find_hf_config(model)
    if config is not None:
        config.to_json_file(os.path.join(staging, CONFIG_NAME))
    peft = peft_model_of(model)
    if peft is not None:
        # peft writes its own config as JSON (sets become lists, enums strings).
        peft.peft_config[peft.active_adapter].save_pretrained(staging)  # type: ignore[index, union-attr]  # peft


# -- load ----------------------------------------------------------------------------------

def load_checkpoint(target: Any, path: str, *, load_optimizer: bool = True, load_rng: bool = True,
                    strict: bool = True, optimizer: Any = None, lr_scheduler: Any = None) -> CheckpointState:
    """Load a checkpoint into `target` in its current (possibly different) parallel layout.

    `path` is a checkpoint directory, or a parent directory whose `latest` names one (read once, on rank 0:
    every rank loads the checkpoint it names, or raises if it cannot see it). Call on every
    rank with the same `path`, `load_optimizer`, `load_rng` and `strict` (and, to load one, an optimizer
    on every rank): they are compared across ranks first, and a difference raises the same ValueError
    on every rank naming the argument and each rank's value (replicas that loaded different checkpoints,
    or an optimizer restored on some ranks only, would otherwise train on silently). The flags must be
    bools (TypeError otherwise: `strict="no"` is not False). Every
    file is verified against the manifest, and every model (and optimizer) key and shape is
    checked against the checkpoint, before anything is loaded: a bad checkpoint raises
    `CheckpointError` (a ValueError) naming the file and the problem, and changes nothing.

    What is restored:
      * always: the model's weights, and the data position (below; on a dataset of another length than
        the saving run's too, with a warning on rank 0); `state.step` and `state.extra` are returned;
      * `load_optimizer=True` (the default), when the target has an optimizer: the optimizer's state
        and hyperparameters, and with them the lr scheduler, the grad scaler and a DeepSpeed
        engine's counters (global steps, loss scale). These travel together: a scheduler's state
        (its step count, base lrs) only means something next to the optimizer whose lr it set.
        `state.optimizer_restored` says whether this happened;
      * `load_optimizer=False`: none of those; the optimizer, lr scheduler and grad scaler keep
        their current (e.g. fresh) state, as fine-tuning from a checkpoint's weights wants;
      * `load_rng=True` (the default): each rank's RNG states (with tensor-parallel dropout streams),
        when the world size is the one that saved (`state.rng_restored`).
    The global batch size may differ from the saving run's when the samples consumed in
    the epoch are a whole number of the new global batches; otherwise a ValueError says which sizes
    fit, before anything is loaded.

    The data stream resumes at the saved position: for an `AutoAccelerateResult` target,
    `result.dataloader` is replaced in place by a loader that starts at the next sample (also
    returned as `state.dataloader`), so a loop that iterates `result.dataloader` after the load
    goes on where the saved run stood. Read `result.dataloader` after the load (a reference taken
    before it, e.g. from unpacking the result as a tuple, still starts at the epoch's first sample).
    Its `len()` is what is left of the resumed epoch; calling `result.sampler.set_epoch(epoch)` at
    each epoch, as `save_checkpoint`'s data position assumes, ends the skip after the resumed epoch.
    """
    checkpointer().wait()  # an async save in flight may be the checkpoint asked for
    objs, handler = _agree_on_load_args(target, path, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                        load_optimizer=load_optimizer, load_rng=load_rng, strict=strict)
    ckpt_dir, manifest = _locate_checkpoint(path)
    verify_checkpoint(ckpt_dir, manifest)
    meta, entries = _read_checkpoint_metadata(ckpt_dir)
    # Raised identically on every rank (it depends on the metadata and the batch size only), before
    # anything is loaded: a batch size that cannot resume at the saved sample.
    position = _resume_position(meta, objs)
    targets = _check_against_checkpoint(objs, handler, meta, entries, ckpt_dir, load_optimizer=load_optimizer,
                                        strict=strict)
    _read_tied_weights(handler, targets, entries, ckpt_dir, manifest)
    _load_tensors(handler, targets, os.path.join(ckpt_dir, DCP_DIR), manifest)
    if targets.restore_optimizer:
        _restore_with_optimizer(objs, handler, meta, ckpt_dir)
    rng_restored, dataloader = _restore_rng_and_data(target, objs, meta, manifest, ckpt_dir, position,
                                                     load_rng=load_rng)
    return CheckpointState(path=ckpt_dir, step=meta.get("step"), data_position=position,
                           extra=from_json_value(meta.get("extra") or {}), strategy=meta.get("strategy"),
                           saved_world_size=int(meta.get("world_size") or 1), rng_restored=rng_restored,
                           optimizer_restored=targets.restore_optimizer, dataloader=dataloader)


def _agree_on_load_args(target: Any, path: Any, *, optimizer: Any, lr_scheduler: Any, load_optimizer: Any,
                        load_rng: Any, strict: Any) -> Tuple[TrainingObjects, LayoutHandler]:
    """Check `load_checkpoint`'s arguments on every rank, then agree: (objects, layout handler).

    As in save_checkpoint: local checks voted on, then what every rank must share compared, before anything else.
    """
    with agree_on_error("load_checkpoint: checking the arguments"):
        objs = TrainingObjects.of(target, optimizer, lr_scheduler)
        mf.check_dir_arg("load_checkpoint", "path", path)
        if not path:
            raise ValueError(f"path={path!r}; pass the checkpoint directory (or its parent, whose 'latest' names it)")
        for name, flag in (("load_optimizer", load_optimizer), ("load_rng", load_rng), ("strict", strict)):
            _check_flag("load_checkpoint", name, flag)
        handler = objs.handler("load_checkpoint" if load_optimizer else None)
        if load_optimizer is True:
            _check_optimizer_holds_model_parameters("load_checkpoint", objs)
    agree_on_values("load_checkpoint", {
        "path": os.fspath(path), "load_optimizer": _optimizer_flag(load_optimizer, handler),
        "load_rng": repr(load_rng), "strict": repr(strict)})
    return objs, handler


def _locate_checkpoint(path: str) -> Tuple[str, mf.Manifest]:
    """The checkpoint directory `path` names (itself, or its `latest`), the same on every rank, and its manifest.

    Rank 0 reads `latest` once and every rank loads the checkpoint it names. Each rank reading the
    pointer itself could split the ranks between two checkpoints (a save committing between their
    reads, e.g. a training job saving into the directory an evaluation job loads from, or a node whose
    view of the filesystem lags), and they would load different states silently. Comparing the ranks'
    readings would catch that, but turn a harmless race into a failed load; one reading cannot split
    the ranks at all. Every rank still checks that the named checkpoint is complete in its own view
    (voted on: a rank that cannot see it makes every rank raise). The name travels relative to `path`:
    nodes may mount the shared filesystem at different places.
    """
    # Local steps end in a vote: a rank that cannot read a file makes every rank raise the same error.
    with agree_on_error(f"load_checkpoint({path!r}): locating the checkpoint"):
        name = mf.checkpoint_name(path) if _rank() == 0 else None
    name = _broadcast(name)
    with agree_on_error(f"load_checkpoint({path!r}): locating the checkpoint"):
        ckpt_dir = mf.checkpoint_at(path, name)
        manifest = mf.Manifest.read(ckpt_dir)
    return ckpt_dir, manifest


def _read_checkpoint_metadata(ckpt_dir: str) -> Tuple[Dict[str, Any], Dict[str, Tuple[Tuple[int, ...], torch.dtype]]]:
    """meta.json, and the shape and dtype of every tensor the checkpoint holds (from DCP's index)."""
    with agree_on_error(f"load_checkpoint({ckpt_dir!r}): reading the metadata"):
        meta = _read_meta(ckpt_dir)
        entries = tensor_entries(load_dcp_metadata(os.path.join(ckpt_dir, DCP_DIR, ".metadata")))
    return meta, entries


@dataclass
class _LoadTargets:
    """What `load_checkpoint` loads in place: tensors keyed as in the checkpoint, and optimizer hyperparameters."""

    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_values: Dict[str, Any] = field(default_factory=dict)
    # load_optimizer, and the target has an optimizer (the ranks agreed on both).
    restore_optimizer: bool = False
    # optimizer key -> the checkpoint key it is read from, where that is another name of the same tied weight.
    optimizer_sources: Dict[str, str] = field(default_factory=dict)
    # model key -> its value, already read and checked (`_read_tied_weights`): copied in, not read again.
    prefilled: Dict[str, torch.Tensor] = field(default_factory=dict)
    # Parameters the saving optimizer held without state (no gradient yet), whose fresh state is dropped after
    # the load (see _stateless_parameters).
    stateless: List[str] = field(default_factory=list)


def _check_against_checkpoint(objs: TrainingObjects, handler: LayoutHandler, meta: Dict[str, Any],
                              entries: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], ckpt_dir: str, *,
                              load_optimizer: bool, strict: bool) -> _LoadTargets:
    """What to load, once every model (and optimizer) key and shape is checked against the checkpoint.

    Every problem is collected, then raised on every rank before anything is loaded: ranks may see
    different problems (a pipeline stage holds part of the model).
    """
    targets = {MODEL_PREFIX + k: v for k, v in handler.model_state().items()}
    # A pipeline stage holds some of the model: "unexpected" means held by no rank.
    known = set().union(*_all_gather(sorted(targets))) if _dist() else set(targets)
    problems = _lora_kind_problems(meta, objs.model, ckpt_dir) + \
        check_keys(targets, entries, MODEL_PREFIX, strict=strict, known=known)
    load = _LoadTargets(model=targets, restore_optimizer=load_optimizer and handler.has_optimizer)
    if load.restore_optimizer:
        problems += _optimizer_targets(load, handler, meta, entries, ckpt_dir)
    # Ranks may see different problems (a pipeline stage holds part of the model): all raise.
    with agree_on_error(f"load_checkpoint({ckpt_dir!r}): checking the model against the checkpoint"):
        mf.raise_problems(ckpt_dir, problems)
    return load


def _optimizer_targets(load: _LoadTargets, handler: LayoutHandler, meta: Dict[str, Any],
                       entries: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], ckpt_dir: str) -> List[str]:
    """Fill `load`'s optimizer tensors and hyperparameters; return the problems of restoring them (local)."""
    if not meta.get("has_optimizer"):
        return [f"{os.path.join(ckpt_dir, META_NAME)}: the checkpoint was saved without optimizer "
                "state; pass load_optimizer=False to load the model only"]
    local_tensors, local_values = handler.optim_state()
    load.optimizer = {OPTIM_PREFIX + k: v for k, v in local_tensors.items()}
    saved_values = from_json_value(meta["optimizer"]["values"])
    ties = handler.tied_weights()
    saved_tensors = {k[len(OPTIM_PREFIX):] for k in entries if k.startswith(OPTIM_PREFIX)}
    for key in local_tensors:
        source = _tied_source(key, ties, saved_tensors) if OPTIM_PREFIX + key not in entries else None
        if source is not None:
            load.optimizer_sources[OPTIM_PREFIX + key] = OPTIM_PREFIX + source
    load.stateless = _stateless_parameters(load, handler, local_values, saved_values, entries)
    problems = check_keys({load.optimizer_sources.get(k, k): v for k, v in load.optimizer.items()
                           if not _state_of(k, load.stateless)}, entries, OPTIM_PREFIX, strict=False)
    tied_values = {k: saved_values[source] for k in local_values if k not in saved_values
                   for source in [_tied_source(k, ties, saved_values)] if source is not None}
    saved_values = {**saved_values, **tied_values}
    missing = sorted(k for k in local_values if k not in saved_values)
    # `initial_lr` is the lr scheduler's, not the optimizer's: a scheduler's construction writes it into every
    # group. A checkpoint saved without a scheduler lacks it, and this run's own value (its scheduler's base lr)
    # is what that scheduler goes on from, so it is kept (the scheduler's state is kept too: _load_stateful).
    scheduler_keys = [k for k in missing if k.startswith("param_groups.") and k.endswith(".initial_lr")]
    missing = [k for k in missing if k not in scheduler_keys]
    if missing:
        saved_class = (meta.get("optimizer") or {}).get("class", "an unrecorded class")
        problems.append(f"{os.path.join(ckpt_dir, META_NAME)}: no optimizer hyperparameters for "
                        f"{len(missing)} entries, e.g. {missing[:3]}: a different model, or a different optimizer "
                        f"than the checkpoint's ({saved_class}), whose state does not carry over (e.g. DeepSpeed's "
                        "CPU Adam, saved with offload, and torch's AdamW); pass load_optimizer=False to load the "
                        "weights and start the optimizer fresh, or build the optimizer the checkpoint was saved with")
    # Every parameter's group hyperparameters, not only this rank's: a ZeroRedundancyOptimizer's group can
    # be empty on this rank and still needs its saved lr (see TorchHandler.load_optim_state).
    load.optimizer_values = {k: v for k, v in saved_values.items()
                             if k in local_values or k.startswith("param_groups.")}
    load.optimizer_values.update({k: local_values[k] for k in scheduler_keys})
    for group in ties:
        # A shared Parameter must be named once: torch's loader counts every name with hyperparameters.
        own = [n for n in group if any(k.startswith(f"param_groups.{n}.") for k in local_values)]
        if own:
            load.optimizer_values = {k: v for k, v in load.optimizer_values.items() if not any(
                k.startswith(f"param_groups.{n}.") for n in group if n not in own)}
    # Checked now, not by torch after the model was loaded: a failed load changes nothing.
    problems += [f"{os.path.join(ckpt_dir, META_NAME)}: {p}"
                 for p in handler.optim_load_problems(load.optimizer_values) +
                 _param_group_problems(handler.param_group_names(), meta["optimizer"].get("param_groups"))]
    return problems


def _param_group_problems(groups: List[List[str]], saved: Optional[List[List[str]]]) -> List[str]:
    """The parameter groups of this rank's optimizer (names by group) against the checkpoint's: a parameter in a
    group with others than it was saved with is the one problem (one message), [] when they match or the
    checkpoint did not record its groups (an older atorch).

    Hyperparameters are saved per parameter and restored per group from its first parameter (torch's flattened
    loader and DeepSpeed's alike): a checkpoint of one group loaded into two (decay / no-decay) would give both
    the first's weight decay, one of two groups into one group would drop the other's lr, silently.
    """
    if saved is None:
        return []
    saved_group = {name: index for index, names in enumerate(saved) for name in names}
    owner: Dict[int, int] = {}    # saved group -> the group of this optimizer holding its parameters
    matched: Dict[int, int] = {}  # group of this optimizer -> the saved group of its parameters
    for index, names in enumerate(groups):
        for name in names:
            was = saved_group.get(name)
            if was is None:
                continue   # a parameter the checkpoint lacks: reported with the keys
            if owner.setdefault(was, index) != index or matched.setdefault(index, was) != was:
                return [f"optimizer parameter {name!r} is in param group {index} of this optimizer but was saved in "
                        f"group {was}, with other parameters: this optimizer's groups are {_show_groups(groups)}, "
                        f"the checkpoint's {_show_groups(saved)}. Each group's hyperparameters (lr, weight decay) "
                        "are restored from its first parameter's, so the other parameters would train with another "
                        "group's silently; build the optimizer with the checkpoint's groups to resume it, or pass "
                        "load_optimizer=False to load the weights and start the optimizer fresh"]
    return []


def _show_groups(groups: List[List[str]]) -> str:
    """Parameter groups for a message: a few names of each, with the count of the others."""
    shown = [names[:3] + ([f"... {len(names) - 3} more"] if len(names) > 3 else []) for names in groups[:4]]
    return str(shown) + (f" and {len(groups) - 4} more groups" if len(groups) > 4 else "")


def _stateless_parameters(load: _LoadTargets, handler: LayoutHandler, local_values: Dict[str, Any],
                          saved_values: Dict[str, Any], entries: Dict[str, Any]) -> List[str]:
    """This rank's parameters that the checkpoint's optimizer held (their group hyperparameters were saved) but
    without any state: they had no gradient yet when it was saved (an MoE expert no token reached, an unused
    branch), and torch's optimizer creates state at a parameter's first step. torch's load template
    (`get_optimizer_state_dict`) holds a fresh state for every parameter; those of these parameters are not
    read, and are dropped after the load, so that the resumed optimizer is the saved one."""
    if not isinstance(handler, TorchHandler):
        return []
    # Keys by parameter name, once (`param_groups.<name>.<hyperparameter>`, `optim/state.<name>.<state>`): a
    # scan of every key per parameter was quadratic in the model's size.
    groups, state = "param_groups.", f"{OPTIM_PREFIX}state."
    names = {k[len(groups):].rsplit(".", 1)[0] for k in local_values if k.startswith(groups)}
    held = {k[len(groups):].rsplit(".", 1)[0] for k in saved_values if k.startswith(groups)}
    keys: Dict[str, List[str]] = {}
    for k in load.optimizer:
        if k.startswith(state):
            keys.setdefault(k[len(state):].rsplit(".", 1)[0], []).append(k)
    return [name for name in sorted(names & held)
            if keys.get(name) and not any(load.optimizer_sources.get(k, k) in entries for k in keys[name])]


def _state_of(key: str, names: List[str]) -> bool:
    """Whether the checkpoint key `key` (optim/state.<name>.<state>) is the state of one of the parameters `names`."""
    return any(key.startswith(f"{OPTIM_PREFIX}state.{name}.") for name in names)


def _tied_source(key: str, ties: List[Tuple[str, ...]], saved: Any) -> Optional[str]:
    """The key in `saved` holding `key`'s value under another name of the same tied weight, or None.

    Exact: a tied weight is one logical weight in every layout. A native pipeline that splits a tied
    embedding/head over two stages keeps two copies, initialised equal, and sums their gradients every step
    (NativePipeline.forward_backward: both apply embedding + head gradient, as autograd gives the shared
    Parameter of the unsplit model), with the same hyperparameters; the global clipping norm counts the pair
    once. Both copies' optimizer states are therefore the tied parameter's: a pipeline's checkpoint loads
    either copy's state into the tied model, and the tied model's state loads into both copies.
    """
    for group in ties:
        for name in group:
            for head in ("state.", "param_groups."):
                if key.startswith(f"{head}{name}."):
                    rest = key[len(head) + len(name) + 1:]
                    for other in group:
                        if other != name and f"{head}{other}.{rest}" in saved:
                            return f"{head}{other}.{rest}"
    return None


def _read_tied_weights(handler: LayoutHandler, load: _LoadTargets,
                       entries: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], ckpt_dir: str,
                       manifest: mf.Manifest) -> None:
    """Read the checkpoint's tensors of each tied weight this rank holds, and refuse (every rank, nothing loaded)
    a checkpoint where they differ; equal ones become `load.prefilled`.

    A tied embedding/head is one Parameter here (or a native pipeline's two copies kept equal). A checkpoint of an
    untied model holds two different tensors under its names: read in place, both would be written into the one
    Parameter and the last would win, silently (with or without the optimizer). Each name is read into its own
    buffer first (one read of the tied weight: the main read skips it). A collective: every rank takes part.
    """
    reads: Dict[str, torch.Tensor] = {}
    groups: List[Tuple[List[str], List[str]]] = []   # (the group's names in the checkpoint, those this rank loads)
    for group in handler.tied_weights():
        saved = [n for n in group if MODEL_PREFIX + n in entries]
        local = [n for n in group if MODEL_PREFIX + n in load.model]
        if len(saved) > 1 and local:
            like = load.model[MODEL_PREFIX + local[0]]
            for name in saved:
                reads.setdefault(MODEL_PREFIX + name, torch.empty_like(like))
            groups.append((saved, local))
    if not any(_all_gather(bool(reads))):
        return
    _dcp_load(reads, os.path.join(ckpt_dir, DCP_DIR), manifest)
    with agree_on_error(f"load_checkpoint({ckpt_dir!r}): comparing the checkpoint's tensors of tied weights"):
        problems = []
        for saved, local in groups:
            first = _local_tensor(reads[MODEL_PREFIX + saved[0]])
            differ = [n for n in saved[1:] if not torch.equal(_local_tensor(reads[MODEL_PREFIX + n]), first)]
            if differ:
                problems.append(
                    f"{DCP_DIR}/.metadata: the checkpoint holds {saved[0]!r} and {differ[0]!r} as two different "
                    "tensors (saved from a model that keeps them apart, e.g. tie_word_embeddings=False), but this "
                    "model ties them into one weight, which would silently keep whichever is read last; load it "
                    "into a model built untied (e.g. tie_word_embeddings=False); to go on tied, load it untied and "
                    f"copy the one to keep (e.g. {saved[0]!r}) into the other before tying them")
        mf.raise_problems(ckpt_dir, problems)
    for saved, local in groups:
        for name in local:
            load.prefilled[MODEL_PREFIX + name] = reads[MODEL_PREFIX + saved[0]]


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its shard is compared with the same shard of another name), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _load_tensors(handler: LayoutHandler, load: _LoadTargets, dcp_dir: str, manifest: mf.Manifest) -> None:
    """Read the model's (and optimizer's) tensors in place, then hand them to the layout's model and optimizer."""
    # Filled in place: a tied copy's tensor read under its other name is still the optimizer's own tensor; where
    # this rank also holds the other copy (read under its own name), it is copied from that one after the read.
    targets = {k: v for k, v in load.model.items() if k not in load.prefilled}
    copies = [(load.model[k], v) for k, v in load.prefilled.items()]
    for key, tensor in load.optimizer.items():
        if _state_of(key, load.stateless):
            continue   # not in the checkpoint: handed over as torch's fresh state, then dropped
        source = load.optimizer_sources.get(key, key)
        if source != key and source in load.optimizer:
            copies.append((tensor, load.optimizer[source]))
        else:
            targets[source] = tensor
    _dcp_load(targets, dcp_dir, manifest)
    with torch.no_grad():
        for tensor, source_tensor in copies:
            tensor.copy_(source_tensor)
    # One rank failing to hand the state over (e.g. a state torch's loader refuses on that rank only) left the
    # others waiting at the next vote: agree here.
    with agree_on_error(f"load_checkpoint({os.path.dirname(dcp_dir)!r}): loading the model and optimizer state"):
        handler.load_model_state({k[len(MODEL_PREFIX):]: v for k, v in load.model.items()})
        if load.restore_optimizer:
            handler.load_optim_state({k[len(OPTIM_PREFIX):]: v for k, v in load.optimizer.items()},
                                     load.optimizer_values)
            if load.stateless:
                cast(TorchHandler, handler).drop_optim_state(load.stateless)


def _restore_with_optimizer(objs: TrainingObjects, handler: LayoutHandler, meta: Dict[str, Any],
                            ckpt_dir: str) -> None:
    """Restore what travels with the optimizer's state: a DeepSpeed engine's counters, the lr scheduler and the
    grad scaler (a scheduler's state only means something next to the optimizer whose lr it set)."""
    if meta.get("engine") is not None:
        handler.load_extra_state(from_json_value(meta["engine"]))
    _load_stateful(objs.lr_scheduler, meta.get("lr_scheduler"), "lr_scheduler", ckpt_dir)
    _load_stateful(objs.grad_scaler, meta.get("grad_scaler"), "grad_scaler", ckpt_dir)


def _restore_rng_and_data(target: Any, objs: TrainingObjects, meta: Dict[str, Any], manifest: mf.Manifest,
                          ckpt_dir: str, position: Optional[DataPosition], *, load_rng: bool) -> Tuple[bool, Any]:
    """Restore this rank's RNG states (`load_rng`, same world size) and start the dataloader at `position`:
    (whether the RNG states were restored, the resumed dataloader or None)."""
    rng_restored = False
    dataloader = None
    with agree_on_error(f"load_checkpoint({ckpt_dir!r}): restoring RNG states and the data position"):
        rng_name = f"{RNG_DIR}/rank_{_rank():05d}.json"
        if load_rng and meta.get("world_size") == _world() and rng_name in manifest.files:
            _set_rank_rng_state(objs, mf.read_json(ckpt_dir, rng_name), ckpt_dir)
            rng_restored = True
        if position is not None and objs.dataloader is not None:
            base = _unresumed(objs.dataloader)
            dataloader = resume_dataloader(base, position, position.global_batch_size)
            setattr(dataloader, _RESUMED_FROM, base)   # a later load resumes the original loader, not this one
            if _is_result(target):
                # The loop that goes on iterating `result.dataloader` (the README's) resumes exactly too.
                target.dataloader = dataloader
                target.data_origin = (meta.get("step"), position)
    return rng_restored, dataloader


def _lora_kind_problems(meta: Dict[str, Any], model: Any, ckpt_dir: str) -> List[str]:
    """The one problem of loading peft's LoRA adapters into tensor-parallel LoRA, or the reverse: the two name
    their tensors differently (peft wraps each linear: `base_layer`, `lora_A.<adapter>`; atorch's sharded
    layers hold `lora_A` themselves), so a checkpoint reshards between layouts of the same kind only."""
    saved_kind, kind = _lora_kind(meta.get("model") or {}), _lora_kind(_lora_meta(model))
    if saved_kind is None or kind is None or saved_kind == kind:
        return []
    return [f"{os.path.join(ckpt_dir, META_NAME)}: the checkpoint holds {saved_kind} LoRA adapters and this model "
            f"{kind} LoRA adapters, which name their tensors differently, so the adapters cannot be resumed across "
            f"them; resume with the strategy that saved it ({'without' if saved_kind == 'peft' else 'with'} "
            "tensor_parallel), or merge it (`atorch merge CKPT OUT --lora merge`) and start a new LoRA run from the "
            "merged model"]


def _is_result(target: Any) -> bool:
    from atorch.auto.result import AutoAccelerateResult

    return isinstance(target, AutoAccelerateResult)


# Attribute of a resumed dataloader naming the loader it was made from.
_RESUMED_FROM = "_atorch_resumed_from"


def _unresumed(dataloader: Any) -> Any:
    """The loader `auto_accelerate` built, under any resumed loaders `load_checkpoint` made of it (resuming a
    resumed loader would skip the first resume's samples twice)."""
    while hasattr(dataloader, _RESUMED_FROM):
        dataloader = getattr(dataloader, _RESUMED_FROM)
    return dataloader


def _resume_position(meta: Dict[str, Any], objs: TrainingObjects) -> Optional[DataPosition]:
    """The saved data position, counted in this run's global batches when the dataloader is known; past the
    end of this run's epoch (a smaller dataset), the start of the next epoch (`position_in_epoch`).

    When the dataset's length differs from the saving run's, rank 0 warns once, naming both lengths and
    the saved position: a user who resumed on other data (or other data files) by mistake is told.
    Nothing is refused, and the position is restored as always, `load_optimizer=False` included:
    fine-tuning on new data from a checkpoint is legitimate, and `load_optimizer` is about the
    optimizer's state, not the data. Dropping the position when the length changed would treat new data
    of another length unlike new data of the same length; the warning says how to start from the first
    sample instead. A checkpoint without the saved length (an older atorch, an iterable dataset) warns
    only when the position lies past the end of this run's epoch, as before.
    """
    if not meta.get("data_position"):
        return None
    position = DataPosition.from_json(meta["data_position"])
    batch = objs.item_global_batch_size()
    position = convert_position(position, batch) if batch else position
    if objs.dataloader is None:
        return position
    base = _unresumed(objs.dataloader)
    batches, samples = len_or_none(base), len_or_none(getattr(base, "dataset", None))
    saved_samples = meta.get(DATASET_LENGTH)
    changed = isinstance(saved_samples, int) and samples is not None and saved_samples != samples
    resumed = position_in_epoch(position, batches, samples, warn=not changed)
    if changed and _rank() == 0:
        logger.warning("%s", dataset_change_message(cast(int, saved_samples), cast(int, samples), position, resumed,
                                                   batches))
    return resumed


def verify_checkpoint(ckpt_dir: str, manifest: Optional[mf.Manifest] = None, collective: bool = True) -> mf.Manifest:
    """Check every file against the manifest; raise (on every rank) if any is missing, truncated or altered.

    With `collective` (and a process group) the ranks share the hashing; otherwise this
    process checks every file.
    """
    mf.check_dir_arg("verify_checkpoint", "ckpt_dir", ckpt_dir)
    manifest = manifest or mf.Manifest.read(ckpt_dir)
    names = sorted(manifest.files)
    for required in (META_NAME, f"{DCP_DIR}/.metadata"):
        if required not in manifest.files:
            raise CheckpointError(f"{ckpt_dir}: the manifest does not list {required}; not an atorch checkpoint")
    problems: List[str] = []
    if collective and _dist():
        with agree_on_error(f"verify_checkpoint({ckpt_dir!r})"):
            own = mf.verify_files(ckpt_dir, manifest, names[_rank()::_world()])
        for part in _all_gather(own):
            problems += part
    else:
        problems = mf.verify_files(ckpt_dir, manifest, names)
    mf.raise_problems(ckpt_dir, problems)
    return manifest


def _read_meta(ckpt_dir: str) -> Dict[str, Any]:
    meta = mf.read_json(ckpt_dir, META_NAME)
    if not isinstance(meta, dict) or meta.get("format") != mf.FORMAT_NAME:
        raise CheckpointError(f"{os.path.join(ckpt_dir, META_NAME)}: not atorch checkpoint metadata")
    return meta


def check_keys(targets: Dict[str, torch.Tensor], entries: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
               prefix: str, strict: bool, known: Optional[set] = None, where: str = f"{DCP_DIR}/.metadata"
               ) -> List[str]:
    """Differences between the tensors to load and the checkpoint's, as messages (empty when they match).

    `known`: the keys any rank loads (default: `targets`); with `strict`, checkpoint entries
    outside it are reported. `where` names the index the entries come from.
    """
    known = set(targets) if known is None else known
    problems = []
    what = prefix[:-1] or "model"
    missing = sorted(k[len(prefix):] for k in targets if k not in entries)
    if missing:
        problems.append(f"{where}: {len(missing)} {what} entries this model needs are not in the checkpoint, "
                        f"e.g. {missing[:5]} (a checkpoint of a different model?)")
    if strict:
        unexpected = sorted(k[len(prefix):] for k in entries if k.startswith(prefix) and k not in known)
        if unexpected:
            problems.append(f"{where}: the checkpoint has {len(unexpected)} {what} entries this model does "
                            f"not, e.g. {unexpected[:5]} (a checkpoint of a different model? strict=False ignores "
                            "them)")
    bad_shapes = [(k[len(prefix):], tuple(v.shape), entries[k][0]) for k, v in sorted(targets.items())
                  if k in entries and tuple(v.shape) != entries[k][0]]
    if bad_shapes:
        shown = ", ".join(f"{k}: model {m} vs checkpoint {c}" for k, m, c in bad_shapes[:5])
        problems.append(f"{where}: {len(bad_shapes)} shape mismatches: {shown}")
    return problems


def _dcp_load(targets: Dict[str, torch.Tensor], dcp_dir: str, manifest: mf.Manifest) -> None:
    import torch.distributed.checkpoint as dcp

    allowed = [n[len(DCP_DIR) + 1:] for n in manifest.files if n.startswith(DCP_DIR + "/")]
    reader = SafeFileSystemReader(dcp_dir, allowed_files=allowed)
    with _quiet_single_process_dcp(), raise_checkpoint_errors():
        dcp.load(targets, storage_reader=reader, no_dist=not _dist())


@contextlib.contextmanager
def raise_checkpoint_errors():
    """DCP wraps every failure in a CheckpointException per rank; surface ours (with its file name) as is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        for failure in (getattr(e, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
            if isinstance(inner, CheckpointError):
                raise inner from e
        raise


def _load_stateful(obj: Any, saved: Optional[Dict[str, Any]], what: str, ckpt_dir: str) -> None:
    if obj is None:
        return
    if saved is None:
        logger.warning("%s: the checkpoint has no %s state; the current one is kept", ckpt_dir, what)
        return
    obj.load_state_dict(from_json_value(saved["state"]))
