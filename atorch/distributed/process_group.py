"""Process-group initialization and rank queries (the lowest layer of atorch.distributed).

Works the same under the launcher (env vars set by torch elastic), under `srun`, and in a
plain `python script.py`, where it fills in a single-process world. Layers above register
their teardown with `on_destroy` instead of being imported here.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import socket
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from atorch.distributed import launcher_watch, timeouts

logger = logging.getLogger(__name__)

_SUPPORTED_BACKENDS = ("gloo", "nccl")


def find_free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill_single_process_env() -> None:
    # `srun python script.py`: Slurm's variables say who this task is (atorch/distributed/slurm.py).
    from atorch.distributed.slurm import is_slurm_task, outside_step_note, slurm_environment

    if is_slurm_task(os.environ):
        os.environ.update(slurm_environment(os.environ))
    else:
        note = outside_step_note(os.environ)
        if note is not None and "slurm_outside_step" not in _LOGGED_ONCE:
            _LOGGED_ONCE.add("slurm_outside_step")
            logger.warning(note)   # the allocation's other tasks stay idle: worth saying even when quiet
    # A plain `python script.py` has none of these; default to a world of one.
    # An empty value counts as unset (ATorch's tests and some schedulers export MASTER_ADDR="").
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        if not os.environ.get(key):
            os.environ[key] = value
            _FILLED_IN[key] = value
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = _FILLED_IN["MASTER_PORT"] = str(find_free_port())


# The variables the single-process fill-in wrote ({name: value}); `destroy_distributed` removes
# them, so the next init of this process picks a new free port instead of the previous world's
# (whose store may still hold it).
_FILLED_IN: Dict[str, str] = {}


def _unfill_single_process_env() -> None:
    for key, value in list(_FILLED_IN.items()):
        if os.environ.get(key) == value:   # untouched since: ours to remove
            del os.environ[key]
    _FILLED_IN.clear()


def default_backend() -> str:
    """nccl when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def init_distributed(
    backend: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
    *,
    set_cuda_device_using_local_rank: bool = False,
    coworker_num_per_node: int = 0,
    elastic_or_fault_tolerant: bool = False,
) -> bool:
    """Initialize the default process group once; later calls with the same backend (or None) are no-ops.

    Returns True when a process group is ready. Raises ValueError for an unknown backend, for
    nccl in a process without CUDA GPUs, for a backend other than the one the group already runs
    on, or for a malformed RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, before touching the network. `timeout`
    is the collectives' timeout (default: `ATORCH_COLLECTIVE_TIMEOUT` seconds, else 30 min);
    joining the rendezvous has its own, `ATORCH_INIT_TIMEOUT` (default 60 s): a rank that
    cannot meet the others at MASTER_ADDR:MASTER_PORT in that time (the port is another job's,
    a rank failed to start) raises `DistributedInitError` naming the address.

    The keywords of ATorch's `init_distributed` are accepted (see `_apply_atorch_init_options`):
    `set_cuda_device_using_local_rank` selects `cuda:cuda_index()` when CUDA exists (nccl always
    does): `cuda:LOCAL_RANK`, or `cuda:0` for a process that sees one GPU, and ValueError when
    neither fits; `elastic_or_fault_tolerant` is ignored (restarts are the launcher's job:
    `python -m atorch.distributed.run --fault_tolerant`); `coworker_num_per_node` > 0
    (CPU coworker processes) is not supported and raises.
    """
    requested = backend
    if backend is None:
        backend = default_backend()
    if isinstance(backend, str):
        backend = backend.lower()
    if backend not in _SUPPORTED_BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(_SUPPORTED_BACKENDS)} or None")
    if dist.is_initialized():
        if requested is not None:
            _check_same_backend(backend)
    elif backend == "nccl":
        _check_nccl_has_gpus()
    _apply_atorch_init_options(set_cuda_device_using_local_rank, coworker_num_per_node, elastic_or_fault_tolerant)
    if dist.is_initialized():
        return True
    _fill_single_process_env()
    rank_, world, addr, port = _rendezvous_env()
    collective = timeout if timeout is not None else timeouts.collective_timeout()
    join = timeouts.init_timeout()
    if backend == "nccl":
        torch.cuda.set_device(cuda_index())
    timeouts.enable_flight_recorder()
    _import_dynamo_before_the_group_exists()
    store = _rendezvous_store(rank_, world, addr, port, join)
    dist.init_process_group(backend=backend, store=store, rank=rank_, world_size=world, timeout=collective)
    _set_torch_group_timeout(collective)
    timeouts.install(store)
    _register_exit_teardown()
    launcher_watch.watch_launcher()
    return True


