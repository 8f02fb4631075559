"""A user's DeepSpeed config (`ds_config`), read, merged over what atorch derives, and checked.

Shared by the DeepSpeed ZeRO engines (`zero1`/`zero2`/`fsdp` with use_ds_zero=True) and
`deepspeed_3d_parallel`. Pure: no DeepSpeed import, no collective; every error is a ValueError
naming the key, the user's value and the value atorch's strategy implies, so it is raised
identically on every rank during validation. Registers nothing.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

DsConfigSpec = Union[None, str, Dict[str, Any]]
"""What a `ds_config` field holds: None, a JSON file path, or a JSON-compatible dict."""

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed's default `reduce_bucket_size` and `allgather_bucket_size` (elements). Its reduce
# bucket is one buffer of that many elements in the module's dtype, allocated however small the
# model (1 GB a rank in bf16): for the backward pass at stages 1-2, for the whole run at stage 3.
DS_DEFAULT_BUCKET_ELEMENTS = 500_000_000
# ZeRO-1/2 assert that `allgather_bucket_size` is a multiple of their NCCL start alignment (2 elements:
# 4 bytes of 16-bit values), on every backend; a model with an odd number of trainable elements (a bias
# over an odd vocabulary) would otherwise fail in DeepSpeed's constructor.
DS_BUCKET_ALIGNMENT = 2


def bucket_elements(trainable_elements: int) -> int:
    """The reduce/allgather bucket atorch asks DeepSpeed for: the model's trainable elements (rounded up
    to DeepSpeed's alignment), at most DeepSpeed's default. A bucket larger than every gradient it can
    hold changes nothing but the memory: a model smaller than the default fills one bucket either way,
    so the reductions (and their overlap with backward) are the same."""
    aligned = -(-max(1, int(trainable_elements)) // DS_BUCKET_ALIGNMENT) * DS_BUCKET_ALIGNMENT
    return int(min(DS_DEFAULT_BUCKET_ELEMENTS, aligned))


def user_bucket_elements(cfg: Mapping[str, Any]) -> Optional[int]:
    """The user's `zero_optimization.reduce_bucket_size`, or None when the config leaves it unset."""
    return _user_elements(cfg, "reduce_bucket_size")


def user_stage3_elements(cfg: Mapping[str, Any]) -> Tuple[Optional[int], Optional[int]]:
    """The user's ZeRO-3 `(stage3_param_persistence_threshold, stage3_prefetch_bucket_size)`, None
    where unset (DeepSpeed's defaults apply; 0 is a valid setting of either: nothing persists, no prefetch)."""
    return (_user_elements(cfg, "stage3_param_persistence_threshold"),
            _user_elements(cfg, "stage3_prefetch_bucket_size"))


def _user_elements(cfg: Mapping[str, Any], key: str) -> Optional[int]:
    value = (cfg.get("zero_optimization") or {}).get(key)
    if value in (None, "auto"):
        return None
    try:
        elements = int(float(value))
    except (TypeError, ValueError):
        elements = -1
    if elements < 0 or isinstance(value, bool):
        raise ValueError(f"ds_config zero_optimization.{key}={value!r} must be a non-negative number of elements")
    return elements


def with_derived_buckets(cfg: Mapping[str, Any], trainable_elements: int) -> Dict[str, Any]:
    """`cfg` with `reduce_bucket_size`/`allgather_bucket_size` sized from `trainable_elements`
    (`bucket_elements`) where it runs a ZeRO optimizer (stage >= 1) and leaves them unset; the
    user's values win. Without it DeepSpeed allocates its 5e8-element default whatever the model."""
    if not isinstance(zero_stage_of(cfg), int) or zero_stage_of(cfg) < 1:
        return dict(cfg)
    bucket = bucket_elements(trainable_elements)
    return merge_ds_config({"zero_optimization": {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}}, cfg)


