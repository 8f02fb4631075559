"""What the example tests share: importing an example script by its path (examples/ is no package)."""

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def load_example() -> Callable[[str], ModuleType]:
    """`load_example("slurm/train.py")`: the script imported as a module (its `__main__` block does not run)."""
    def load(relative: str) -> ModuleType:
        path = EXAMPLES_DIR / relative
        spec = importlib.util.spec_from_file_location("example_" + "_".join(path.with_suffix("").parts[-2:]), path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
