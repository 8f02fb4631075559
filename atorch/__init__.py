"""atorch: automatic acceleration of PyTorch / Hugging Face training."""

import os
import shutil
import sys

# DeepSpeed JIT-compiles its CPU ops (minutes) into TORCH_EXTENSIONS_DIR, by default under each
# user's home. `make install` builds them inside this Python environment instead; pointing there
# when the user has no setting of their own means no script run by any user of the environment
# rebuilds them. Set before anything imports DeepSpeed; an explicit setting always wins.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def _prefer_the_environments_ninja() -> None:
    """Put this environment's `bin/` first on PATH when it holds the ninja that built those ops.

    torch runs `ninja` from PATH; a ninja of another version (a system 1.11 against the
    environment's 1.13, seen here) reads the build's dependency log differently and rebuilds
    the op for minutes. An activated environment already has its `bin/` first: this only makes
    `/path/to/env/bin/python train.py` behave the same.
    """
    env_bin = os.path.join(sys.prefix, "bin")
    ours = os.path.join(env_bin, "ninja")
    if not os.access(ours, os.X_OK):
        return
    first = shutil.which("ninja")
    if first is None or os.path.realpath(first) != os.path.realpath(ours):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")


_prefer_the_environments_ninja()

from atorch.deploy import deploy  # noqa: E402 - a function; the package stays importable as atorch.deploy.*
from atorch.distributed import init_distributed, local_rank, rank, reset_distributed, world_size  # noqa: E402

__version__ = "0.1.0"
__all__ = ["deploy", "init_distributed", "local_rank", "rank", "reset_distributed", "world_size", "__version__"]