def _check_same_backend(backend: str) -> None:
    """ValueError when the process group already runs on other backends than `backend`.

    A second `init_distributed("nccl")` after a gloo initialization returned True and kept gloo: the caller
    went on believing its collectives ran on the GPUs. The same backend again stays a no-op (so does None,
    checked by the caller: "whatever is there"); a group of several backends (`"cpu:gloo,cuda:nccl"`, the
    user's own `init_process_group`) has each of them.
    """
    try:
        current = str(dist.get_backend())
    except (RuntimeError, ValueError):    # no default group to ask (torch's own state says none): nothing to compare
        return
    names = {part.rpartition(":")[2].strip().lower() for part in current.split(",")}
    if backend not in names:
        usable = " or ".join(f"backend={name!r}" for name in sorted(names) if name in _SUPPORTED_BACKENDS)
        raise ValueError(f"init_distributed(backend={backend!r}): the process group is already initialized with "
                         f"backend {current!r}, and a group's backend cannot change; call atorch.reset_distributed() "
                         f"first to start again with {backend!r}, or pass {usable + ' or ' if usable else ''}None to "
                         "use the group as it is")


def _check_nccl_has_gpus() -> None:
    """ValueError, before any network use, when backend="nccl" is asked for in a process without CUDA GPUs.

    Without it, the first CUDA call (choosing this process's GPU) failed with a message about LOCAL_RANK,
    CUDA_VISIBLE_DEVICES and Slurm flags, which are not the problem.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    if torch.version.cuda is None:
        why = f"this PyTorch build ({torch.__version__}) has no CUDA support"
    else:
        why = (f"no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    raise ValueError(f"backend='nccl' needs CUDA GPUs, but {why}; use backend='gloo' to run on CPUs, or None (the "
                     "default) for nccl where there are GPUs and gloo where there are none")


# torch's timeouts for groups created without one, as they were before `init_distributed` replaced them
# (`(default_pg_timeout, default_pg_nccl_timeout)` of torch.distributed.distributed_c10d); None: not replaced.
_TORCH_GROUP_TIMEOUTS: Optional[Tuple[Any, Any]] = None


def _set_torch_group_timeout(timeout: Optional[datetime.timedelta]) -> None:
    """Make `timeout` torch's timeout for every process group created without one (None: torch's own again).

    Why torch's default and not only `timeout=` at each `new_group`: groups atorch does not create
    call by call take it too. `DeviceMesh` (the parallel groups of `ParallelMesh`) has no timeout
    argument in torch 2.13; its `backend_override` options would carry one, but they must be an
    Options object of the right backend per dimension and they stop a whole-world dimension from
    reusing the default group. DeepSpeed creates its groups with `torch.distributed.new_group(ranks)`
    (`deepspeed.utils.groups`, pipeline topology) and wraps the existing default group in
    `deepspeed.init_distributed`, so they get this default as well. Without it, every group but the
    default one waited torch's 30 minutes whatever `ATORCH_COLLECTIVE_TIMEOUT` said: a failed rank left
    its tensor/data/pipeline peers waiting, and the diagnosis of `timeouts` never came.
    The dry runner swaps this default for a candidate's shorter one and restores it afterwards.
    """
    global _TORCH_GROUP_TIMEOUTS
    c10d = dist.distributed_c10d
    if _TORCH_GROUP_TIMEOUTS is None:
        if timeout is None:
            return
        _TORCH_GROUP_TIMEOUTS = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    if timeout is None:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = _TORCH_GROUP_TIMEOUTS
        _TORCH_GROUP_TIMEOUTS = None
    else:
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout


def default_group_timeout() -> datetime.timedelta:
    """The timeout of the default process group, for the groups atorch creates next to it.

    That is `ATORCH_COLLECTIVE_TIMEOUT` (or `init_distributed`'s `timeout`) after `init_distributed`,
    the user's own after `dist.init_process_group(timeout=...)`, and a dry-run candidate's short one
    while the dry runner has swapped in its world group. Falls back to `ATORCH_COLLECTIVE_TIMEOUT`
    when the group does not say (no group yet, a backend without options).
    """
    if is_initialized():
        try:
            pg = dist.distributed_c10d._get_default_group()
            backend = pg._get_backend(device())
            value = backend.options._timeout    # type: ignore[attr-defined]
            if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
                return value
        except (RuntimeError, AttributeError, ValueError):
            pass
    return timeouts.collective_timeout()


@contextlib.contextmanager
def groups_take_default_timeout() -> Iterator[None]:
    """Inside the block, groups created without a timeout (a `DeviceMesh`'s) take the default group's.

    `init_distributed` already made that torch's default; this also holds when the user initialized
    torch directly and when the dry runner swapped in a candidate's world group.
    """
    c10d = dist.distributed_c10d
    saved = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = default_group_timeout()
    try:
        yield
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved


def _import_dynamo_before_the_group_exists() -> None:
    """Import `torch._dynamo` now, while no process group exists.

    Imported after the default group exists (DDP's constructor imports it, and so does
    torch.compile), it keeps a reference to that group that `destroy_process_group()` and
    garbage collection cannot drop (torch 2.13, measured by thread names: gloo's `pt_gloo_runloop`
    x2, `gloo_tcp_loop` and `pt_tcpstore_uv` stay alive after destroy when torch._dynamo was
    imported after init, and are gone when it was imported before; `benchmarks/exit_ddp_threads.py`).
    Those workers then live into interpreter finalization, where one that needs the GIL aborts the
    process after training finished: the Slurm example's worker did, once in two fresh-clone CI
    runs. Every DDP or compiled job imports it anyway, so importing it first costs them nothing.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken optional compiler stack must not stop training
        logger.debug("torch._dynamo could not be imported before the process group (%s: %s)", type(e).__name__, e)


_exit_teardown_registered = False


def _register_exit_teardown() -> None:
    """Destroy the process groups at interpreter exit, before finalization (once per process).

    Root cause of the SIGABRT "terminate called without an active exception" at the exit of
    finished jobs: `dist.destroy_process_group` does not stop gloo's worker threads while any
    Python object still references the group (measured: 7 threads before and after destroy,
    1 once the last reference is dropped), and a script that never calls it keeps them to the
    end. A worker that completes the job's last collective releases that work's tensors a
    moment after the main thread has moved on; a tensor still referenced from Python when its
    work finished holds its Python object, so the release takes the GIL. When the main thread
    has meanwhile reached interpreter finalization, CPython ends the worker thread inside that
    GIL acquisition (pthread_exit), the unwinding crosses a noexcept C++ frame, and
    std::terminate aborts the process: after training and saving completed, the worker exits
    with -6 and the launcher reports a failed job (3 in 30 runs of a 20-collective gloo script
    under load without destroy_process_group; see benchmarks/RESULTS.md "Clean exit").

    The fix is the teardown order: atexit handlers run while the interpreter is still whole,
    so destroying atorch's groups there (parallel groups, the vote group, the default group)
    and dropping atorch's own references to them and to the rendezvous store joins the gloo
    workers while they can still take the GIL. A process that is failing (an uncaught
    exception seen by atorch's excepthook) cannot destroy its groups (one with a pending
    collective would wait for that collective's timeout): it leaves without finalization
    (`_leave_failing_process`).
    """
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_teardown_at_exit)
        _exit_teardown_registered = True


def _teardown_at_exit() -> None:
    if timeouts.failed_with_uncaught_exception():
        _leave_failing_process()
        return
    if is_initialized():
        destroy_distributed()
    # Groups held only by reference cycles (a model wrapped by DDP/FSDP) go now, not in finalization:
    # also after the script's own reset_distributed(), which may have run while they were alive.
    gc.collect()


def _leave_failing_process() -> None:
    """End a process that an uncaught exception is ending, with Python's status 1, before finalization.

    Its groups stay alive (see `_register_exit_teardown`), so gloo's worker threads meet the
    interpreter's finalization as on the success path before its fix, and the process could
    abort with SIGABRT after the traceback was printed (1 in 8 runs of a 2-rank tensor-parallel
    job raising a ValueError; 2 in 6 in an outside probe): the launcher then reported a native
    crash (exit 134, "failed with signal 6") where the script had raised. Finalization is what
    races, so it is skipped: the work it would still do for such a process is done here first
    (daemonic child processes such as DataLoader workers terminated, logging and the standard
    streams flushed; non-daemon threads were joined before atexit handlers run).
    """
    if not dist.is_initialized():
        return      # no gloo threads: the normal exit is safe
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.terminate()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed or broken stream: nothing left to save
            pass
    os._exit(1)


def _env_int(name: str, minimum: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer >= {minimum}")
    return value


def _rendezvous_env() -> Tuple[int, int, str, int]:
    """(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), checked before any connection is attempted."""
    world = _env_int("WORLD_SIZE", 1)
    rank_ = _env_int("RANK", 0)
    if rank_ >= world:
        raise ValueError(f"environment variable RANK={rank_} must be < WORLD_SIZE={world}")
    port = _env_int("MASTER_PORT", 1)
    if port > 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} must be a TCP port, 1..65535")
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        raise ValueError("environment variable MASTER_ADDR is empty; set it to rank 0's host name or address")
    return rank_, world, addr, port


_init_count = 0


def _rendezvous_store(rank_: int, world: int, addr: str, port: int, join: datetime.timedelta) -> dist.Store:
    """The rendezvous store, once every rank has checked in (else `DistributedInitError` after `join`).

    The check-in is a counter under a key of this job's own: a rank that reached another job's
    store (MASTER_PORT was taken) never sees the count complete and fails after `join`,
    naming the address, instead of waiting for the collective timeout.
    """
    global _init_count
    _init_count += 1
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    is_agent_store = attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        base = _connect_store(addr, port, world, not is_agent_store and rank_ == 0, join)
    except (RuntimeError, dist.DistError) as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise timeouts.DistributedInitError(
                f"rank {rank_}: cannot start the rendezvous store at {where}: the port is already in use (another "
                "job?); choose a free MASTER_PORT (or launch with atorch.distributed.run, which picks one)") from e
        raise timeouts.DistributedInitError(
            f"rank {rank_}: cannot reach the rendezvous store at {where} within {join.total_seconds():g} s "
            f"({timeouts.INIT_TIMEOUT_ENV}): {e}") from e
    store: dist.Store = base
    if attempt is not None:
        # Measured with torch 2.13 and gloo: after a restart, env:// initialization sometimes
        # reads the previous attempt's listening address from the agent's store and fails with
        # "Connection refused" in connectFullMesh. Prefixing the keys by attempt avoids that.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        store = dist.PrefixStore(f"/atorch/{run_id}/attempt_{attempt}", base)
    # One prefix per initialization in this process (a test may destroy and initialize again).
    store = dist.PrefixStore(f"init_{_init_count}", store)
    _check_in(store, rank_, world, where, join)
    # Where each rank runs, for the messages that name the ranks (and nodes) a collective lost.
    store.set(f"{timeouts.NODE_KEY}/{rank_}", timeouts.this_node())
    return store


# Longest single connection attempt of a rank that is not the store's host (see `_connect_store`).
_CONNECT_ATTEMPT_S = 5.0


def _connect_store(addr: str, port: int, world: int, is_master: bool, join: datetime.timedelta) -> dist.TCPStore:
    """The TCPStore at addr:port, hosting it on rank 0, within `join` (then its timeout for every operation).

    A client rank does not hand `join` to torch's connect: torch retries a timed-out connect once
    more with the same timeout after a random back-off, so a rank 0 that never came up failed the
    others after more than twice `join` (23.5 s for ATORCH_INIT_TIMEOUT=10, 136 s for the default
    60) while the message said "within 10 s". Short attempts under one deadline keep it to `join`
    plus a fraction of one attempt.
    """
    if is_master:
        return dist.TCPStore(addr, port, world, is_master=True, timeout=join, wait_for_workers=False)
    deadline = time.monotonic() + join.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        attempt = datetime.timedelta(seconds=max(0.5, min(_CONNECT_ATTEMPT_S, remaining / 3)))
        try:
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=attempt, wait_for_workers=False)
        except (RuntimeError, dist.DistError):
            if time.monotonic() + attempt.total_seconds() >= deadline:
                raise
            continue
        store.set_timeout(join)
        return store


