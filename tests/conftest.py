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
