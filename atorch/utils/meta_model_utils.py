"""Build models on the meta device while recording how each module was constructed, then build them for real.

Under `record_module_init()` every `nn.Module` is created on the meta device (no memory, no
random draws) and remembers its class and constructor arguments. `build_recorded_module`
replays the construction for real: under `torch.manual_seed(s)` it returns exactly what
`torch.manual_seed(s); Model(config)` returns. `materialize_module` does the same for a
recorded tree but can hand each piece to a transform (e.g. tensor-parallel slicing) before
it is placed, and can build one block at a time to bound memory.

Memory, honestly: the exact mode (`per_block=False`) builds the whole model on the CPU of
every rank once; the per-block mode keeps only one block at full size at a time, but its
weights come from per-block seeds, so they are not bitwise those of `Model(config)` (same
initialization rule, different random stream; identical for every parallel layout).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Type

import torch
from torch import nn

_RECORD_ATTR = "_atorch_init_record"

# The seed of `torch.manual_seed(seed); Model(config)` that the strategies materializing a meta model
# use unless told otherwise (pipeline_parallel, tensor_parallel; ATorch's `init_randomizer()` default).
DEFAULT_BASE_SEED = 1234


@dataclass(frozen=True)
class InitRecord:
    """The class and constructor arguments of a module built under `record_module_init`.

    The arguments are kept by reference (a config object is shared with the model, as it is
    after an ordinary construction).
    """

    cls: Type[nn.Module]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class _RecorderState:
    """Process-wide patching state: which classes have a wrapped `__init__`, how deep recording is nested."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.patched: Dict[type, Callable] = {}   # class -> its original __init__
        self.installed: Dict[type, Callable] = {}  # class -> the recording __init__ put in its place
        self.in_progress: Set[int] = set()        # ids of modules whose outermost __init__ is running
        self.had_init_subclass = False
        self.saved_init_subclass: Any = None


_STATE = _RecorderState()


