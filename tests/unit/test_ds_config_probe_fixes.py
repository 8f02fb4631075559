"""`ds_config` settings that DeepSpeed would run wrong or crash on, refused at validation (pure, every rank alike):
fp16 on CPU under DeepSpeed 3D, switches that are not JSON booleans, torch_autocast, a boolean ZeRO stage and
compute_grad_norm=false (clipping is set at run time and needs the norm).

Pure: no process group, no DeepSpeed import.
"""

import sys
import types

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.ds_3d_parallel_optimization import resolve_ds_config
from atorch.testing import tiny_llama_config

T2D2 = ("parallel_mode", ([("tensor", 2), ("data", 2)], None))
BF16 = ("amp_native", {"dtype": torch.bfloat16})


def _validate(items, world_size=2, device_type="cpu"):
    context = ValidationContext(world_size=world_size, device_type=device_type, model_config=tiny_llama_config(),
                                global_batch_size=8)
    return resolve_strategy(Strategy(items), context)


def _ds3d(ds_config):
    return [T2D2, ("deepspeed_3d_parallel", {"ds_config": ds_config})]


def test_ds3d_fp16_is_refused_on_cpu_like_the_zero_engines():
    with pytest.raises(ValueError, match=r"deepspeed_3d_parallel: ds_config fp16.enabled=true is not supported on "
                                         r"CPU: DeepSpeed's CPU accelerator has no fp16; use \{'bf16'"):
        _validate(_ds3d({"fp16": {"enabled": True}}), world_size=4)
    # Where DeepSpeed has fp16 it stands, and bf16 or fp32 run on CPU.
    _validate(_ds3d({"fp16": {"enabled": True}}), world_size=4, device_type="cuda")
    _validate(_ds3d({"bf16": {"enabled": True}}), world_size=4)
    _validate(_ds3d({"fp16": {"enabled": False}}), world_size=4)


@pytest.mark.parametrize("key", ["bf16", "fp16", "torch_autocast", "amp"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_a_switch_that_is_not_a_boolean_is_refused(key, value):
    cfg = {key: {"enabled": value}}
    expected = rf"ds_config {key}.enabled={value!r} must be true or false"
    with pytest.raises(ValueError, match=expected):
        _validate([BF16, ("zero2", {"use_ds_zero": True, "ds_config": cfg})])
    with pytest.raises(ValueError, match=expected):
        resolve_ds_config(cfg, 1, 1)


def test_bf16_enabled_false_as_a_string_is_not_taken_for_amp_native_bf16():
    # bool("false") is True: the contradiction with amp_native bf16 went unseen and DeepSpeed trained fp32.
    with pytest.raises(ValueError, match=r"zero2: ds_config bf16.enabled='false' must be true or false"):
        _validate([BF16, ("zero2", {"use_ds_zero": True, "ds_config": {"bf16": {"enabled": "false"}}})])


def test_torch_autocast_is_refused_pointing_to_where_precision_is_set():
    cfg = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    with pytest.raises(ValueError, match=r"zero2: ds_config torch_autocast.enabled=true is not supported: precision "
                                         r"is set by amp_native"):
        _validate([("zero2", {"use_ds_zero": True, "ds_config": cfg})])
    with pytest.raises(ValueError, match=r"deepspeed_3d_parallel: ds_config torch_autocast.enabled=true is not "
                                         r"supported: precision is set by ds_config's bf16 or fp16 section"):
        resolve_ds_config(cfg, 1, 1)
    # Off, it changes nothing.
    _validate([("zero2", {"use_ds_zero": True, "ds_config": {"torch_autocast": {"enabled": False}}})])
    with pytest.raises(ValueError, match=r"ds_config torch_autocast='bf16' must be a section"):
        resolve_ds_config({"torch_autocast": "bf16"}, 1, 1)


def test_a_boolean_zero_stage_is_not_stage_one():
    cfg = {"zero_optimization": {"stage": True}}
    with pytest.raises(ValueError, match=r"zero1: ds_config zero_optimization.stage=True must be an integer"):
        _validate([("zero1", {"use_ds_zero": True, "ds_config": cfg})])
    with pytest.raises(ValueError, match=r"deepspeed_3d_parallel: ds_config zero_optimization.stage=True must be"):
        resolve_ds_config(cfg, 1, 1)
    _validate([("zero1", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"stage": 1}}})])
    assert resolve_ds_config({"zero_optimization": {"stage": 1}}, 1, 1)["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize("value", [False, "false", 0])
def test_compute_grad_norm_other_than_true_is_refused_as_clipping_needs_it(value):
    cfg = {"zero_optimization": {"compute_grad_norm": value}}
    expected = (rf"ds_config zero_optimization.compute_grad_norm={value!r} is not supported: DeepSpeed then has no "
                r"gradient norm to clip with, and train_step\(..., max_grad_norm=...\) clips")
    for name in ("zero1", "zero2"):
        with pytest.raises(ValueError, match=f"{name}: {expected}"):
            _validate([(name, {"use_ds_zero": True, "ds_config": cfg})])
    with pytest.raises(ValueError, match=f"deepspeed_3d_parallel: {expected}"):
        resolve_ds_config({"zero_optimization": {"stage": 1, "compute_grad_norm": value}}, 1, 1)
    _validate([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"compute_grad_norm": True}}})])


