"""Refusals and messages of the strategy machinery: module_replace classes of no replaceable kind, fp16 amp
without optim_func, a model left on the meta device, a dry run's ModelSource, and the result's field types."""

import logging
import typing
from typing import Optional, Tuple

import pytest
import torch

from atorch.auto.model_context import ModelContext
from atorch.testing import tiny_llama


def test_module_replace_refuses_a_class_of_no_replaceable_kind():
    from atorch.auto.opt_lib.module_replace import ModuleReplaceConfig, fuse, replace_modules

    model = tiny_llama()
    config = ModuleReplaceConfig(attention=False, norm=False, activation=False,
                                 classes=("LlamaDecoderLayer", "LlamaRMSNorm"))
    with pytest.raises(ValueError, match=r"module_replace: classes \['LlamaDecoderLayer'\] are of no kind "
                                         r"module_replace replaces .* e.g. those of LlamaForCausalLM: "
                                         r"\['LlamaAttention', 'LlamaMLP', 'LlamaRMSNorm'\]"):
        replace_modules(model, config)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"   # refused before anything was replaced
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with pytest.raises(ValueError, match=r"classes \['LlamaDecoderLayer'\] are of no kind"):
        fuse(model, [LlamaDecoderLayer])
    summary = replace_modules(model, ModuleReplaceConfig(attention=False, norm=False, activation=False,
                                                         classes=("LlamaRMSNorm",)))
    assert summary.counts()["norm"] == 5


def test_fp16_amp_without_optim_func_makes_the_grad_scaler_and_says_how_to_use_it(caplog):
    from atorch.auto import auto_accelerate

    with caplog.at_level(logging.WARNING):
        status, result, _ = auto_accelerate(tiny_llama(), None, load_strategy=[("amp_native", {"dtype": "fp16"})])
    assert status and result.optim is None and isinstance(result.grad_scaler, torch.amp.GradScaler)
    assert any("amp_native(float16) without optim_func" in r.getMessage() and "grad_scaler.scale(loss)" in
               r.getMessage() for r in caplog.records)
    # The user's own loop, torch's way.
    optim = torch.optim.SGD(result.model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in result.model.parameters()]
    ids = torch.randint(4, 100, (2, 8))
    loss = result.loss_func(None, result.model(input_ids=ids, labels=ids))
    result.grad_scaler.scale(loss).backward()
    result.grad_scaler.step(optim)
    result.grad_scaler.update()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, result.model.parameters()))


def test_a_model_left_on_the_meta_device_names_its_first_parameter():
    from atorch.auto.engine import place_model

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"still has 4 parameter tensor\(s\) on the meta device after all "
                                         r"optimizations, the first '0.weight'"):
        place_model(ModelContext(model=model))


def test_dry_run_says_which_model_source_condition_failed():
    from atorch.auto.dry_runner import dry_run
    from atorch.auto.model_source import ModelSource
    from atorch.auto.strategy import Strategy

    ctx = ModelContext(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"source is a ModelSource of another model \(Linear at 0x[0-9a-f]+\) than "
                                         r"ctx.model \(Linear at 0x[0-9a-f]+\); pass ModelSource\(ctx.model\)"):
        dry_run(ctx, Strategy([]), source=ModelSource(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"source is a ModelSource of ctx.model whose weights are not offloaded "
                                         r"\(it is not entered, or already exited\)"):
        dry_run(ctx, Strategy([]), source=ModelSource(ctx.model))


def test_result_fields_have_their_real_types():
    from deepspeed import DeepSpeedEngine

    from atorch.auto.result import AutoAccelerateResult
    from atorch.auto.search.results import SearchResult
    from atorch.checkpoint.state import DataPosition
    from atorch.modules.pipeline.native import NativePipeline
    from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer

    names = {"DeepSpeedEngine": DeepSpeedEngine, "SearchResult": SearchResult, "DataPosition": DataPosition,
             "NativePipeline": NativePipeline, "MultiDimParallelRandomizer": MultiDimParallelRandomizer}
    hints = typing.get_type_hints(AutoAccelerateResult, localns=names)
    assert hints["search"] == Optional[SearchResult]
    assert hints["data_origin"] == Optional[Tuple[Optional[int], DataPosition]]
    assert hints["pipeline"] == Optional[NativePipeline]
    assert hints["randomizer"] == Optional[MultiDimParallelRandomizer]
    assert hints["engine"] == Optional[DeepSpeedEngine]


def test_batch_norm_under_data_parallelism_is_warned_about_once_with_the_conversion(caplog):
    """Per-rank batch statistics (running stats differ between ranks): one warning naming the first BatchNorm
    and torch's conversion; none for one data-parallel rank or for SyncBatchNorm."""
    from torch import nn

    from atorch.auto.engine import warn_unsynced_batch_norm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(4))
    with caplog.at_level(logging.WARNING, logger="atorch.auto.engine"):
        warn_unsynced_batch_norm(model, 1)
        warn_unsynced_batch_norm(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4))), 2)
        assert not caplog.records
        warn_unsynced_batch_norm(model, 2)
    assert len(caplog.records) == 1
    assert "BatchNorm '1' (BatchNorm2d) and any others use per-rank batch statistics over 2" in caplog.text
    assert "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)" in caplog.text