def _wrap_init(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or not inspect.isfunction(original) or cls in _STATE.patched:
        return

    @functools.wraps(original)
    def recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if _STATE.depth == 0 or id(self) in _STATE.in_progress:
            return original(self, *args, **kwargs)
        # The first wrapped __init__ to run for an object is that of its most derived class
        # defining one, so its arguments are exactly those of `type(self)(...)`.
        _STATE.in_progress.add(id(self))
        try:
            original(self, *args, **kwargs)
        finally:
            _STATE.in_progress.discard(id(self))
        object.__setattr__(self, _RECORD_ATTR, InitRecord(type(self), args, dict(kwargs)))

    _STATE.patched[cls] = original
    _STATE.installed[cls] = recording_init
    cls.__init__ = recording_init  # type: ignore[misc]  # deliberate patch, restored by _uninstall


def _all_module_classes() -> List[type]:
    seen: List[type] = [nn.Module]
    stack = [nn.Module]
    found = {nn.Module}
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                seen.append(sub)
                stack.append(sub)
    return seen


def _init_subclass_hook(cls: Type[nn.Module], **kwargs: Any) -> None:
    # Classes defined inside the block get recorded too; their __init__ is restored on exit.
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


def _install() -> None:
    for cls in _all_module_classes():
        _wrap_init(cls)
    _STATE.had_init_subclass = "__init_subclass__" in nn.Module.__dict__
    _STATE.saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
    # Deliberate patch of the hook, restored by _uninstall.
    nn.Module.__init_subclass__ = classmethod(_init_subclass_hook)  # type: ignore[method-assign,assignment]


def _uninstall() -> None:
    for cls, original in _STATE.patched.items():
        # A class defined inside the block may have had its __init__ wrapped again after ours (a class
        # decorator: transformers' `use_experts_implementation` sets `self.config` around it). That
        # wrapper calls ours, which outside a recording block is the original: keep it, or the
        # class loses what the decorator adds.
        if cls.__dict__.get("__init__") is _STATE.installed.get(cls):
            cls.__init__ = original  # type: ignore[misc]  # putting back the __init__ _wrap_init replaced
    _STATE.patched.clear()
    _STATE.installed.clear()
    if _STATE.had_init_subclass:
        nn.Module.__init_subclass__ = _STATE.saved_init_subclass  # type: ignore[method-assign]  # restoring it
    else:
        del nn.Module.__init_subclass__


@contextlib.contextmanager
def record_module_init() -> Iterator[None]:
    """Build modules on the meta device and record their constructor arguments.

    Nothing is allocated and no random numbers are drawn (Hugging Face models skip their
    weight initialization on the meta device). Modules and module classes defined inside
    the block keep working after it; every patched `__init__` is restored on exit, also when
    the block raises. Nested blocks are allowed; the recorder is not meant for concurrent
    use from several threads.
    """
    with _STATE.lock:
        if _STATE.depth == 0:
            _install()
        _STATE.depth += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _STATE.lock:
            _STATE.depth -= 1
            if _STATE.depth == 0:
                _uninstall()


def init_record(module: nn.Module) -> Optional[InitRecord]:
    """How `module` was constructed, if it was built under `record_module_init`."""
    return module.__dict__.get(_RECORD_ATTR)


def is_recorded(module: nn.Module) -> bool:
    return init_record(module) is not None


def is_meta_module(module: nn.Module) -> bool:
    """True when any parameter or buffer of `module` (recursively) lives on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


@contextlib.contextmanager
def _seeded(seed: Optional[int]) -> Iterator[None]:
    """Under `seed`, draw from a fresh stream and leave the caller's generators as they were."""
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# A meta module marked for tensor parallelism (`tp_manual_shard_custom_fn` on a recorded meta
# model) must be built as this rank's shards, not at full size. The tensor-parallel package sits
# beside this one and imports it, so it registers its builder here instead of being imported.
TP_MARK_ATTR = "_atorch_tp_action"
_TPBuilder = Callable[[nn.Module, int], nn.Module]
_tp_builder: Optional[_TPBuilder] = None


def register_tensor_parallel_builder(builder: _TPBuilder) -> None:
    """Called by `atorch.tensor_parallel.shard`: builds a marked meta module from a base seed."""
    global _tp_builder
    _tp_builder = builder


def is_marked_for_tensor_parallel(module: nn.Module) -> bool:
    return any(TP_MARK_ATTR in m.__dict__ for m in module.modules())


def build_recorded_module(module: nn.Module, seed: Optional[int] = None) -> nn.Module:
    """Replay `module`'s recorded construction for real, on the CPU; the meta module is unchanged.

    With `seed`, the result equals `torch.manual_seed(seed); cls(*args, **kwargs)` and the
    caller's random state is left untouched; without it, construction draws from the current
    generators, exactly like an ordinary construction at this point of the program.
    A module marked for tensor parallelism (ATorch's flow: `tp_manual_shard_custom_fn` on the
    meta model, then this) is built as this rank's shards (`materialize_tp_module`); without
    `seed`, its base seed is drawn from the current generator, so ranks seeded alike agree.
    Raises ValueError when `module` was not recorded or its structure changed after recording.
    """
    if is_marked_for_tensor_parallel(module):
        if _tp_builder is None:   # cannot happen through the public API: marking imports the builder
            raise ValueError(f"{type(module).__name__} is marked for tensor parallelism; build it with "
                             "atorch.tensor_parallel.materialize_tp_module")
        base_seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,)).item())
        return _tp_builder(module, base_seed)
    return replay_recorded_module(module, seed)


def replay_recorded_module(module: nn.Module, seed: Optional[int] = None) -> nn.Module:
    """`build_recorded_module` at full size whatever marks the module carries (the builders' own step)."""
    record = init_record(module)
    if record is None:
        raise ValueError(f"{type(module).__name__} was not built under record_module_init(), so its construction "
                         "cannot be replayed; build it inside `with record_module_init():`")
    with _seeded(seed), torch.device("cpu"):
        real = record.cls(*record.args, **record.kwargs)
    _check_same_structure(module, real)
    return real


