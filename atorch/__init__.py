"""atorch: automatic acceleration of PyTorch / Hugging Face training."""

from atorch.distributed import init_distributed

__version__ = "0.1.0"
__all__ = ["init_distributed", "__version__"]
