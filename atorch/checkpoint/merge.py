"""`merge_checkpoint`: a sharded checkpoint -> a Hugging Face model directory, offline, in one process.

The model is rebuilt on the meta device from the checkpoint's config.json (and LoRA
adapter config), the checkpoint's tensors are assigned to it, and transformers' own
`save_pretrained` writes it: so the keys, tied weights, shard names and index are exactly
what `from_pretrained` expects. Models without a Hugging Face config are written as
safetensors (sharded with an index when large) under their module names.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union, cast

import torch
from torch import nn

from atorch.checkpoint import manifest as mf
from atorch.checkpoint.layout_handlers import MODEL_PREFIX
from atorch.checkpoint.manifest import CheckpointError
from atorch.checkpoint.safe_load import SafeFileSystemReader, load_dcp_metadata, tensor_entries
from atorch.checkpoint.tokenizer_files import recorded_tokenizer, save_tokenizer
from atorch.checkpoint.tp_lora import fold_adapters, save_peft_adapters
from atorch.checkpoint.save_load import (
    ADAPTER_CONFIG_NAME,
    CONFIG_NAME,
    DCP_DIR,
    _quiet_single_process_dcp,
    _read_meta,
    raise_checkpoint_errors,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

_LORA_MODES = ("merge", "adapters")
Item = TypeVar("Item")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def group_by_bytes(items: Iterable[Tuple[str, Item]], max_bytes: int,
                   nbytes: Callable[[Item], int] = _tensor_bytes) -> List[Dict[str, Item]]:
    """`items` in order, in groups of at most `max_bytes` (a larger item is a group of its own).

    `nbytes(item)`: an item's size (default: a tensor's bytes)."""
    groups: List[Dict[str, Item]] = [{}]
    size = 0
    for key, item in items:
        n = nbytes(item)
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = item
        size += n
    return groups


def parse_size(size: Union[int, str]) -> int:
    """Bytes in `size`: an int, or a string like '2GB', '500MB', '1GiB' (decimal units, as transformers'
    `max_shard_size`; '2G' is '2GB', '1Gi' is '1GiB')."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?))?B?\s*", str(size).upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r}; expected a positive int of bytes or a string like '2GB', "
                         "'500MB' or '1GiB'")
    unit = f"{match.group(2)}{match.group(3)}B" if match.group(2) else ""
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def check_merge_options(lora: str, max_shard_size: Union[int, str], dtype: Any = None, model_class: Any = None,
                        out_dir: Any = None, ckpt_dir: Any = None, func: str = "merge_checkpoint",
                        out_arg: str = "out_dir") -> None:
    """Raise ValueError/TypeError for a bad `lora` mode, shard size, dtype, model class or output path.

    `ckpt_dir`: the checkpoint to merge (named in the error when `out_dir` is that checkpoint).
    `func`: the entry point named in a type error; `out_arg`: the name its caller gave `out_dir`.
    """
    if out_dir is not None:
        check_merge_output(out_dir, ckpt_dir, func, out_arg)
    if lora not in _LORA_MODES:
        raise ValueError(f"lora={lora!r}; valid values are {list(_LORA_MODES)}")
    parse_size(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        # An integer dtype would truncate every weight to whole numbers without a word.
        raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype such as torch.bfloat16, or None to keep "
                        "the saved dtypes")
    if model_class is not None and not isinstance(model_class, type):
        raise TypeError(f"model_class={model_class!r} must be a class (e.g. transformers.LlamaForCausalLM), "
                        "or None for the class the checkpoint recorded")