def normalize_ds_config(who: str, value: Any) -> DsConfigSpec:
    """The form a Config keeps: None, a path string, or a deep copy of a dict of JSON values.

    The copy is what the strategy's JSON file stores, so a config that JSON cannot hold is
    refused here rather than when the strategy is saved.
    """
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{who}: ds_config must be a dict or a JSON file path, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: ds_config must hold JSON values only (it is DeepSpeed's JSON config): {e}") from e


def _without_auto(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """`cfg` without its "auto" values, at any depth.

    Configs written for Hugging Face's Trainer say "auto" for what the launcher knows (batch
    sizes, accumulation, clipping, bucket sizes); here that is: atorch derives the key, or
    DeepSpeed's default applies.
    """
    out: Dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, str) and value == "auto":
            continue
        out[key] = _without_auto(value) if isinstance(value, dict) else value
    return out


def load_ds_config(who: str, raw: Any) -> Dict[str, Any]:
    """A fresh dict of the user's config (None: empty), "auto" values dropped; the caller may edit it."""
    return _without_auto(_read_ds_config(who, raw))


def _read_ds_config(who: str, raw: Any) -> Dict[str, Any]:
    spec = normalize_ds_config(who, raw)
    if spec is None:
        return {}
    if isinstance(spec, str):
        try:
            with open(spec) as f:
                loaded = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{who}: ds_config {spec!r} is not a readable JSON file: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{who}: ds_config {spec!r} must hold a JSON object, got {type(loaded).__name__}")
        spec = loaded
    check_misspelled_keys(who, spec)
    return spec   # normalize_ds_config already copied a dict


# DeepSpeed's top-level config sections and settings (0.19), and the keys of its `zero_optimization`
# section (`DeepSpeedZeroConfig`'s fields and aliases). DeepSpeed ignores a key it does not know, so
# a misspelled one (`zero_optimisation`) silently trains without the user's settings. The lists are
# not exhaustive (new DeepSpeed versions add keys, and importing DeepSpeed to ask is too slow for a
# validation): only a key that is not listed and is *close* to a listed one is refused.
DS_TOP_LEVEL_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "torch_autocast", "zero_optimization", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "steps_per_print", "wall_clock_breakdown", "dump_state",
    "memory_breakdown", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "aio", "elasticity", "autotuning", "checkpoint", "data_types", "communication_data_type",
    "seq_parallel_communication_data_type", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "disable_allgather", "dataloader_drop_last", "pipeline", "compression_training", "data_efficiency",
    "curriculum_learning", "sparse_attention", "quantize_training", "eigenvalue", "progressive_layer_drop",
    "nebula", "weight_quantization", "hybrid_engine", "timers", "compile", "tensor_parallel",
    "use_data_before_expert_parallelism", "graph_harvesting", "gradient_accumulation_dtype",
)
DS_ZERO_KEYS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
    "stage3_param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "mics_shard_size", "mics_hierarchical_params_gather", "leaf_module", "compute_grad_norm",
    "parameter_alignment", "zenflow",
)
# How alike (difflib's ratio) an unknown key must be to a known one to be taken for its misspelling.
MISSPELLING_RATIO = 0.85


def check_misspelled_keys(who: str, cfg: Mapping[str, Any]) -> None:
    """ValueError for a key of `cfg` (or of its `zero_optimization`) that DeepSpeed does not know and
    that is a near miss of one it does, e.g. `zero_optimisation` or `reduce_bucket_szie`."""
    sections = [("", cfg, DS_TOP_LEVEL_KEYS)]
    zero = cfg.get("zero_optimization")
    if isinstance(zero, Mapping):
        sections.append(("zero_optimization.", zero, DS_ZERO_KEYS))
    for prefix, section, known in sections:
        for key in section:
            if not isinstance(key, str) or key in known:
                continue
            close = difflib.get_close_matches(key, known, n=1, cutoff=MISSPELLING_RATIO)
            if close:
                raise ValueError(f"{who}: ds_config key {prefix + key!r} is not a DeepSpeed setting (DeepSpeed would "
                                 f"ignore it); did you mean {prefix + close[0]!r}?")


def merge_ds_config(derived: Mapping[str, Any], user: Mapping[str, Any]) -> Dict[str, Any]:
    """`user` over `derived`, recursively for nested sections (e.g. a user's `zero_optimization`
    with only `offload_optimizer` keeps atorch's `stage`)."""
    out = json.loads(json.dumps(dict(derived)))
    for key, value in user.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_ds_config(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value))
    return out


