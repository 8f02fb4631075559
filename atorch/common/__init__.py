"""Small helpers at the import paths ATorch scripts use (`atorch.common.util_func`, `atorch.common.log_utils`)."""
