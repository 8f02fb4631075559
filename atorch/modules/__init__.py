"""Module implementations that optimizations swap into user models (see `atorch.modules.fused`)."""