def complete_batch_sizes(who: str, cfg: Dict[str, Any], data_size: int) -> Tuple[int, int, int]:
    """Fill the missing batch keys of `cfg` by DeepSpeed's rule; returns (train_batch_size, micro, accumulation).

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data size.
    """
    values = {k: cfg.get(k) for k in BATCH_KEYS}
    for key, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{who}: ds_config {key}={value!r} must be a positive integer")
    total, micro, gas = (values[k] for k in BATCH_KEYS)
    if total is None:
        micro, gas = micro or 1, gas or 1
        total = micro * gas * data_size
    elif micro is None:
        gas = gas or 1
        if total % (gas * data_size) != 0:
            raise ValueError(f"{who}: ds_config train_batch_size={total} is not divisible by "
                             f"gradient_accumulation_steps={gas} x data size {data_size}")
        micro = total // (gas * data_size)
    elif gas is None:
        if total % (micro * data_size) != 0:
            raise ValueError(f"{who}: ds_config train_batch_size={total} is not divisible by "
                             f"train_micro_batch_size_per_gpu={micro} x data size {data_size}")
        gas = total // (micro * data_size)
    if total != micro * gas * data_size:
        raise ValueError(f"{who}: ds_config train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={gas} x data size {data_size} = {micro * gas * data_size}")
    cfg.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
    return total, micro, gas


def zero_stage_of(cfg: Mapping[str, Any], default: int = 0) -> Any:
    return (cfg.get("zero_optimization") or {}).get("stage", default)


def offload_devices(cfg: Mapping[str, Any]) -> Tuple[str, str]:
    """(optimizer offload device, parameter offload device) of a config; "none" when not offloaded."""
    zero = cfg.get("zero_optimization") or {}
    return ((zero.get("offload_optimizer") or {}).get("device", "none") or "none",
            (zero.get("offload_param") or {}).get("device", "none") or "none")


def _precision_enabled(cfg: Mapping[str, Any], key: str) -> Optional[bool]:
    """True/False when the user's config says so for `bf16`/`fp16`, None when it does not mention it.
    `cfg` has passed `check_switches` (a section, a JSON boolean `enabled`) and `load_ds_config`
    (no "auto" values)."""
    enabled = (cfg.get(key) or {}).get("enabled")
    return None if enabled is None else bool(enabled)


def half_dtype(config: Mapping[str, Any]) -> Optional[torch.dtype]:
    """The half precision a resolved DeepSpeed config trains in (its module and flat partitions): bfloat16,
    float16, or None for fp32."""
    if _precision_enabled(config, "bf16"):
        return torch.bfloat16
    return torch.float16 if _precision_enabled(config, "fp16") else None


# Sections whose `enabled` atorch or DeepSpeed reads as a switch: a string there ("false") would be read
# differently by the two, so only a JSON boolean is accepted.
DS_SWITCH_SECTIONS = ("bf16", "fp16", "amp", "torch_autocast")


def check_switches(who: str, cfg: Mapping[str, Any], precision_hint: str) -> None:
    """ValueError for what atorch reads from `cfg` that it would read differently from DeepSpeed, or that
    trains differently from what the strategy says, before anything runs (pure, so on every rank alike):

    - a section of `DS_SWITCH_SECTIONS` that is not a JSON object, or whose `enabled` is not a boolean;
    - `torch_autocast` enabled: precision is the strategy's (`precision_hint` says where it is set);
    - `zero_optimization.stage` that is not an int (`true` is not stage 1);
    - `zero_optimization.compute_grad_norm=false` (`check_compute_grad_norm`).
    """
    for key in DS_SWITCH_SECTIONS:
        if key in cfg and not isinstance(cfg[key], Mapping):
            raise ValueError(f"{who}: ds_config {key}={cfg[key]!r} must be a section (a JSON object)")
        enabled = (cfg.get(key) or {}).get("enabled")
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"{who}: ds_config {key}.enabled={enabled!r} must be true or false (a JSON boolean; "
                             f"DeepSpeed and atorch would read a string differently)")
    if (cfg.get("torch_autocast") or {}).get("enabled"):
        raise ValueError(f"{who}: ds_config torch_autocast.enabled=true is not supported: precision is set by "
                         f"{precision_hint}; drop torch_autocast from ds_config")
    zero = cfg.get("zero_optimization")
    if zero is not None and not isinstance(zero, Mapping):
        raise ValueError(f"{who}: ds_config zero_optimization={zero!r} must be a section (a JSON object)")
    stage = (zero or {}).get("stage")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool)):
        raise ValueError(f"{who}: ds_config zero_optimization.stage={stage!r} must be an integer (0, 1, 2 or 3)")
    check_compute_grad_norm(who, zero or {})


