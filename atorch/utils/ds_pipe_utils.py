"""ATorch's import path for the DeepSpeed pipeline builder (`atorch.utils.ds_pipe_utils`).

`PipeModuleFromRecordedMeta` lives in `atorch.modules.pipeline.ds_pipe`; it is loaded on first
access so that importing this module does not import DeepSpeed. Both patcher forms work:
atorch's `{container path: patch(module, inputs)}` and ATorch's per-module
`{"wpe": forward_patcher, "h.0": forward_patcher, ...}` (see `atorch.modules.pipeline.patchers`).
"""

from typing import Any

from atorch.modules.pipeline.patchers import default_forward_patcher, default_logit_helper, model_to_module_list

# ATorch's private names, which its scripts import.
_default_forward_patcher = default_forward_patcher
_default_logit_helper = default_logit_helper

__all__ = ["PipeModuleFromRecordedMeta", "default_forward_patcher", "default_logit_helper", "model_to_module_list"]


def __getattr__(name: str) -> Any:
    if name == "PipeModuleFromRecordedMeta":
        from atorch.modules.pipeline.ds_pipe import PipeModuleFromRecordedMeta

        return PipeModuleFromRecordedMeta
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
