"""`deploy(model_or_path, tensor_parallel_size=N)`: a tensor-parallel model behind an in-process proxy.

Every rank is a worker process; the caller is not a rank. The caller is typically a web
server with many threads: keeping it out of the process group means a slow or failed
collective can never block or corrupt the server, the server process needs no accelerator
(the ranks own the GPUs), and it can watch the ranks and raise when one dies instead of
hanging in a collective with it. The price is one copy of the inputs and outputs (token
ids and logits) through a socket, small next to a forward pass.

Workers are started as `python -m atorch.deploy.worker` (not multiprocessing's spawn, which
re-imports the caller's `__main__`: a plain `python app.py` without a main guard would
deploy again in every worker), each with one end of a Unix socket pair (see `protocol`).

Lifecycle: the workers end on `close()` / leaving `with deploy(...) as model:`, at normal
interpreter exit (atexit), and when the caller is killed, even by SIGKILL: a worker exits on
EOF of its socket and, if busy in a collective, within `PARENT_POLL_S` when its parent pid
changes (plus PR_SET_PDEATHSIG when deployed from the main thread).
"""

from __future__ import annotations

import atexit
import copy
import os
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Sequence, Union, cast

import torch
from torch import nn

from atorch.deploy.proxy import DeployedModel, WorkerGroup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source(model_or_path: Union[nn.Module, str, os.PathLike]) -> Dict[str, Any]:
    """How the workers get the model, and the config the proxy shows; raises ValueError for what cannot be deployed."""
    if isinstance(model_or_path, nn.Module):
        cls = type(model_or_path)
        config = getattr(model_or_path, "config", None)
        if not cls.__module__.startswith("transformers.") or config is None:
            raise ValueError(f"deploy: {cls.__name__} is not a Hugging Face transformers model; deploy a "
                             "transformers model object, a merged Hugging Face folder or an atorch checkpoint of one")
        dtypes = {p.dtype for p in model_or_path.parameters() if p.is_floating_point()}
        return {"source": "module", "class": f"{cls.__module__}.{cls.__name__}", "config": config.to_dict(),
                "attn_implementation": getattr(config, "_attn_implementation", None),
                "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None}
    path = os.fspath(model_or_path)
    if not os.path.isdir(path):
        raise ValueError(f"deploy: {path!r} is neither a model object nor a directory")
    from atorch.checkpoint import manifest as mf

    if mf.is_checkpoint(path) or os.path.isfile(os.path.join(path, mf.LATEST_NAME)):
        from atorch.checkpoint.save_load import _read_meta, verify_checkpoint
        from atorch.deploy.worker import check_deployable_checkpoint

        ckpt = mf.resolve_checkpoint_dir(path)     # CheckpointError (a ValueError) for a broken `latest`
        # Every file against the manifest, here and once: a corrupted checkpoint is a CheckpointError before any
        # worker starts, not a WorkerError from each worker after they have started; the workers load this
        # checkpoint (not `latest` read again) without hashing it again.
        verify_checkpoint(ckpt, collective=False)
        check_deployable_checkpoint(ckpt, _read_meta(ckpt).get("model") or {})
        return {"source": "atorch_checkpoint", "path": os.path.abspath(ckpt), "verified": True}
    if os.path.isfile(os.path.join(path, "config.json")):
        return {"source": "hf_folder", "path": os.path.abspath(path)}
    raise ValueError(f"deploy: {path!r} is neither an atorch checkpoint ({mf.MANIFEST_NAME}) nor a Hugging Face "
                     "model folder (config.json + weights)")


def _config_of(model_or_path: Union[nn.Module, str, os.PathLike], source: Dict[str, Any]) -> Any:
    if source["source"] == "module":
        return copy.deepcopy(cast(Any, model_or_path).config)  # source "module": a transformers model
    from transformers import AutoConfig

    path = source["path"]
    if source["source"] == "atorch_checkpoint":
        from atorch.checkpoint import manifest as mf

        path = mf.resolve_checkpoint_dir(path)
    return AutoConfig.from_pretrained(path)


def _check_tensor_parallel(model_or_path: Union[nn.Module, str, os.PathLike], config: Any, tp_size: int) -> None:
    """The checks each worker's sharding would make (heads divisible, a plan for the model), here, before
    any worker starts: a ValueError now rather than a WorkerError after the workers have loaded the weights.
    A folder's model is built on the meta device from its config (nothing is read); a model that cannot
    be built that way is left to the workers."""
    from atorch.tensor_parallel import validate_tensor_parallel

    if isinstance(model_or_path, nn.Module):
        model = model_or_path
    else:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001 - not a causal LM transformers builds from its config: the workers decide
            return
    try:
        validate_tensor_parallel(model, None, tp_size)
    except ValueError as e:
        raise ValueError(f"deploy: tensor_parallel_size={tp_size}: {e}") from None


def _generation_config_of(model_or_path: Union[nn.Module, str, os.PathLike], source: Dict[str, Any],
                          config: Any) -> Any:
    """The generation defaults the workers' models have: the model object's, or the folder's
    generation_config.json (what from_pretrained reads), else derived from the model config."""
    from transformers import GenerationConfig

    if source["source"] == "module":
        own = getattr(model_or_path, "generation_config", None)
        return copy.deepcopy(own) if own is not None else GenerationConfig.from_model_config(config)
    path = source["path"]
    if source["source"] == "atorch_checkpoint":
        from atorch.checkpoint import manifest as mf

        path = mf.resolve_checkpoint_dir(path)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(config)


def deploy(model_or_path: Union[nn.Module, str, os.PathLike], tensor_parallel_size: int = 1, *,
           device: str = "cpu", dtype: Optional[torch.dtype] = None, fuse: Optional[Sequence[Any]] = None,
           start_timeout_s: float = 300.0, collective_timeout_s: float = 600.0) -> DeployedModel:
    """Start `tensor_parallel_size` worker processes serving `model_or_path`; return its proxy.

    Args:
        model_or_path: a transformers model object (its weights are streamed to the workers), a
            merged Hugging Face folder (each worker loads it), or an atorch checkpoint directory
            (each worker loads it whole and shards it: any saved layout works; a LoRA checkpoint is
            refused with ValueError before any worker starts: merge it first, `atorch merge`; so is one
            that fails verification against its manifest, with CheckpointError, a ValueError).
        tensor_parallel_size: ranks; the model is split by atorch's tensor-parallel plans and
            returns full logits, so every rank generates the same tokens.
        device: "cpu" (gloo) or "cuda" (rank r on GPU r % count, NCCL).
        dtype: cast the weights (e.g. torch.bfloat16); None keeps the source's.
        fuse: kinds/class names for `module_replace.fuse` on each worker before sharding, or None.
        start_timeout_s: how long building the model may take.
        collective_timeout_s: the process group's timeout (a hung collective fails after it).

    The proxy serializes calls (one request at a time on the workers; concurrent callers wait
    their turn) and raises within about a second when a worker has died. Use it as a context
    manager, or call `close()`.
    """
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or \
            tensor_parallel_size < 1:
        raise ValueError(f"deploy: tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"deploy: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("deploy: device='cuda' but CUDA is not available here")
    if fuse is not None:
        fuse = [f.__name__ if isinstance(f, type) else f for f in fuse]
    source = _source(model_or_path)
    if dtype is not None:
        source["dtype"] = str(dtype).removeprefix("torch.")
    setup = {**source, "device": device, "fuse": fuse, "timeout_s": collective_timeout_s}
    config = _config_of(model_or_path, source)
    if tensor_parallel_size > 1 and fuse is None:
        _check_tensor_parallel(model_or_path, config, tensor_parallel_size)
    state = None
    if source["source"] == "module":
        state = {k: v.detach() for k, v in cast(nn.Module, model_or_path).state_dict().items()}

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    pdeathsig = threading.current_thread() is threading.main_thread()
    conns: List[Connection] = []
    procs: List[subprocess.Popen] = []
    try:
        for rank in range(tensor_parallel_size):
            ours, theirs = socket.socketpair()
            cmd = [sys.executable, "-m", "atorch.deploy.worker", "--fd", str(theirs.fileno()), "--rank", str(rank),
                   "--world", str(tensor_parallel_size), "--parent", str(os.getpid())]
            procs.append(subprocess.Popen(cmd + (["--pdeathsig"] if pdeathsig else []), env=env,
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL))
            theirs.close()
            conns.append(Connection(ours.detach()))
        workers = WorkerGroup(procs, conns)
        workers.start(setup, state, start_timeout_s)
    except BaseException:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        raise
    proxy = DeployedModel(workers, config, tensor_parallel_size, _generation_config_of(model_or_path, source, config))
    _LIVE.add(proxy)
    return proxy


_LIVE: "weakref.WeakSet[DeployedModel]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for proxy in list(_LIVE):
        proxy.close()