def check_compute_grad_norm(who: str, zero: Mapping[str, Any]) -> None:
    """ValueError for `zero_optimization.compute_grad_norm` other than true.

    false makes DeepSpeed skip the global gradient norm, which its clipping divides by: atorch sets the
    engine's clipping at run time (`train_step(..., max_grad_norm=)`, bypassing DeepSpeed's config check),
    and the first clipped step then fails inside DeepSpeed (`float(None)`). Whether a later train_step
    clips is not known here, and the norm it saves is one local norm and a scalar all-reduce per step,
    so the key is refused rather than left to fail at a step.
    """
    value = zero.get("compute_grad_norm", True)
    if value is True:
        return
    raise ValueError(f"{who}: ds_config zero_optimization.compute_grad_norm={value!r} is not supported: DeepSpeed "
                     "then has no gradient norm to clip with, and train_step(..., max_grad_norm=...) clips through "
                     "the engine (it would fail at the first clipped step); drop compute_grad_norm from ds_config")


def zero_ds_config(who: str, raw: Any, *, stage: int, data_size: int, global_batch: Optional[int],
                   accumulation_steps: int, autocast_dtype: Optional[torch.dtype],
                   trainable_elements: Optional[int] = None) -> Dict[str, Any]:
    """The config of a DeepSpeed ZeRO engine: atorch's derived keys with the user's `raw` merged over them.

    atorch's required keys, which the user's config may repeat but not contradict:
    - `zero_optimization.stage`: the optimization's stage (zero1: 1, zero2: 2, fsdp: 3);
    - the batch keys: the dataloader's global batch (`dataloader_args["batch_size"]`) split over
      the data ranks and the `gradient_accumulation` optimization's steps;
    - `bf16`/`fp16`: on exactly when amp_native asks for that dtype;
    - `gradient_clipping`: off (train_step's `max_grad_norm` sets it per step).
    Derived, and overridden by the user's values: `reduce_bucket_size` and `allgather_bucket_size`
    from `trainable_elements` (`bucket_elements`; DeepSpeed's defaults when it is None).
    Everything else (offload, overlap, an `optimizer` section...) is the user's.
    """
    user = load_ds_config(who, raw)
    check_switches(who, user, "amp_native (add ('amp_native', {'dtype': torch.bfloat16}))")
    user_stage = zero_stage_of(user, default=stage)
    if user_stage != stage:
        raise ValueError(f"{who}: ds_config zero_optimization.stage={user_stage!r} but {who} is DeepSpeed ZeRO stage "
                         f"{stage}; drop the key or use the optimization of that stage (zero1: 1, zero2: 2, fsdp: 3)")
    _check_precision(who, user, autocast_dtype)
    clip = user.get("gradient_clipping", 0.0)
    if clip not in (0, 0.0, None):
        raise ValueError(f"{who}: ds_config gradient_clipping={clip!r}: clipping is train_step's max_grad_norm here "
                         "(it sets the engine's clipping at every step); drop the key and pass "
                         f"train_step(result, batch, max_grad_norm={clip!r})")
    _check_offload(who, user, stage)
    user_bucket_elements(user)      # a bucket or ZeRO-3 size that is not a count of elements raises here
    user_stage3_elements(user)
    derived = derived_zero_config(stage, data_size, global_batch, accumulation_steps, autocast_dtype,
                                  trainable_elements)
    _check_batch(who, user, derived, data_size, global_batch, accumulation_steps)
    return merge_ds_config(derived, user)


def derived_zero_config(stage: int, data_size: int, global_batch: Optional[int], accumulation_steps: int,
                        autocast_dtype: Optional[torch.dtype],
                        trainable_elements: Optional[int] = None) -> Dict[str, Any]:
    """What atorch's strategy implies for a ZeRO engine, before the user's config."""
    gas = accumulation_steps
    # DeepSpeed insists on a batch size; without a dataloader it only feeds its throughput logs.
    micro = max(1, global_batch // data_size // gas) if global_batch else 1
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * data_size * gas,
        "zero_optimization": {"stage": stage},
        # The user's torch optimizer is passed as DeepSpeed's "client optimizer", so the update
        # rule is exactly the one asked for; DeepSpeed warns about it unless told it is intended.
        "zero_allow_untested_optimizer": True,
        # DeepSpeed 0.19 clips gradients to norm 1.0 unless told otherwise; training must match
        # the user's plain loop, which does not clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 2 ** 31 - 1,
        "wall_clock_breakdown": False,
    }
    if trainable_elements is not None:
        config = with_derived_buckets(config, trainable_elements)
    if autocast_dtype is torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif autocast_dtype is torch.float16:
        config["fp16"] = {"enabled": True}
    return config