def _check_in(store: dist.Store, rank_: int, world: int, where: str, join: datetime.timedelta) -> None:
    deadline = time.monotonic() + join.total_seconds()
    try:
        arrived = store.add("atorch_check_in", 1)
        while arrived < world:
            if time.monotonic() >= deadline:
                raise timeouts.DistributedInitError(
                    f"rank {rank_}: only {arrived} of WORLD_SIZE={world} ranks joined the rendezvous at {where} "
                    f"within {join.total_seconds():g} s ({timeouts.INIT_TIMEOUT_ENV}); is MASTER_PORT used by "
                    "another job, or did a rank fail to start?")
            time.sleep(0.05)
            arrived = store.add("atorch_check_in", 0)
    except timeouts.DistributedInitError:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise timeouts.DistributedInitError(
            f"rank {rank_}: lost the rendezvous store at {where} while waiting for the other ranks: {e}") from e


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank: the process group's, else RANK (0 when unset or empty)."""
    return dist.get_rank() if is_initialized() else _env_int_or("RANK", 0)


def world_size() -> int:
    """The process group's size, else WORLD_SIZE (1 when unset or empty)."""
    return dist.get_world_size() if is_initialized() else _env_int_or("WORLD_SIZE", 1)


def local_rank() -> int:
    """LOCAL_RANK (0 when unset or empty)."""
    return _env_int_or("LOCAL_RANK", 0)


