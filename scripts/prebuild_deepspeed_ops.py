"""Build DeepSpeed's CPU ops once, at install time: the shared-memory comm op and CPU Adam.

DeepSpeed's CPU accelerator JIT-compiles the comm op the first time a process group is wrapped
(75-200 s measured on the 2-core machine), and CPU Adam (the optimizer of ZeRO offload, and
`DeepSpeedCPUAdam`) the first time one is built (134 s measured). Building it during `make install` keeps that cost
out of the tests' timeouts; `make` points TORCH_EXTENSIONS_DIR inside .venv/ so each checkout
has its own build (the build is keyed by this checkout's paths).
"""

import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    import deepspeed.ops

    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            print(f"DeepSpeed {name}: not used on this accelerator")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"DeepSpeed {builder.absolute_name()} ready in {time.perf_counter() - start:.0f} s "
              f"({os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')})")


if __name__ == "__main__":
    main()
