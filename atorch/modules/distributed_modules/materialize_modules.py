"""ATorch's import path of `materialize_modules_to_device` (it lives in `atorch.utils.meta_model_utils`)."""

from atorch.utils.meta_model_utils import materialize_modules_to_device

__all__ = ["materialize_modules_to_device"]