def _env_int_or(name: str, default: int) -> int:
    # An empty value counts as unset, as in `_fill_single_process_env`.
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def cuda_index() -> int:
    """This process's CUDA device: LOCAL_RANK, or 0 when the process sees a single GPU.

    A launcher or `srun --gpus-per-node=N` shows every process all of the node's GPUs, and
    LOCAL_RANK picks one; `srun --gpus-per-task=1` shows each task only its own GPU (one entry in
    CUDA_VISIBLE_DEVICES), which is device 0 whatever the task's LOCAL_RANK. Anything else (more
    than one but fewer than LOCAL_RANK + 1 visible) is ambiguous: ValueError, before any network use.
    """
    local, count = local_rank(), torch.cuda.device_count()
    if local < count:
        return local
    if count == 1:
        return 0
    raise ValueError(f"LOCAL_RANK={local} but this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): show each process all of its node's GPUs or "
                     "exactly one (Slurm: --gpus-per-node=N with N tasks per node, or --gpus-per-task=1)")


def device() -> torch.device:
    """cuda:`cuda_index()` when the process group runs on nccl (or CUDA without a group), else cpu."""
    if is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", cuda_index())
        return torch.device("cpu")
    return torch.device("cuda", cuda_index()) if torch.cuda.is_available() else torch.device("cpu")


