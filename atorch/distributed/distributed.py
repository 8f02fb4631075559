"""Process-group initialization and rank queries.

Works the same under the launcher (env vars set by torch elastic) and in a plain
`python script.py`, where it fills in a single-process world.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

_SUPPORTED_BACKENDS = ("gloo", "nccl")


def find_free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill_single_process_env() -> None:
    # `srun python script.py`: Slurm's variables say who this task is (atorch/distributed/slurm.py).
    from atorch.distributed.slurm import is_slurm_task, slurm_environment

    if is_slurm_task(os.environ):
        os.environ.update(slurm_environment(os.environ))
    # A plain `python script.py` has none of these; default to a world of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())


def default_backend() -> str:
    """nccl when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def init_distributed(
    backend: Optional[str] = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
) -> bool:
    """Initialize the default process group once; later calls are no-ops.

    Returns True when a process group is ready. Raises ValueError for an unknown
    backend, before touching the network.
    """
    if backend is None:
        backend = default_backend()
    if backend not in _SUPPORTED_BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(_SUPPORTED_BACKENDS)} or None")
    if dist.is_initialized():
        return True
    _fill_single_process_env()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = _elastic_attempt_store(timeout)
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return True


def _elastic_attempt_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torch elastic, a store whose keys are private to this restart attempt.

    Measured with torch 2.13 and gloo: after a restart, env:// initialization sometimes
    reads the previous attempt's listening address from the agent's store and fails with
    "Connection refused" in connectFullMesh. Prefixing the keys by attempt avoids that.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    is_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=not is_agent_store and int(os.environ["RANK"]) == 0, timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"/atorch/{run_id}/attempt_{attempt}", base)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def device() -> torch.device:
    """cuda:LOCAL_RANK when the process group runs on nccl (or CUDA without a group), else cpu."""
    if is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", local_rank())
        return torch.device("cpu")
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def device_type() -> str:
    return device().type


# Called by `destroy_distributed` before the default group goes (the parallel-group module
# registers forgetting its default layout): layers above register here instead of this module
# importing them.
_ON_DESTROY: List[Callable[[], None]] = []


def on_destroy(callback: Callable[[], None]) -> None:
    """Run `callback` at every `destroy_distributed()`, before the default process group is destroyed."""
    if callback not in _ON_DESTROY:
        _ON_DESTROY.append(callback)


def destroy_distributed() -> None:
    """Tear down the parallel groups and the default group, if any."""
    for callback in _ON_DESTROY:
        callback()
    if is_initialized():
        dist.destroy_process_group()
