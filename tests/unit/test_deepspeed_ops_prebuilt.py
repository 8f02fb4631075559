"""DeepSpeed's CPU op is built once, at install, inside the environment: no script rebuilds it.

`make install` builds it into `<sys.prefix>/torch_extensions`; importing atorch points
TORCH_EXTENSIONS_DIR there when the user has no setting, so a script run without the variable
and with a fresh home directory finds the build instead of compiling for minutes. (The build
must also be checked by the same ninja that made it: importing atorch puts the environment's
`bin/` first on PATH when it holds a ninja, so the script runs here with a PATH that lacks it.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXT_DIR = Path(sys.prefix) / "torch_extensions"

SCRIPT = r"""
import os
import atorch
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):  # comm, and ZeRO offload's optimizer
    get_accelerator().create_op_builder(name).load(verbose=False)
print("EXT", os.environ["TORCH_EXTENSIONS_DIR"])
"""


def _build_files():
    return {p: p.stat().st_mtime_ns for p in EXT_DIR.rglob("*") if p.is_file()}


def test_a_script_without_the_variable_compiles_nothing(tmp_path):
    if not any(EXT_DIR.rglob("*.so")):
        pytest.fail(f"no prebuilt DeepSpeed op under {EXT_DIR}: run `make install` (scripts/prebuild_deepspeed_ops.py)")
    stale = [p for p in EXT_DIR.rglob("lock")]
    assert not stale, f"{stale}: a build was killed midway and its lock makes every later build wait forever; remove it"
    before = _build_files()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env_bin = os.path.join(sys.prefix, "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(env_bin)]
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / ".cache"), DS_ACCELERATOR="cpu",
               PATH=os.pathsep.join(path))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"EXT {EXT_DIR}" in out.stdout
    assert _build_files() == before, "the prebuilt op was rebuilt or changed"
    assert not (tmp_path / ".cache" / "torch_extensions").exists(), "a build was started under the fresh home"
