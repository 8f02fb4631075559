"""Tensor parallelism (ATorch's `atorch.tensor_parallel` import path; `manual_tp` holds its manual-sharding API)."""
