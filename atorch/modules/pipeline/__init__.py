"""Pipeline parallelism for Hugging Face decoders: patchers, balanced stages, DeepSpeed and native engines.

`PipeModuleFromRecordedMeta` (a DeepSpeed `PipelineModule`) is importable from here; it is
loaded on first access so that importing atorch never imports DeepSpeed.
"""

from typing import Any

from atorch.modules.pipeline.batches import causal_lm_loss, hf_batch_fn, split_micro_batches
from atorch.modules.pipeline.partition import StagePlan, balanced_split, plan_stages, stage_parameter_counts
from atorch.modules.pipeline.patchers import (
    PATCHER_PRESETS,
    PatchedLayer,
    PieceSpec,
    expand_patcher,
    get_custom_patcher,
    get_gpt2_custom_patcher,
    get_llama_custom_patcher,
)

__all__ = ["PATCHER_PRESETS", "PatchedLayer", "PieceSpec", "PipeModuleFromRecordedMeta", "StagePlan",
           "balanced_split", "causal_lm_loss", "expand_patcher", "get_custom_patcher", "get_gpt2_custom_patcher",
           "get_llama_custom_patcher", "hf_batch_fn", "plan_stages", "split_micro_batches",
           "stage_parameter_counts"]


def __getattr__(name: str) -> Any:
    if name == "PipeModuleFromRecordedMeta":
        from atorch.modules.pipeline.ds_pipe import PipeModuleFromRecordedMeta

        return PipeModuleFromRecordedMeta
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
