"""atorch: automatic acceleration of PyTorch / Hugging Face training."""

from atorch.distributed import init_distributed, local_rank, rank, reset_distributed, world_size

__version__ = "0.1.0"
__all__ = ["init_distributed", "local_rank", "rank", "reset_distributed", "world_size", "__version__"]