def test_a_zero_engine_is_built_without_the_pipeline_grid_an_earlier_engine_left(monkeypatch):
    """DeepSpeed keeps the mpu (a pipeline engine's grid) of the last engine given one in `deepspeed.utils.groups`;
    a ZeRO engine built after DeepSpeed 3D in one process took its model-parallel size from it and failed
    ('NoneType' object has no attribute 'get_model_parallel_rank')."""
    from atorch.auto.model_context import ModelContext
    from atorch.auto.opt_lib._sharding import build_deepspeed_engine
    from atorch.distributed.process_group import forget_library_model_parallel

    groups = types.ModuleType("deepspeed.utils.groups")
    groups.mpu, groups.mesh_device, groups._WORLD_GROUP = object(), object(), "kept"
    seen = {}

    def initialize(model, optimizer, model_parameters, lr_scheduler, config, dist_init_required):
        seen.update(mpu=groups.mpu, mesh=groups.mesh_device, config=config)
        return model, optimizer, None, lr_scheduler

    deepspeed = types.ModuleType("deepspeed")
    deepspeed.initialize = initialize
    monkeypatch.setitem(sys.modules, "deepspeed", deepspeed)
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", groups)
    model = torch.nn.Linear(2, 2)
    ctx = ModelContext(model=model, optim=torch.optim.SGD(model.parameters(), lr=0.1))
    build_deepspeed_engine(ctx, "zero2", 2)
    assert seen["mpu"] is None and seen["mesh"] is None and seen["config"]["zero_optimization"]["stage"] == 2
    assert groups._WORLD_GROUP == "kept"   # only the layout is forgotten, not the groups it may reuse
    monkeypatch.delitem(sys.modules, "deepspeed.utils.groups")
    forget_library_model_parallel()        # a process that never imported DeepSpeed: nothing to forget


def test_loading_another_optimizers_state_says_to_load_the_weights_only(tmp_path):
    """A checkpoint of DeepSpeed's CPU Adam (offload) loaded into torch's AdamW was refused without saying what
    to do; here SGD's state into AdamW, the same mismatch of hyperparameters, in one process."""
    from atorch.auto.result import AutoAccelerateResult
    from atorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def result(optim_cls):
        model = torch.nn.Linear(4, 4)
        return AutoAccelerateResult(model=model, optim=optim_cls(model.parameters(), lr=0.1), dataloader=None,
                                    loss_func=lambda batch, out: out.sum(), prepare_input=lambda batch, device=None: batch)

    saved = result(torch.optim.SGD)
    path = save_checkpoint(saved, str(tmp_path / "ckpt"), step=1)
    with pytest.raises(CheckpointError, match=r"no optimizer hyperparameters for \d+ entries, e.g. .*: a different "
                                              r"model, or a different optimizer than the checkpoint's "
                                              r"\(torch\.optim\.sgd\.SGD\).*pass load_optimizer=False to load the "
                                              r"weights and start the optimizer fresh"):
        load_checkpoint(result(torch.optim.AdamW), path)
    fresh = result(torch.optim.AdamW)
    assert not load_checkpoint(fresh, path, load_optimizer=False).optimizer_restored   # the advice works
    assert torch.equal(fresh.model.weight, saved.model.weight)
