import os

import pytest

from atorch.testing.spawn import QUIET_ENV

for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            if not torch.cuda.is_available():
                item.add_marker(skip_gpu)
        if "tests/distributed/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True)
def _fresh_distributed_state_for_each_test():
    """Each test starts without a default process group in the pytest process.

    `auto_accelerate` in a plain process initializes a world of one and leaves it for the
    user's training (as documented); in one pytest process that world would leak into later
    tests (fake process groups, other single-process runs) and fail them far from the cause.
    """
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import atorch

        atorch.reset_distributed()
