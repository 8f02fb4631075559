"""atorch: automatic acceleration of PyTorch / Hugging Face training."""

import os
import sys

# DeepSpeed JIT-compiles its CPU ops (minutes) into TORCH_EXTENSIONS_DIR, by default under each
# user's home. `make install` builds them inside this Python environment instead; pointing there
# when the user has no setting of their own means no script run by any user of the environment
# rebuilds them. Set before anything imports DeepSpeed; an explicit setting always wins.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

from atorch.distributed import init_distributed  # noqa: E402

__version__ = "0.1.0"
__all__ = ["init_distributed", "__version__"]