def _check_precision(who: str, user: Mapping[str, Any], autocast_dtype: Optional[torch.dtype]) -> None:
    amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast_dtype) if autocast_dtype is not None else None
    for key in ("bf16", "fp16"):
        enabled = _precision_enabled(user, key)
        if enabled is None or enabled == (key == amp):
            continue
        if enabled:
            asked = f"amp_native is {amp}" if amp else "the strategy has no amp_native"
            raise ValueError(f"{who}: ds_config {key}.enabled=true but {asked}; precision is amp_native's here: "
                             f"drop {key} from ds_config and add ('amp_native', {{'dtype': torch."
                             f"{'bfloat16' if key == 'bf16' else 'float16'}}})")
        raise ValueError(f"{who}: ds_config {key}.enabled=false but amp_native asks for {key}; drop {key} from "
                         "ds_config, or remove amp_native to train in fp32")
    if "amp" in user and (user["amp"] or {}).get("enabled"):
        raise ValueError(f"{who}: ds_config amp (NVIDIA apex) is not supported; use amp_native")


def _check_offload(who: str, user: Mapping[str, Any], stage: int) -> None:
    optimizer_device, param_device = offload_devices(user)
    for key, device in (("offload_optimizer", optimizer_device), ("offload_param", param_device)):
        if device not in OFFLOAD_DEVICES:
            raise ValueError(f"{who}: ds_config zero_optimization.{key}.device={device!r} must be one of "
                             f"{list(OFFLOAD_DEVICES)}")
    if param_device != "none" and stage < 3:
        raise ValueError(f"{who}: ds_config zero_optimization.offload_param needs ZeRO stage 3 (parameters are "
                         f"partitioned only there), but {who} is stage {stage}; use fsdp with use_ds_zero=True")


def _check_batch(who: str, user: Dict[str, Any], derived: Mapping[str, Any], data_size: int,
                 global_batch: Optional[int], accumulation_steps: int) -> None:
    given = {k: user[k] for k in BATCH_KEYS if user.get(k) is not None}
    if not given:
        return
    complete = dict(given)
    total, micro, gas = complete_batch_sizes(who, complete, data_size)
    if gas != accumulation_steps:
        raise ValueError(f"{who}: ds_config gradient_accumulation_steps={gas} but the strategy accumulates "
                         f"{accumulation_steps} micro-batch(es) per step; accumulation is the gradient_accumulation "
                         f"optimization's here: add ('gradient_accumulation', {{'steps': {gas}}}) and drop the "
                         "batch keys from ds_config")
    if global_batch is not None:
        expected = {k: derived[k] for k in BATCH_KEYS}
        for key, value in given.items():
            if value != expected[key]:
                raise ValueError(f"{who}: ds_config {key}={value} disagrees with the dataloader: its global batch "
                                 f"{global_batch} (dataloader_args batch_size) over {data_size} data rank(s) and "
                                 f"{accumulation_steps} accumulation step(s) gives {key}={expected[key]}; drop the "
                                 "batch keys from ds_config (atorch derives them) or change batch_size")
    # Without a dataloader the user's (consistent) batch keys stand: DeepSpeed only logs them.
    user.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)


def check_one_scheduler(who: str, ds_config: Mapping[str, Any], lr_scheduler_cls: Any) -> None:
    """Refuse an LR scheduler given twice: DeepSpeed drops ds_config's `scheduler` when it is handed one built
    from `lr_scheduler_cls`, so a warm-up configured there would silently never run."""
    if "scheduler" not in ds_config or lr_scheduler_cls is None:
        return
    section = ds_config["scheduler"]
    kind = section.get("type", "?") if isinstance(section, Mapping) else section
    name = getattr(lr_scheduler_cls, "__name__", repr(lr_scheduler_cls))
    raise ValueError(f"{who}: both lr_scheduler_cls={name} and ds_config['scheduler'] (type {kind!r}) are given; "
                     "DeepSpeed would run the first and ignore the second: pass one")