def _check_same_structure(meta: nn.Module, real: nn.Module) -> None:
    meta_shapes = {k: tuple(v.shape) for k, v in meta.state_dict(keep_vars=True).items()}
    real_shapes = {k: tuple(v.shape) for k, v in real.state_dict(keep_vars=True).items()}
    if meta_shapes != real_shapes:
        diff = sorted(set(meta_shapes.items()) ^ set(real_shapes.items()))[:6]
        raise ValueError(f"{type(meta).__name__} was changed after it was recorded (differing entries, "
                         f"first {len(diff)}: {diff}); replaying its constructor would not give this module. Make "
                         "the change after materialization, or use materialize_module(..., per_block=True)")


def unit_seed(base_seed: int, name: str) -> int:
    """Seed of the block at qualified name `name` in per-block materialization (same on every rank)."""
    digest = hashlib.sha256(f"{base_seed}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


Transform = Callable[[str, nn.Module, nn.Module], nn.Module]


def materialize_module(module: nn.Module, base_seed: int, *, device: Optional[torch.device] = None,
                       transform: Optional[Transform] = None, per_block: bool = False,
                       block_classes: Tuple[type, ...] = (),
                       init_fn: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """A real copy of a recorded meta `module`, passed through `transform` and moved to `device`.

    `transform(prefix, real, meta)` gets each built piece at full size on the CPU together
    with its meta twin (where annotations such as tensor-parallel marks live) and returns
    what to keep (e.g. this rank's slices); only that is moved to `device`.

    `per_block=False` (exact): the whole module is built once with `build_recorded_module`
    under `base_seed`, so the weights equal an ordinary seeded construction. `per_block=True`
    (bounded memory): the module tree is copied on the meta device and every block (an
    instance of `block_classes`, or a module that directly owns tensors) is built alone under
    `unit_seed(base_seed, its name)`, re-initialized by `init_fn` (default: the root's
    Hugging Face `_init_weights`, applied children first like `post_init`), transformed and
    placed before the next one is built. Parameters shared between blocks (tied embeddings)
    stay shared: the first block to own one builds it, later blocks reuse it.
    """
    if not per_block:
        real = replay_recorded_module(module, seed=base_seed)
        if transform is not None:
            real = transform("", real, module)
        return real.to(device) if device is not None else real
    return _materialize_per_block(module, base_seed, device, transform, tuple(block_classes), init_fn)


def _materialize_per_block(module: nn.Module, base_seed: int, device: Optional[torch.device],
                           transform: Optional[Transform], block_classes: Tuple[type, ...],
                           init_fn: Optional[Callable[[nn.Module], None]]) -> nn.Module:
    import copy

    if init_fn is None:
        hf_init = getattr(module, "_init_weights", None)
        init_fn = hf_init if callable(hf_init) else None
    root = copy.deepcopy(module)  # meta tensors: free to copy; keeps the user's meta model intact
    built: Dict[int, torch.Tensor] = {}   # id(original meta tensor) -> materialized tensor

    def visit(prefix: str, meta_piece: nn.Module, copy_piece: nn.Module) -> Optional[nn.Module]:
        is_block = isinstance(meta_piece, block_classes) or any(True for _ in _tensors(meta_piece, recurse=False))
        if is_block and any(t.is_meta for t in _tensors(meta_piece)):
            return _build_unit(prefix, meta_piece, base_seed, device, transform, init_fn, built)
        for name, child in list(copy_piece.named_children()):
            meta_child = meta_piece.get_submodule(name)
            new = visit(f"{prefix}.{name}" if prefix else name, meta_child, child)
            if new is not None:
                copy_piece._modules[name] = new
        return None

    new_root = visit("", module, root)
    return new_root if new_root is not None else root


def _build_unit(prefix: str, meta_piece: nn.Module, base_seed: int, device: Optional[torch.device],
                transform: Optional[Transform], init_fn: Optional[Callable[[nn.Module], None]],
                built: Dict[int, torch.Tensor]) -> nn.Module:
    record = init_record(meta_piece)
    if record is None:
        raise ValueError(f"module {prefix or '(root)'!r} ({type(meta_piece).__name__}) is on the meta device but was "
                         "not built under record_module_init(), so it cannot be materialized")
    with _seeded(unit_seed(base_seed, prefix)), torch.device("cpu"):
        real = record.cls(*record.args, **record.kwargs)
        if init_fn is not None:
            with torch.no_grad():
                for sub in _post_order(real):
                    init_fn(sub)
    _check_same_structure(meta_piece, real)
    if transform is not None:
        real = transform(prefix, real, meta_piece)
    if device is not None:
        real = real.to(device)
    # Re-tie tensors this unit shares with an earlier one, then remember this unit's tensors.
    for mod_name, mod in meta_piece.named_modules(remove_duplicate=False):
        real_mod = real.get_submodule(mod_name) if mod_name else real
        for store in ("_parameters", "_buffers"):
            for t_name, meta_t in getattr(mod, store).items():
                if meta_t is None:
                    continue
                real_t = getattr(real_mod, store).get(t_name)
                if id(meta_t) in built:
                    shared = built[id(meta_t)]
                    if real_t is not None and real_t.shape != shared.shape:
                        raise ValueError(f"{prefix}.{mod_name}.{t_name} is shared with an earlier module but was "
                                         f"transformed to shape {tuple(real_t.shape)} instead of "
                                         f"{tuple(shared.shape)}")
                    getattr(real_mod, store)[t_name] = shared
                elif real_t is not None:
                    built[id(meta_t)] = real_t
    return real


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    # Children before parents, as Hugging Face's post_init applies `_init_weights`.
    for child in module.children():
        yield from _post_order(child)
    yield module


# -- ATorch's disk-offloaded meta initialization ----------------------------------------------------
# `init_empty_weights_with_disk_offload` builds modules for real, then (when the block ends) writes
# every parameter and buffer to disk and leaves it on the meta device; `reload_meta_module` reads the
# exact initial values back. Peak memory is one full model while building (the weights must exist to
# be saved); for models that do not fit, build under `record_module_init` and materialize per block.

_OFFLOAD_ATTR = "checkpoint_name"   # ATorch's attribute: the file holding the tensor's initial value
# Files in a directory `init_empty_weights_with_disk_offload` created itself: file -> the finalizer that
# removes it (and the directory, once empty) when the last tensor naming it is garbage.
_TEMPORARY_FILES: Dict[str, "weakref.finalize"] = {}


def _remove_offloaded_file(path: str) -> None:
    _TEMPORARY_FILES.pop(path, None)
    try:
        os.remove(path)
        os.rmdir(os.path.dirname(path))   # succeeds once the directory's last file is gone
    except OSError:
        pass


def _remove_with(tensor: torch.Tensor, path: str) -> None:
    """Remove the temporary file `path` when `tensor` (which names it in `_OFFLOAD_ATTR`) is garbage."""
    _TEMPORARY_FILES[path] = weakref.finalize(tensor, _remove_offloaded_file, path)


@contextlib.contextmanager
def init_empty_weights_with_disk_offload(ignore_tie_weights: bool = False, include_buffers: bool = True,
                                         reset: bool = True, disk_offload: bool = True,
                                         offload_path: Optional[str] = None, ckpt_path: Optional[str] = None,
                                         shard_kwargs: Any = None,
                                         meta_init_offload_name: Optional[str] = None) -> Iterator[None]:
    """Modules built in the block end up on the meta device, their initial values saved under `offload_path`.

    ATorch's keywords are accepted: `include_buffers` (default True) offloads buffers too;
    `offload_path` defaults to a new temporary directory; tied parameters stay tied (one file,
    one meta Parameter). `disk_offload=False`, `ckpt_path` (loading a checkpoint instead) and
    `shard_kwargs` raise ValueError; `ignore_tie_weights`, `reset` and `meta_init_offload_name`
    change nothing here.

    A temporary directory (no `offload_path`) is removed when the block raises, and each of its
    files once no tensor names it any more: after `reload_meta_module` loaded it (unless it kept
    the name, `delete_ckpt_name=False`), or when the meta model is garbage. A given
    `offload_path` is the caller's: nothing there is removed.
    """
    import shutil
    import tempfile

    if not disk_offload:
        raise ValueError("init_empty_weights_with_disk_offload(disk_offload=False) would lose the initial weights; use "
                         "record_module_init() to build on meta and replay the construction instead")
    if ckpt_path is not None or shard_kwargs is not None:
        raise ValueError("init_empty_weights_with_disk_offload: ckpt_path and shard_kwargs are not supported; load a "
                         "checkpoint with atorch.checkpoint.load_checkpoint after auto_accelerate")
    temporary = offload_path is None
    directory = offload_path or tempfile.mkdtemp(prefix="atorch_meta_offload_")
    created: List[nn.Module] = []
    original_init = nn.Module.__init__

    def tracking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        created.append(self)

    nn.Module.__init__ = tracking_init  # type: ignore[method-assign]
    try:
        try:
            yield
        finally:
            nn.Module.__init__ = original_init  # type: ignore[method-assign]
        _offload_to_disk(_roots(created), directory, include_buffers, temporary)
    except BaseException:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    if temporary:
        try:
            os.rmdir(directory)   # nothing was offloaded: the directory is still empty
        except OSError:
            pass


def _roots(modules: List[nn.Module]) -> List[nn.Module]:
    """The modules that are not a sub-module of another one in `modules`."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    seen, roots = set(), []
    for m in modules:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            roots.append(m)
    return roots


def _offload_to_disk(roots: List[nn.Module], directory: str, include_buffers: bool, temporary: bool) -> None:
    replaced: Dict[int, torch.Tensor] = {}   # id of a real tensor -> its meta stand-in (keeps ties)
    for root in roots:
        for owner in root.modules():
            tables: List[Dict[str, Any]] = [owner._parameters] + ([owner._buffers] if include_buffers else [])
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is None or tensor.is_meta:
                        continue
                    if id(tensor) not in replaced:
                        path = os.path.join(directory, f"{len(replaced)}.pt")
                        torch.save(tensor.detach().cpu(), path)
                        meta: torch.Tensor
                        if isinstance(tensor, nn.Parameter):
                            meta = nn.Parameter(torch.empty_like(tensor, device="meta"),
                                                requires_grad=tensor.requires_grad)
                        else:
                            meta = torch.empty_like(tensor, device="meta")
                        setattr(meta, _OFFLOAD_ATTR, path)
                        if temporary:
                            _remove_with(meta, path)
                        replaced[id(tensor)] = meta
                    table[name] = replaced[id(tensor)]


def reload_meta_module(module: nn.Module, device: Any = "cpu", delete_ckpt_name: bool = True,
                       retie_weights: bool = True) -> nn.Module:
    """Give the offloaded (meta) tensors of `module` their saved initial values on `device`; ties stay tied.

    A module without offloaded tensors is moved with `.to(device)`. Raises ValueError for a
    meta tensor that has no saved value (it was not built under
    `init_empty_weights_with_disk_offload`). `retie_weights` is implied: a tensor shared by
    several modules is loaded once. A file of a temporary offload directory is removed once no
    tensor names it: with `delete_ckpt_name=False` the loaded tensor keeps its name, and the file.
    """
    loaded: Dict[int, torch.Tensor] = {}
    for owner_name, owner in module.named_modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in loaded:
                    path = getattr(tensor, _OFFLOAD_ATTR, None)
                    if path is None:
                        where = f"{owner_name}.{name}" if owner_name else name
                        raise ValueError(f"{where} is on the meta device with no saved value; was it built under "
                                         "init_empty_weights_with_disk_offload()?")
                    value = torch.load(path, map_location=device, weights_only=True)
                    if isinstance(tensor, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                    if not delete_ckpt_name:
                        setattr(value, _OFFLOAD_ATTR, path)
                        remover = _TEMPORARY_FILES.get(path)
                        if remover is not None and remover.detach() is not None:
                            _remove_with(value, path)   # the file lives as long as the tensor naming it
                    loaded[id(tensor)] = value
                table[name] = loaded[id(tensor)]
    return module.to(device)


def materialize_modules_to_device(model: nn.Module, device: Any = None) -> nn.Module:
    """The whole model with its saved initial values on `device` (default: cpu) (ATorch's name)."""
    return reload_meta_module(model, device if device is not None else "cpu")