def check_merge_output(out_dir: Any, ckpt_dir: Any = None, func: str = "merge_checkpoint",
                       out_arg: str = "out_dir") -> None:
    """Refuse, before anything is written, an `out_dir` that is a file, or where the Hugging Face files
    would land among checkpoint files: the checkpoint being merged (`ckpt_dir`), another checkpoint, a
    directory inside one, or a checkpoint root. Any of these would make the checkpoint fail verification
    (or, for a root, mix a model into the directory that save and rotation own)."""
    mf.check_dir_arg(func, out_arg, out_dir)
    out = os.fspath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out_arg}={out!r} is an existing file; give a directory for the Hugging Face model")
    blocker = _file_in_the_way(out)
    if blocker is not None:   # found late, it named the staging directory the merge writes first
        raise ValueError(f"{out_arg}={out!r} cannot be created: {blocker!r} is an existing file, not a directory; "
                         "give a directory for the Hugging Face model that is not under a file")
    why = mf.checkpoint_use(out)
    if why is None:
        return
    if ckpt_dir is not None and isinstance(ckpt_dir, (str, os.PathLike)):
        try:
            merged: Optional[str] = mf.resolve_checkpoint_dir(os.fspath(ckpt_dir))
        except CheckpointError:
            merged = None  # reported as such by the merge itself
        if merged is not None and os.path.realpath(merged) == os.path.realpath(out):
            why = f"is the checkpoint being merged (it holds {mf.MANIFEST_NAME})"
    raise ValueError(f"{out_arg}={out!r} {why}; merging would write config.json and the weights among checkpoint "
                     "files. Merge into a directory outside the checkpoints (a new one, or one holding an earlier "
                     "merged model)")


def _file_in_the_way(path: str) -> Optional[str]:
    """The nearest existing ancestor of a not-yet-existing `path` when that is not a directory (a regular file), else
    None: the directory could not be created."""
    if os.path.exists(path):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent if os.path.exists(parent) and not os.path.isdir(parent) else None


def check_model_class(model_class: type, ckpt_dir: str, model_meta: Dict[str, Any]) -> None:
    """Raise ValueError when `model_class` (a transformers class) cannot be built from the checkpoint's config.json:
    its `config_class` is another architecture's (GPT2LMHeadModel for a Llama checkpoint), which would fail deep
    inside transformers with an AttributeError on a config field. Classes without a `config_class` are not checked."""
    from transformers import AutoConfig

    expected = getattr(model_class, "config_class", None)
    if not isinstance(expected, type):
        return
    config = AutoConfig.from_pretrained(ckpt_dir)
    if isinstance(config, expected):
        return
    recorded = (model_meta.get("class") or "?").rpartition(".")[2]
    architectures = getattr(config, "architectures", None) or []
    raise ValueError(f"model_class={model_class.__name__} is built from a {expected.__name__}, but the checkpoint "
                     f"{ckpt_dir} holds a {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r}, "
                     f"saved from {recorded}{f', architectures {architectures}' if architectures else ''}); pass "
                     f"model_class=None to use the class the checkpoint recorded, or a class whose config_class is "
                     f"{type(config).__name__}")


def _check_checkpoint_root(path: str) -> None:
    """Raise CheckpointError naming the checkpoints in `path` when it is a checkpoint root without a `latest`
    pointer (a run that saved under its own names, or a `latest` removed): which one to merge is the user's call."""
    if mf.is_checkpoint(path) or os.path.isfile(os.path.join(path, mf.LATEST_NAME)):
        return
    held = [p for p, _ in mf.list_checkpoints(path)]
    if held:
        names = [os.path.basename(p) for p in held]
        shown = f"{names[:5]}{' ...' if len(names) > 5 else ''}"
        raise CheckpointError(f"{path} is not a checkpoint but a directory of checkpoints {shown} without a "
                              f"'{mf.LATEST_NAME}' pointer; give the one to merge, e.g. the newest: {held[-1]}")


