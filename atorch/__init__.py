"""atorch: automatic acceleration of PyTorch / Hugging Face training."""

from atorch.deploy import deploy  # a function; the package stays importable as atorch.deploy.*
from atorch.distributed import init_distributed

__version__ = "0.1.0"
__all__ = ["deploy", "init_distributed", "__version__"]