def device_type() -> str:
    return device().type


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where the tensors of `group`'s collectives must live (None: the default group): the current CUDA
    device when the group runs on nccl, which takes no CPU tensors, else the CPU (gloo takes both; CPU
    tensors there need no device at all). The one rule for every small collective atorch runs itself:
    flags, votes, checksums, timings."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Called by `destroy_distributed` before the default group goes (the parallel-group module
# registers forgetting its default layout): layers above register here instead of this module
# importing them.
_ON_DESTROY: List[Callable[[], None]] = []


def on_destroy(callback: Callable[[], None]) -> None:
    """Run `callback` at every `destroy_distributed()`, before the default process group is destroyed."""
    if callback not in _ON_DESTROY:
        _ON_DESTROY.append(callback)


def destroy_distributed() -> None:
    """Tear down the parallel groups and the default group, if any.

    A collection first: a DDP/FSDP model held only by a reference cycle (a training result the
    script deleted) still references its group, and `destroy_process_group` cannot stop gloo's
    workers while it does; they then lived into interpreter finalization, where one aborted a
    finished Slurm job (`_register_exit_teardown`)."""
    gc.collect()
    for callback in _ON_DESTROY:     # the default parallel groups, the agreement group
        callback()
    if is_initialized():
        dist.destroy_process_group()
    forget_library_groups(None)      # every group is gone: so are DeepSpeed's cached ones
    _set_torch_group_timeout(None)
    timeouts.install(None)
    _unfill_single_process_env()


def retire_groups(groups: Sequence[Any], destroy: bool) -> None:
    """`groups` will never be used again (a dry-run candidate's): libraries forget them, then,
    if `destroy`, they are destroyed.

    Why: DeepSpeed caches process groups in module globals (`deepspeed.utils.groups`: the
    clone of the world its ZeRO engines reduce over, ZeRO++'s intra-node group, the mesh...)
    and reuses a cached group on every later engine. Only `deepspeed.comm.destroy_process_group`
    tells it a group is gone; a group destroyed with `torch.distributed` directly stays cached,
    and the next engine's first collective on it raises "Group ... is not registered". A group
    that is retired without being destroyed (a failed candidate's, possibly mid-collective)
    must not be reused either.
    """
    retired = list(groups)
    if not retired:
        return
    forget_library_groups(retired)
    if destroy:
        for group in retired:
            dist.destroy_process_group(group)