def merge_checkpoint(ckpt_dir: str, out_dir: str, *, tokenizer: Any = None,
                     max_shard_size: Union[int, str] = "2GB", lora: str = "merge",
                     dtype: Optional[torch.dtype] = None, model_class: Optional[type] = None) -> str:
    """Write the model of checkpoint `ckpt_dir` as a Hugging Face model directory `out_dir`.

    Runs in one process without a process group or GPU. `tokenizer`: a tokenizer (its
    `save_pretrained` is called) or a directory whose tokenizer files are copied; None: the
    tokenizer the checkpoint recorded (`save_checkpoint(..., tokenizer=...)`), if any. `lora`:
    "merge" folds the adapters into the base weights (W + B @ A * scale, peft's
    `merge_and_unload`) and writes a plain model (untied, with a warning, where the model ties its
    embedding and output layer and an adapter sat on one of them: the two merged weights differ);
    "adapters" writes only the adapters (adapter_model.safetensors + adapter_config.json), which
    peft applies to the tied base model as training did. `dtype` casts floating weights.
    `model_class` overrides the class recorded in the checkpoint (needed for custom classes); a
    transformers class built from another architecture's config is refused with ValueError before
    any tensor is read. `ckpt_dir`: a checkpoint, or a directory whose `latest` names one.
    `out_dir` may be new or an existing directory: the merged files are written into it as
    `save_pretrained` does, replacing an earlier model's (its config and every weight file, so a
    stale shard is never loaded) and leaving other files there (a README, notes) as they are. A
    file, a checkpoint, a directory inside one, or a checkpoint root (holding `latest` or
    checkpoints) is refused with ValueError before anything is written. Returns `out_dir`.
    """
    mf.check_dir_arg("merge_checkpoint", "ckpt_dir", ckpt_dir)
    mf.check_dir_arg("merge_checkpoint", "out_dir", out_dir)
    check_merge_options(lora, max_shard_size, dtype, model_class, out_dir, ckpt_dir)
    _check_checkpoint_root(os.fspath(ckpt_dir))
    ckpt_dir = mf.resolve_checkpoint_dir(os.fspath(ckpt_dir))
    manifest = verify_checkpoint(ckpt_dir, collective=False)
    meta = _read_meta(ckpt_dir)
    model_meta = meta.get("model") or {}
    is_hf = bool(model_meta.get("has_config")) and CONFIG_NAME in manifest.files
    # Tensor-parallel LoRA keeps its adapters as parameters of its own layers, with scales in meta.json.
    peft_adapter, tp_lora = model_meta.get("peft_adapter"), model_meta.get("tp_lora")
    if lora == "adapters" and not (peft_adapter or tp_lora):
        raise ValueError(f"lora='adapters' but the checkpoint {ckpt_dir} has no LoRA adapters; merge it with "
                         "lora='merge' (the default) to write the whole model")
    # peft LoRA on a plain nn.Module (no config.json) is rebuilt from model_class() and adapter_config.json.
    plain_peft = bool(peft_adapter) and not is_hf
    if plain_peft and model_class is None:
        raise ValueError(f"{ckpt_dir} holds peft LoRA adapters on a model that is not a transformers model (no "
                         f"{CONFIG_NAME}); pass model_class=<the model's class>, constructible without arguments, "
                         "to merge it")
    needed = ([CONFIG_NAME] if not plain_peft else []) + ([ADAPTER_CONFIG_NAME] if peft_adapter else [])
    lacking = [name for name in needed if name not in manifest.files or (name == CONFIG_NAME and not is_hf)]
    if (peft_adapter or tp_lora) and lacking:
        raise CheckpointError(f"{ckpt_dir}: a LoRA checkpoint needs {' and '.join(lacking)} to be merged; this one "
                              f"lacks {'it' if len(lacking) == 1 else 'them'}")
    if is_hf and model_class is not None:
        check_model_class(model_class, ckpt_dir, model_meta)
    # Everything but a LoRA model streams: one output shard in memory at a time.
    streams = not peft_adapter and not tp_lora
    state = None if streams else load_model_tensors(ckpt_dir, manifest)
    if state is not None and tp_lora and lora == "merge":
        state = fold_adapters(state, tp_lora, ckpt_dir)
    if state is not None and dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    # Written aside and moved in only when complete: a fresh output directory appears whole, like a
    # checkpoint, and an existing one keeps its old model if the merge fails.
    fresh = not os.path.exists(out_dir) or (os.path.isdir(out_dir) and not os.listdir(out_dir))
    staging = f"{os.path.normpath(out_dir)}{mf.STAGING_MARK}{uuid.uuid4().hex[:8]}"
    target = staging
    os.makedirs(target)
    try:
        if plain_peft:
            _save_plain_peft(ckpt_dir, cast(Dict[str, torch.Tensor], state), target, lora, cast(type, model_class),
                             str(peft_adapter), max_shard_size)
        elif is_hf and streams:
            _stream_hf(ckpt_dir, manifest, model_meta, target, max_shard_size, dtype, model_class)
        elif tp_lora and lora == "adapters":
            save_peft_adapters(cast(Dict[str, torch.Tensor], state), tp_lora, model_meta.get("hf_prefix") or "",
                               target, ckpt_dir)
        elif is_hf:
            _save_hf(ckpt_dir, model_meta, cast(Dict[str, torch.Tensor], state), target, max_shard_size, lora,
                     model_class)
        else:
            stream_safetensors(ckpt_dir, manifest, target, max_shard_size, dtype)
        del state
        if tokenizer is None:
            tokenizer = recorded_tokenizer(ckpt_dir)
        if tokenizer is not None:
            save_tokenizer(tokenizer, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if fresh:
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(staging, out_dir)
        mf.fsync_dir(os.path.dirname(os.path.abspath(out_dir)))
    else:
        _replace_model_files(staging, out_dir)
    return out_dir


# Weight files of a Hugging Face directory: the ones a new model must replace as a set.
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def _replace_model_files(staging: str, out_dir: str) -> None:
    """Move the merged files from `staging` into the existing `out_dir`, removing the weight files of an
    earlier model there first (as `save_pretrained` does): from_pretrained prefers a single
    model.safetensors over a sharded index, so a stale one would load the old weights."""
    new = set(os.listdir(staging))
    stale = sorted(n for n in os.listdir(out_dir) if _WEIGHT_FILE.match(n) and n not in new)
    if stale:
        logger.warning("merge_checkpoint: removing the earlier model's weight files %s from %s", stale, out_dir)
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    for name in sorted(new):
        dst = os.path.join(out_dir, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(os.path.join(staging, name), dst)
    os.rmdir(staging)
    mf.fsync_dir(out_dir)


def load_model_tensors(ckpt_dir: str, manifest: mf.Manifest) -> Dict[str, torch.Tensor]:
    """Every model tensor of a verified checkpoint, full size, on CPU, keyed by module name."""
    import torch.distributed.checkpoint as dcp

    dcp_dir = os.path.join(ckpt_dir, DCP_DIR)
    entries = tensor_entries(load_dcp_metadata(os.path.join(dcp_dir, ".metadata")))
    state = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in entries.items() if k.startswith(MODEL_PREFIX)}
    if not state:
        raise CheckpointError(f"{os.path.join(dcp_dir, '.metadata')}: the checkpoint holds no model tensors")
    allowed = [n[len(DCP_DIR) + 1:] for n in manifest.files if n.startswith(DCP_DIR + "/")]
    with _quiet_single_process_dcp(), raise_checkpoint_errors():
        dcp.load(state, storage_reader=SafeFileSystemReader(dcp_dir, allowed_files=allowed), no_dist=True)
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}


