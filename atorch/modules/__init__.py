"""Module implementations that optimizations swap into user models.

`atorch.modules.fused`: fused kernels (module_replace); `atorch.modules.distributed_modules`:
tensor-parallel layers, their communication functions and random streams (tensor_parallel);
`atorch.modules.pipeline`: pipeline stages. Nothing is imported here; import the subpackage.
"""