def _forget_dtensor_specs() -> None:
    """Empty DTensor's sharding-propagation caches (the C++ dispatch cache and the Python ones).

    They are keyed by DTensorSpecs, and a spec's DeviceMesh compares equal to a mesh of the same ranks
    over another process group (torch 2.13: `DeviceMesh.__eq__` ignores the groups). After a dry run's
    groups were retired, FSDP2 over the live groups built parameters whose DTensors came back from the
    cache naming the destroyed group: `train_step(max_grad_norm=...)`, `clip_grad_norm_`, `full_tensor()`
    and a full state dict raised "Could not resolve the process group registered under the name 1"
    (`tests/distributed/test_after_dry_runs.py`). Clearing costs the next ops one propagation each."""
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is None:
        return
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = api.DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache_clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def forget_library_groups(groups: Optional[Sequence[Any]]) -> None:
    """Drop DeepSpeed's cached references to `groups` (None: to every group), and DTensor's sharding
    caches (`_forget_dtensor_specs`). Imports nothing: a process that never imported DeepSpeed or
    DTensor has nothing cached."""
    _forget_dtensor_specs()
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is None:
        return
    release = getattr(ds_groups, "_release_process_group_references", None)   # DeepSpeed >= 0.18
    if release is not None:
        for group in ([None] if groups is None else groups):
            release(group)
    retired = None if groups is None else {id(group) for group in groups}

    def gone(value: Any) -> bool:
        return isinstance(value, dist.ProcessGroup) and (retired is None or id(value) in retired)

    # Older DeepSpeed (and whatever the release above does not cover): a module-level group, a
    # dict of groups, or a DeviceMesh over a retired group.
    for name, value in list(vars(ds_groups).items()):
        if gone(value) or _mesh_uses(value, retired):
            setattr(ds_groups, name, None)
        elif isinstance(value, dict):
            for key in [k for k, v in value.items() if gone(v)]:
                del value[key]


def forget_library_model_parallel() -> None:
    """Make DeepSpeed forget the model-parallel layout of the last engine built with one. Imports nothing.

    Why: an engine given an `mpu` (DeepSpeed's pipeline engine passes its grid) or a device mesh
    stores it in `deepspeed.utils.groups` (`mpu`, `mesh_device`) for the rest of the process, and
    every later engine built without one takes its data-parallel group and model-parallel size
    from there: a ZeRO engine after a DeepSpeed 3D one failed in its constructor
    (`'NoneType' object has no attribute 'get_model_parallel_rank'`), or would reduce over the
    old grid's data group. Call it before building an engine that has no model parallelism."""
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is None:
        return
    for name in ("mpu", "mesh_device"):
        if getattr(ds_groups, name, None) is not None:
            setattr(ds_groups, name, None)


def _mesh_uses(value: Any, retired: Optional[set]) -> bool:
    """Whether `value` is a DeviceMesh with a process group in `retired` (None: any group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(value, DeviceMesh):
        return False
    if retired is None:
        return True
    try:
        return any(id(group) in retired for group in value.get_all_groups())
    except (RuntimeError, ValueError, KeyError):   # a mesh whose groups are already gone
        return True


# -- ATorch compatibility: the keywords of its init_distributed ----------------------------------

_LOGGED_ONCE: set = set()


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(key)
        logger.info(message, *args)


def _apply_atorch_init_options(set_cuda_device_using_local_rank: bool, coworker_num_per_node: int,
                               elastic_or_fault_tolerant: bool) -> None:
    """What ATorch's `init_distributed` keywords mean here; validated before any network use."""
    if not isinstance(coworker_num_per_node, int) or isinstance(coworker_num_per_node, bool) or \
            coworker_num_per_node < 0:
        raise ValueError(f"coworker_num_per_node={coworker_num_per_node!r} must be an integer >= 0")
    if coworker_num_per_node > 0:
        raise ValueError(f"coworker_num_per_node={coworker_num_per_node} is not supported: atorch has no CPU "
                         "coworker processes (ATorch's data-preprocessing service); every process trains. Use 0 and "
                         "preprocess data with atorch.data.DatasetPreprocessor")
    if elastic_or_fault_tolerant:
        _log_once("elastic", "init_distributed(elastic_or_fault_tolerant=True): ignored; restarts are handled by the "
                  "launcher (python -m atorch.distributed.run --fault_tolerant), and every attempt initializes the "
                  "same way")
    if set_cuda_device_using_local_rank:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            _log_once("cuda_device", "init_distributed(set_cuda_device_using_local_rank=True): no GPU found; ignored")
        else:
            torch.cuda.set_device(cuda_index())


def reset_distributed() -> None:
    """ATorch's name for `destroy_distributed`: drop the parallel groups and the default group."""
    destroy_distributed()