def stream_safetensors(ckpt_dir: str, manifest: mf.Manifest, out_dir: str, max_shard_size: Union[int, str] = "2GB",
                       dtype: Optional[torch.dtype] = None, names: Optional[Dict[str, str]] = None) -> None:
    """The checkpoint's model tensors as safetensors files, read shard by shard: `model.safetensors`, or
    `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`.

    `names`: the output name of each module-name key to write (default: every model tensor
    under its own name).

    Shards are planned from the DCP metadata alone; each one is read (DCP reads only those
    tensors' byte ranges), written and freed before the next. Peak memory above the process's
    own: one output shard (at most `max_shard_size`, or the largest tensor when that is larger)
    plus DCP's read buffer of one tensor chunk (at most the largest tensor).
    """
    import torch.distributed.checkpoint as dcp

    dcp_dir = os.path.join(ckpt_dir, DCP_DIR)
    entries = {k: v for k, v in tensor_entries(load_dcp_metadata(os.path.join(dcp_dir, ".metadata"))).items()
               if k.startswith(MODEL_PREFIX)}
    if not entries:
        raise CheckpointError(f"{os.path.join(dcp_dir, '.metadata')}: the checkpoint holds no model tensors")
    out_name = {k: k[len(MODEL_PREFIX):] for k in entries} if names is None else {
        MODEL_PREFIX + k: v for k, v in names.items()}
    entries = {k: v for k, v in entries.items() if k in out_name}
    allowed = [n[len(DCP_DIR) + 1:] for n in manifest.files if n.startswith(DCP_DIR + "/")]

    def out_dtype(dt: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and dt.is_floating_point else dt

    def out_bytes(entry: Tuple[Tuple[int, ...], torch.dtype]) -> int:
        shape, dt = entry
        return torch.Size(shape).numel() * torch.empty((), dtype=out_dtype(dt)).element_size()

    ordered = ((key, entries[key]) for key in sorted(entries, key=lambda k: out_name[k]))
    plan = [list(group) for group in group_by_bytes(ordered, parse_size(max_shard_size), out_bytes)]

    def read(keys: List[str]) -> Dict[str, torch.Tensor]:
        shard = {k: torch.empty(entries[k][0], dtype=entries[k][1]) for k in keys}
        with _quiet_single_process_dcp(), raise_checkpoint_errors():
            dcp.load(shard, storage_reader=SafeFileSystemReader(dcp_dir, allowed_files=allowed), no_dist=True)
        return {out_name[k]: v.to(out_dtype(v.dtype)).contiguous() for k, v in shard.items()}

    write_safetensors_shards(plan, read, out_dir)


def write_safetensors_shards(plan: Sequence[List[str]], read: Callable[[List[str]], Dict[str, torch.Tensor]],
                             out_dir: str) -> None:
    """Write `read(keys)` for each group of keys in `plan`, one group at a time (each freed before the
    next is read): `model.safetensors` for one group, else `model-0000i-of-0000n.safetensors` files and
    `model.safetensors.index.json`, the layout `from_pretrained` and `load_sharded_checkpoint` read.
    Written by hand rather than with huggingface_hub's splitter: the groups are planned before any
    tensor exists (from DCP metadata), and a shard must be read only when it is written."""
    from safetensors.torch import save_file

    weight_map: Dict[str, str] = {}
    total = 0
    for i, keys in enumerate(plan):
        shard = read(keys)
        name = ("model.safetensors" if len(plan) == 1
                else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del shard
    if len(plan) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def _resolve_model_class(model_meta: Dict[str, Any], config: Any, model_class: Optional[type],
                         ckpt_dir: str) -> Any:
    """A callable `f(config) -> model`: `model_class`, the recorded transformers class, the config's
    architecture, or the causal-LM class of the config's type."""
    if model_class is not None:
        return model_class
    import transformers

    recorded = model_meta.get("class") or ""
    # Only classes of the transformers package are imported by name from a checkpoint file.
    if recorded.startswith("transformers."):
        module_name, _, cls_name = recorded.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            pass
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    # Pipeline stages record their own class; atorch pipelines split causal LMs.
    # The mapping AutoModelForCausalLM.from_config reads (with configs registered through AutoModelForCausalLM).
    if type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM.from_config
    raise CheckpointError(f"{ckpt_dir}: the model class {recorded!r} is not a transformers class, and the "
                          f"config ({type(config).__name__}, model_type {getattr(config, 'model_type', None)!r}) "
                          "names no transformers architecture and has no causal-LM class; pass model_class= (the "
                          "model's class, e.g. transformers.T5ForConditionalGeneration) to merge_checkpoint")


def build_hf_model(ckpt_dir: str, model_meta: Dict[str, Any], state: Dict[str, torch.Tensor],
                   model_class: Optional[type] = None) -> nn.Module:
    """The checkpoint's model (a PeftModel for LoRA) with `state` assigned, built without initializing weights.

    Weights the model ties and the checkpoint holds under each name stay separate tensors here: a LoRA adapter
    folded into one of them must not reach the other (`settle_word_embedding_tie` ties them again when equal)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt_dir)
    cls = _resolve_model_class(model_meta, config, model_class, ckpt_dir)
    with torch.device("meta"):
        model = cls(config)
    cls = type(model)
    adapter = model_meta.get("peft_adapter")
    if adapter:
        from peft import PeftConfig, get_peft_model

        peft_config = PeftConfig.from_pretrained(ckpt_dir)
        with torch.device("meta"):
            model = get_peft_model(model, peft_config, adapter_name=adapter)
    else:
        prefix = model_meta.get("hf_prefix") or ""
        if prefix:
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    shared = _shared_names(model)     # read before assigning: assignment replaces the shared parameters
    result = model.load_state_dict(state, strict=False, assign=True)
    # A parameter shared under several names may be saved under one of them only: it takes the loaded one.
    loaded_alias = {k: next((n for n in shared.get(k, []) if n not in result.missing_keys), None)
                    for k in result.missing_keys}
    missing = [k for k, alias in loaded_alias.items() if alias is None]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{os.path.join(ckpt_dir, DCP_DIR)}: the checkpoint does not match {cls.__name__}({CONFIG_NAME}): "
            f"missing {missing[:5]} ({len(missing)}), unexpected {result.unexpected_keys[:5]} "
            f"({len(result.unexpected_keys)})")
    for name, alias in loaded_alias.items():
        _set_parameter(model, name, model.get_parameter(cast(str, alias)))
    return model


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    """Make `param` the parameter `name` (a dotted path) of `model`."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)


def _tie_configs(config: Any) -> List[Any]:
    """The config objects whose `tie_word_embeddings` decides a model's embedding tie: the model's config and,
    for composite models, its decoder's text config (transformers 4 reads the latter, 5 the former)."""
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text(decoder=True)
        if text is not config:
            configs.append(text)
    return [c for c in configs if getattr(c, "tie_word_embeddings", False)]


def settle_word_embedding_tie(model: Any, ckpt_dir: str) -> None:
    """Tie a transformers model's input embedding and output layer again if they hold equal weights; untie them
    for good (`tie_word_embeddings=False` in the config `save_pretrained` writes) where they differ.

    They differ after a LoRA adapter on one of them (`lm_head` or `embed_tokens`) was folded: training shared
    one base weight but added the adapter's delta on one side only, so tying the merged weights again would drop
    the delta or apply it to both sides, and the merged model would no longer compute what was trained.
    """
    configs = _tie_configs(getattr(model, "config", None))
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        inp = out = None
    a, b = getattr(inp, "weight", None), getattr(out, "weight", None)
    differ = (bool(configs) and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is not b
              and not a.is_meta and not b.is_meta and not (a.shape == b.shape and torch.equal(a, b)))
    if differ:
        logger.warning("merge_checkpoint: %s: the model ties its input embedding and output layer, but a LoRA adapter "
                       "on one of them made their merged weights differ; the merged model is written untied (both "
                       "weights, tie_word_embeddings=false) so that it computes what was trained", ckpt_dir)
        for config in configs:
            config.tie_word_embeddings = False
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if differ and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        raise CheckpointError(f"{ckpt_dir}: {type(model).__name__} ties its output layer to its input embedding "
                              "even with tie_word_embeddings=false, so the LoRA adapter on one of them cannot be "
                              "folded; merge with lora='adapters' instead")


def _stream_hf(ckpt_dir: str, manifest: mf.Manifest, model_meta: Dict[str, Any], out_dir: str,
               max_shard_size: Union[int, str], dtype: Optional[torch.dtype], model_class: Optional[type]) -> None:
    """A Hugging Face model directory, streamed: the model is built on the meta device only for its
    key names and weight ties (a tied copy is written once, as `save_pretrained` does)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt_dir)
    cls = _resolve_model_class(model_meta, config, model_class, ckpt_dir)
    with torch.device("meta"):
        model = cls(config)
    tied = set(_tied_names(model))
    prefix = model_meta.get("hf_prefix") or ""
    wanted = {prefix + k: k for k in model.state_dict() if k not in tied}
    dcp_dir = os.path.join(ckpt_dir, DCP_DIR)
    saved = {k[len(MODEL_PREFIX):] for k in tensor_entries(load_dcp_metadata(os.path.join(dcp_dir, ".metadata")))
             if k.startswith(MODEL_PREFIX)}
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith(prefix) and k not in wanted and k[len(prefix):] not in tied)
    if missing or unexpected:
        raise CheckpointError(
            f"{dcp_dir}: the checkpoint does not match {type(model).__name__}({CONFIG_NAME}): "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
    stream_safetensors(ckpt_dir, manifest, out_dir, max_shard_size, dtype, names=wanted)
    config = model.config
    config.architectures = [type(model).__name__]
    if dtype is not None:
        config.torch_dtype = dtype
    config.save_pretrained(out_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(out_dir)


def _shared_names(model: nn.Module) -> Dict[str, List[str]]:
    """{name: every name of its parameter} for the parameters `model` shares under several names (weight ties)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: group for group in names.values() if len(group) > 1 for name in group}


def _tied_names(model: nn.Module) -> List[str]:
    """The later names of parameters shared under several names (what `save_pretrained` writes once)."""
    seen: Dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        else:
            seen[id(p)] = name
    return tied


def _save_hf(ckpt_dir: str, model_meta: Dict[str, Any], state: Dict[str, torch.Tensor], out_dir: str,
             max_shard_size: Union[int, str], lora: str, model_class: Optional[type]) -> None:
    model: Any = build_hf_model(ckpt_dir, model_meta, state, model_class)   # a transformers (or peft) model
    if model_meta.get("peft_adapter"):
        if lora == "adapters":
            model.save_pretrained(out_dir, safe_serialization=True)
            return
        model = _merge_peft(model)
    settle_word_embedding_tie(model, ckpt_dir)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size, safe_serialization=True)


def _save_plain_peft(ckpt_dir: str, state: Dict[str, torch.Tensor], out_dir: str, lora: str, model_class: type,
                     adapter: str, max_shard_size: Union[int, str]) -> None:
    """peft LoRA on a plain nn.Module: `model_class()` wrapped by peft with the checkpoint's adapter_config.json and
    loaded with its tensors; lora="merge" writes the merged model's state dict as model.safetensors, or in shards
    of `max_shard_size` with an index (for `model_class().load_state_dict`, or transformers'
    `load_sharded_checkpoint(model_class(), out_dir)`), lora="adapters" peft's adapter files (for
    `PeftModel.from_pretrained(model_class(), out_dir)`, as peft supports custom modules)."""
    from peft import LoraConfig, get_peft_model

    try:
        base = model_class()
    except TypeError as e:
        raise ValueError(f"model_class={model_class.__name__} cannot be built without arguments ({e}); a LoRA "
                         f"checkpoint of a plain nn.Module ({ckpt_dir}) is merged by building model_class() and "
                         "loading the checkpoint into it: pass a class whose constructor needs no arguments (e.g. a "
                         "subclass that fixes them)") from e
    model = get_peft_model(base, LoraConfig.from_pretrained(ckpt_dir), adapter_name=adapter)
    model.load_state_dict(state, strict=True)
    if lora == "adapters":
        model.save_pretrained(out_dir, safe_serialization=True)
        return
    merged = model.merge_and_unload().state_dict()
    plan = [list(group) for group in group_by_bytes(merged.items(), parse_size(max_shard_size))]
    # Tied weights are written under each name (as the checkpoint holds them): safetensors refuses shared storage.
    write_safetensors_shards(plan, lambda keys: {k: merged[k].detach().clone().contiguous() for k in keys}, out_dir)


def _merge_peft(model: Any) -> Any:
    """peft's `merge_and_unload` of `model`, with the model's embedding tie left as configured.

    The loaded weights are separate tensors (`build_hf_model`), so peft would untie every merged model by pointer;
    whether the tie holds is decided by the merged values (`settle_word_embedding_tie`).
    """
    tied = _tie_configs(model.get_base_model().config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input and output embeddings are no longer tied after merging")
        merged = model.merge_and_unload()
    for config in tied:
        config.tie_word_embeddings = True
    return merged
