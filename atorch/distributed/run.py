"""Launcher: `python -m atorch.distributed.run [--fault_tolerant] [--max_restarts N] ... script.py ARGS`.

A thin front end over torch elastic (`torch.distributed.run`), not a process manager of its own:
- `--fault_tolerant` lets the elastic agent restart the whole worker group after a failure
  (`--max_restarts`, default 3). Restarts use the c10d rendezvous: measured with torch 2.13,
  the static rendezvous that `--master_addr/--master_port` select fails to re-form a gloo
  group after a restart ("Connection refused" in connectFullMesh), while c10d re-forms it.
- Without it, a crash fails the job at once (`--max_restarts` defaults to 0).
- `--nnodes MIN:MAX` uses the c10d rendezvous as well: the static one waits for MAX nodes.
- A single-node job without `--master_port` runs `--standalone`, so concurrent jobs on one
  machine never fight over the default port 29500.
- Started by srun with one task per node (`srun --ntasks-per-node=1 atorch run ...`) and no
  placement flags, it takes `--nnodes`, `--node_rank` and the rendezvous (the step's first
  node, a port derived from the job id) from the step (atorch/distributed/slurm.py).
- Usage mistakes (`--nproc_per_node 0` or `gpu` without CUDA, `--nnodes 0`, a `--node_rank` outside `--nnodes`, a port
  outside 1..65535, a missing script, a malformed ATORCH_*_TIMEOUT) exit with status 2 and one
  line naming the flag, before any process or socket is started.
- The node that hosts the rendezvous store checks its port first: a port in use fails at once
  with one line (exit 1) instead of joining whatever listens there (see `prepare_rendezvous`). A
  node that does not host it checks that a torch store answers at the endpoint (`store_probe`):
  torch's client hangs for good where something else listens.
- Nodes wait `ATORCH_INIT_TIMEOUT` seconds (torch's 600 when unset) for each other; a multi-node
  launcher says so in one line, and a rendezvous that does not fill in time fails naming both.
- A failed worker's exit code (128 + N for signal N; the first failure's) is the launcher's.
"""

from __future__ import annotations

import argparse
import errno
import functools
import math
import os
import shutil
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Dict, List, Mapping, NoReturn, Optional, Tuple

from atorch.distributed import slurm
from atorch.distributed.launcher_watch import naming_this_launcher

DEFAULT_FAULT_TOLERANT_RESTARTS = 3
DEFAULT_MASTER_PORT = 29500
# How long nodes wait for each other when ATORCH_INIT_TIMEOUT is unset: torch's own default. Longer than
# init_distributed's 60 s on purpose: the nodes of a cluster job may start minutes apart (image pulls, queues).
DEFAULT_LAUNCHER_JOIN_TIMEOUT_S = 600.0
# torch's c10d rendezvous' default `last_call_timeout` (seconds): how long it waits for more than MIN nodes.
_C10D_LAST_CALL_S = 30
PROG = "atorch.distributed.run"


def run_help(prog: str = PROG) -> str:
    """The launcher's usage text (`atorch run --help`, `python -m atorch.distributed.run --help`)."""
    return f"""usage: {prog} [atorch options] [torchrun options] SCRIPT.py [script args]

Launch SCRIPT on this node's processes (torch elastic underneath).

atorch options:
  --nproc_per_node N      processes on this node (e.g. one per GPU)
  --nnodes N              nodes in the job (default 1); MIN:MAX starts with MIN to MAX nodes (c10d rendezvous)
  --node_rank R           this node's rank (multi-node)
  --master_addr HOST      rendezvous host (multi-node; default 127.0.0.1)
  --master_port PORT      rendezvous port (default: a free port on one node, 29500 on several)
  --fault_tolerant        restart the whole worker group after a failure (c10d rendezvous)
  --max_restarts N        restarts allowed (default 3 with --fault_tolerant, else 0)

Every other option before SCRIPT is torchrun's (python -m torch.distributed.run --help).
"""
_NO_PYTHON_FLAGS = ("--no_python", "--no-python")
_MODULE_FLAGS = ("-m", "--module")
# atorch's own launcher flags that take no value (the others, and torch's, are looked up in torch's parser).
_ATORCH_SWITCHES = ("--fault_tolerant", "--fault-tolerant")
_ATORCH_VALUE_FLAGS = ("--max_restarts", "--max-restarts", "--master_addr", "--master-addr", "--master_port",
                       "--master-port", "--nnodes", "--rdzv_backend", "--rdzv-backend")


class LaunchError(RuntimeError):
    """A launch that cannot go on for a reason outside the command line (exit status 1, one line)."""


@functools.lru_cache(maxsize=1)
def _torch_flag_arity() -> Dict[str, bool]:
    """torchrun's option strings -> whether the option takes a value."""
    from torch.distributed.run import get_args_parser

    arity: Dict[str, bool] = {}
    for action in get_args_parser()._actions:
        for option in action.option_strings:
            arity[option] = action.nargs != 0
    return arity


def _takes_value(flag: str) -> bool:
    if flag in _ATORCH_SWITCHES:
        return False
    if flag in _ATORCH_VALUE_FLAGS:
        return True
    arity = _torch_flag_arity()
    if flag in arity:
        return arity[flag]
    prefixed = {arity[option] for option in arity if option.startswith(flag)}   # argparse's abbreviations
    return prefixed == {True}


def _split_at_script(argv: List[str]) -> int:
    """Index of the training script: the first argument ending in .py, `-m` (the module follows), or after
    `--no_python` the first argument that is not a launcher flag or its value (any executable, as torchrun)."""
    no_python = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _MODULE_FLAGS:
            return i
        if arg.startswith("-") and len(arg) > 1:
            no_python = no_python or arg in _NO_PYTHON_FLAGS
            if "=" not in arg and _takes_value(arg):
                i += 1                                  # the flag's value is not the script
        elif no_python or arg.endswith(".py"):
            return i
        i += 1
    return len(argv)


def _no_python(launcher_args: List[str]) -> bool:
    return any(arg in _NO_PYTHON_FLAGS for arg in launcher_args)


def translate_args(argv: List[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Turn atorch launcher arguments into `torch.distributed.run` arguments.

    Started by srun (one launcher task per node, `env`: default os.environ) without placement
    flags of its own, the node count, node rank and rendezvous come from the Slurm step.
    """
    at = _split_at_script(argv)
    if not any(arg.split("=")[0] in slurm.LAUNCHER_PLACEMENT_FLAGS for arg in argv[:at]):
        placement = slurm.launcher_placement(os.environ if env is None else env)
        if placement:
            print(f"atorch.distributed.run: Slurm step on {placement[0].split('=')[1]} nodes: {' '.join(placement)}",
                  file=sys.stderr, flush=True)
        argv = placement + argv
    parser = _FlagParser(add_help=False)
    parser.add_argument("--fault_tolerant", "--fault-tolerant", action="store_true")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=None)
    parser.add_argument("--master_addr", "--master-addr", default=None)
    parser.add_argument("--master_port", "--master-port", type=int, default=None)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--rdzv_backend", "--rdzv-backend", default=None)
    parser.add_argument("--standalone", action="store_true")
    at = _split_at_script(argv)
    ours, rest = parser.parse_known_args(argv[:at])
    _check_usage(ours, argv[:at])
    if ours.fault_tolerant:
        restarts = DEFAULT_FAULT_TOLERANT_RESTARTS if ours.max_restarts is None else ours.max_restarts
    else:
        restarts = 0 if ours.max_restarts is None else ours.max_restarts
    out = [f"--max_restarts={restarts}", f"--nnodes={ours.nnodes}"]
    single_node = ours.nnodes in ("1", "1:1")
    min_nodes, max_nodes = _nnodes_range(ours.nnodes)
    if ours.rdzv_backend is not None or ours.standalone:
        out += [f"--rdzv_backend={ours.rdzv_backend}"] if ours.rdzv_backend else ["--standalone"]
        out += _master_args(ours)
    elif (ours.fault_tolerant or min_nodes < max_nodes) and (ours.master_port is not None or not single_node):
        # A node range needs c10d too: the static rendezvous of --master_addr/--master_port waits for MAX nodes.
        port = ours.master_port or DEFAULT_MASTER_PORT
        addr = ours.master_addr or "127.0.0.1"
        out += ["--rdzv_backend=c10d", f"--rdzv_endpoint={addr}:{port}", f"--rdzv_id=atorch-{port}"]
    elif ours.master_port is None and single_node:
        out += ["--standalone"]
    else:
        out += _master_args(ours)
    return out + rest + argv[at:]


_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


class _FlagParser(argparse.ArgumentParser):
    """A parser of some of the launcher's flags whose mistakes (an ambiguous abbreviation such as `--nproc`)
    raise ValueError, reported as one usage line under the launcher's name, not argparse's exit under `run.py`."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _nnodes_range(text: str) -> Tuple[int, int]:
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low, high = 0, 0
    if low < 1 or high < low:
        raise ValueError(f"--nnodes={text!r} must be a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def _check_usage(ours: argparse.Namespace, launcher_args: List[str]) -> None:
    """Usage errors naming the flag, before any process or socket is started."""
    checker = _FlagParser(add_help=False)
    checker.add_argument("--nproc_per_node", "--nproc-per-node", default=None)
    checker.add_argument("--node_rank", "--node-rank", default=None)
    more, _ = checker.parse_known_args(launcher_args)
    ours = argparse.Namespace(**vars(ours), **vars(more))
    if ours.max_restarts is not None and ours.max_restarts < 0:
        raise ValueError(f"--max_restarts={ours.max_restarts} must be >= 0")
    if ours.nproc_per_node is not None and ours.nproc_per_node not in _NPROC_WORDS:
        try:
            nproc = int(ours.nproc_per_node)
        except ValueError:
            nproc = 0
        if nproc < 1:
            raise ValueError(f"--nproc_per_node={ours.nproc_per_node!r} must be a number of processes >= 1 "
                             f"(or one of {list(_NPROC_WORDS)})")
    _check_devices(ours.nproc_per_node)
    min_nodes, max_nodes = _nnodes_range(ours.nnodes)
    if min_nodes < max_nodes and ours.rdzv_backend == "static":
        raise ValueError(f"--nnodes={ours.nnodes} (a range) needs an elastic rendezvous, but --rdzv_backend=static "
                         f"waits for all {max_nodes} nodes; drop --rdzv_backend (atorch then uses c10d) or give "
                         f"--nnodes {max_nodes}")
    if ours.node_rank is not None:
        try:
            node_rank = int(ours.node_rank)
        except ValueError:
            node_rank = -1
        if not 0 <= node_rank < max_nodes:
            raise ValueError(f"--node_rank={ours.node_rank!r} must be an integer in [0, {max_nodes}) for "
                             f"--nnodes={ours.nnodes}")
    if ours.master_port is not None and not 1 <= ours.master_port <= 65535:
        raise ValueError(f"--master_port={ours.master_port} must be a TCP port, 1..65535")
    known = registered_rendezvous_backends()
    if ours.rdzv_backend is not None and known is not None and ours.rdzv_backend not in known:
        # torch elastic would find out only once the agent starts, as a traceback with exit status 1.
        raise ValueError(f"--rdzv_backend={ours.rdzv_backend!r} is not a registered rendezvous backend; use one of "
                         f"{sorted(known)}")


def _check_devices(nproc_per_node: Optional[str]) -> None:
    """`--nproc_per_node gpu`/`xpu` (one worker per device) where there is no such device: torch elastic would
    raise "Cuda is not available." as a traceback once the agent starts."""
    import torch

    available = {"gpu": ("CUDA", torch.cuda.is_available),
                 "xpu": ("XPU", getattr(getattr(torch, "xpu", None), "is_available", lambda: False))}
    if nproc_per_node in available:
        name, is_available = available[nproc_per_node]
        if not is_available():
            raise ValueError(f"--nproc_per_node={nproc_per_node} starts one worker per {name} device, but this "
                             f"machine has none that torch can use; give a number of workers, or 'cpu' or 'auto'")


def registered_rendezvous_backends() -> Optional[List[str]]:
    """The rendezvous backends torch elastic can create in this process (its own and installed plugins), or None
    where this torch keeps no readable registry (then torch elastic itself reports an unknown one)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    registry = getattr(rendezvous_handler_registry, "_registry", None)
    return sorted(registry) if isinstance(registry, dict) else None


def check_environment(argv: List[str]) -> None:
    """What only the launching machine can check: the script exists, atorch's timeouts parse."""
    at = _split_at_script(argv)
    if at >= len(argv):
        raise ValueError(f"no training script in {argv}: give the script (a file ending in .py, or -m module; "
                         "any executable after --no_python) after the launcher flags")
    script = argv[at]
    if _no_python(argv[:at]):
        if script in _MODULE_FLAGS:
            raise ValueError("--no_python runs an executable, -m runs a Python module: give one of them")
        if shutil.which(script) is None:
            raise ValueError(f"executable {script!r} (after --no_python) is not an executable file nor a command "
                             "on PATH")
    elif script not in _MODULE_FLAGS and not os.path.isfile(script):
        raise ValueError(f"training script {script!r} does not exist")
    from atorch.distributed import timeouts

    for name in (timeouts.INIT_TIMEOUT_ENV, timeouts.COLLECTIVE_TIMEOUT_ENV):
        timeouts.seconds_from_env(name, 1.0)
    _warn_about_slurm_cpus(argv[:at])


def _warn_about_slurm_cpus(launcher_args: List[str]) -> None:
    """Started by srun with fewer CPUs than workers: say so (the workers would share cores)."""
    checker = argparse.ArgumentParser(add_help=False)
    checker.add_argument("--nproc_per_node", "--nproc-per-node", default="1")
    nproc = checker.parse_known_args(launcher_args)[0].nproc_per_node
    if not hasattr(os, "sched_getaffinity") or not str(nproc).isdigit():
        return
    note = slurm.launcher_cpu_note(os.environ, int(nproc), len(os.sched_getaffinity(0)))
    if note is not None:
        print(f"atorch.distributed.run: warning: {note}", file=sys.stderr, flush=True)


def _master_args(ours: argparse.Namespace) -> List[str]:
    out = []
    if ours.master_addr is not None:
        out.append(f"--master_addr={ours.master_addr}")
    if ours.master_port is not None:
        out.append(f"--master_port={ours.master_port}")
    return out


@dataclass
class Rendezvous:
    """Where and how long this node waits for the others (what `prepare_rendezvous` decided)."""

    host: str               # where the nodes meet ("" and port 0: a single node's own free port)
    port: int
    min_nodes: int
    max_nodes: int
    timeout_s: int          # how long a node waits for the others
    timeout_source: str     # where timeout_s came from, for messages
    hosts_store: Optional[bool]   # this node hosts the store (None: torch decides, trying to host first)
    last_call_s: Optional[int] = None   # a node range: c10d starts once MIN joined and none joined for this long

    @property
    def endpoint(self) -> str:
        """host:port ("" for a single node's own free port)."""
        return f"{self.host}:{self.port}" if self.port > 0 else ""


def _config(text: Optional[str]) -> Dict[str, str]:
    """--rdzv_conf's `key=value,...` (torch's format)."""
    out: Dict[str, str] = {}
    for item in (text or "").split(","):
        if item.strip():
            key, _, value = item.partition("=")
            out[key.strip()] = value.strip()
    return out


def _given(flags: Tuple[str, ...], launcher_args: List[str]) -> bool:
    return any(arg.split("=")[0] in flags for arg in launcher_args)


def _is_this_machine(host: str) -> bool:
    """Whether `host` names this machine (torch's test, the one its c10d rendezvous uses to pick the store's host)."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:   # pragma: no cover - older or newer torch
        return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())
    return bool(_matches_machine_hostname(host))


def port_in_use(port: int) -> bool:
    """Whether `port` is taken on this machine: a listening socket cannot be bound to it as the store's server
    binds it (every address, SO_REUSEADDR, so that an earlier job's connections in TIME_WAIT do not count)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):   # IPv6 "::" covers IPv4 (dual stack)
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
                sock.listen(1)
                return False
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            # this family is not available here (no IPv6): try the next one
    return False


def _port_message(rdzv: Rendezvous) -> str:
    return (f"port {rdzv.port} of the rendezvous at {rdzv.endpoint} is already in use on this host, which hosts "
            "the rendezvous store (another job or process listens there); choose a free --master_port, or leave "
            "--master_port out on a single node (the launcher then picks a free one)")


def prepare_rendezvous(args: argparse.Namespace, launcher_args: List[str],
                       env: Optional[Mapping[str, str]] = None) -> Rendezvous:
    """Adjust torchrun's parsed `args` (from `translate_args`) to this machine and job, in place.

    `launcher_args`: the user's launcher flags (before the script). Raises LaunchError when this node
    hosts the store and its port is taken, ValueError for a malformed ATORCH_INIT_TIMEOUT.

    - Timeout: nodes wait ATORCH_INIT_TIMEOUT for each other (c10d's `join_timeout`, the static
      rendezvous' `timeout`) unless --rdzv_conf sets them.
    - The store's host: a node that will host the store binds its port itself (static: node rank 0;
      c10d: the endpoint names this machine and this is the only node, or --node_rank 0). Torch's c10d
      rendezvous would otherwise fall back to connecting to whatever listens on a taken port: a plain
      socket hangs it for good, another job's store makes it join that job's rendezvous. It is told so
      (`is_host`), so that a port taken between our check and torch's bind fails too. A node that knows it
      does not host (--node_rank > 0) is told too. Several nodes on one machine without --node_rank keep
      torch's guess (try to host, else connect): only one of them can host, and we cannot tell which.
    - The c10d rendezvous id (`atorch-<port>` from translate_args) names the job where that is possible,
      so that a node never joins another job's rendezvous on the same port: one node needs nobody to agree,
      so it gets a random id; the nodes of a Slurm step share the job and step ids. Other multi-node jobs
      keep `atorch-<port>`: an id must be the same on every node without the nodes talking, and a random or
      per-node value would split a job whose nodes all run the same command. Their protection is the
      host's port check (the store's host never serves a second job) and the join timeout. `--rdzv_id` (or
      torchrun's PET_RDZV_ID) given by the user is kept.
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    from atorch.distributed import timeouts

    environ = os.environ if env is None else env
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    seconds = timeouts.seconds_from_env(timeouts.INIT_TIMEOUT_ENV, DEFAULT_LAUNCHER_JOIN_TIMEOUT_S)
    source = timeouts.INIT_TIMEOUT_ENV if os.environ.get(timeouts.INIT_TIMEOUT_ENV, "").strip() else \
        f"{timeouts.INIT_TIMEOUT_ENV} unset: torch's default"
    user_conf = _config(args.rdzv_conf)
    conf = dict(user_conf)
    timeout_s = max(1, math.ceil(seconds))
    for key in ("join_timeout", "timeout"):   # c10d's and the static rendezvous' names
        conf.setdefault(key, str(timeout_s))
    key = "timeout" if args.rdzv_backend == "static" and not args.standalone else "join_timeout"
    if key in user_conf:
        timeout_s, source = max(1, math.ceil(float(user_conf[key]))), f"--rdzv_conf {key}"
    last_call_s: Optional[int] = None
    if args.rdzv_backend == "c10d" and min_nodes < max_nodes:
        # c10d starts with fewer than MAX nodes only once no node joined for `last_call_timeout` (torch's 30 s)
        # after MIN had; that must end before the join timeout does, or a short ATORCH_INIT_TIMEOUT fails a
        # rendezvous that had its MIN nodes ("did not gather at least 1 nodes within 15 s").
        last_call_s = max(1, min(_C10D_LAST_CALL_S, timeout_s // 2))
        if "last_call_timeout" in user_conf:
            last_call_s = max(1, math.ceil(float(user_conf["last_call_timeout"])))
        conf["last_call_timeout"] = str(last_call_s)
    node_rank_given = _given(("--node_rank", "--node-rank"), launcher_args) or bool(environ.get("PET_NODE_RANK"))
    hosts: Optional[bool] = None
    host, port = "", 0
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and max_nodes == 1):
        pass   # torch's standalone rendezvous: a free port of its own, nothing to check
    elif args.rdzv_backend == "static":
        if args.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=-1)
        else:
            host, port = args.master_addr, args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
        hosts = int(args.node_rank) == 0   # the static rendezvous' store lives on node rank 0
    elif args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        if "is_host" in conf:
            hosts = conf["is_host"].lower() in ("1", "true", "yes", "on")
        elif not _is_this_machine(host):
            hosts = False
        elif max_nodes == 1 or node_rank_given:
            hosts = max_nodes == 1 or int(args.node_rank) == 0
            conf["is_host"] = "true" if hosts else "false"
        user_id = _given(("--rdzv_id", "--rdzv-id"), launcher_args) or bool(environ.get("PET_RDZV_ID"))
        if not user_id and args.rdzv_id == f"atorch-{port}":
            args.rdzv_id = _job_rendezvous_id(port, max_nodes, environ)
    rdzv = Rendezvous(host, port, min_nodes, max_nodes, timeout_s, source, hosts, last_call_s)
    if hosts and port > 0 and port_in_use(port):
        raise LaunchError(_port_message(rdzv))
    args.rdzv_conf = ",".join(f"{key}={value}" for key, value in conf.items())
    return rdzv


def _job_rendezvous_id(port: int, max_nodes: int, env: Mapping[str, str]) -> str:
    if max_nodes == 1:
        return f"atorch-{port}-{uuid.uuid4().hex[:12]}"
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if job and step:
        return f"atorch-{port}-slurm-{job}.{step}"
    return f"atorch-{port}"


def waiting_line(rdzv: Rendezvous, prog: str = PROG) -> Optional[str]:
    """What a multi-node launcher waits for (None for one node, which waits for nobody)."""
    if rdzv.max_nodes <= 1:
        return None
    nodes = f"{rdzv.max_nodes}" if rdzv.min_nodes == rdzv.max_nodes else f"{rdzv.min_nodes} to {rdzv.max_nodes}"
    where = rdzv.endpoint or "the rendezvous"
    start = "" if rdzv.last_call_s is None else \
        f"; starts once {rdzv.min_nodes} have joined and no other joined for {rdzv.last_call_s} s"
    return f"{prog}: waiting up to {rdzv.timeout_s} s ({rdzv.timeout_source}) for {nodes} nodes at {where}{start}"


def _timeout_message(rdzv: Rendezvous) -> str:
    nodes = f"{rdzv.max_nodes}" if rdzv.min_nodes == rdzv.max_nodes else f"at least {rdzv.min_nodes}"
    return (f"the rendezvous at {rdzv.endpoint or 'this node'} did not gather {nodes} nodes within "
            f"{rdzv.timeout_s} s ({rdzv.timeout_source}); start every node with the same --nnodes, "
            f"--master_addr and --master_port, or set ATORCH_INIT_TIMEOUT (seconds) to wait longer")


def store_problem(rdzv: Rendezvous) -> Optional[str]:
    """On a node known not to host the store: None when a torch store answers at the endpoint within the
    join timeout, else one line saying what is there instead (`store_probe`: torch's client would hang for
    good on a port where something else listens)."""
    if rdzv.hosts_store is not False or rdzv.port <= 0:
        return None
    from atorch.distributed.store_probe import (STORE_ANSWER_S, NotAStoreError, StoreNotUpError,
                                                check_store_endpoint)

    try:
        check_store_endpoint(rdzv.host.strip("[]"), rdzv.port, wait_s=rdzv.timeout_s,
                             answer_s=min(STORE_ANSWER_S, rdzv.timeout_s))
    except StoreNotUpError as e:
        return (f"{e} ({rdzv.timeout_source}): the node hosting the rendezvous store (node rank 0) never "
                f"started or listens elsewhere; start every node with the same --master_addr and "
                f"--master_port, or set ATORCH_INIT_TIMEOUT (seconds) to wait longer")
    except NotAStoreError as e:
        return (f"{e}; another program listens on port {rdzv.port} there. Start every node with the port the "
                "store's node (node rank 0) uses, and make it one that nothing else holds")
    return None


def _chain(exc: BaseException) -> List[BaseException]:
    out: List[BaseException] = []
    current: Optional[BaseException] = exc
    while current is not None and len(out) < 10:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _rendezvous_failure(exc: BaseException, rdzv: Rendezvous) -> Optional[str]:
    """One line for a rendezvous that timed out or could not host its store; None for anything else."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    texts = " ".join(str(e) for e in _chain(exc))
    if "EADDRINUSE" in texts or "address already in use" in texts.lower():
        return _port_message(rdzv)
    if isinstance(exc, RendezvousTimeoutError):
        return _timeout_message(rdzv)
    # The static rendezvous: the store's server gave up waiting for the other nodes, or a node its server.
    if isinstance(exc, RuntimeError) and rdzv.max_nodes > 1 and any(
            marker in texts for marker in ("waiting for clients", "Timed out", "timed out")):
        return _timeout_message(rdzv)
    return None


USAGE_EXIT_CODE = 2
"""A worker's exit status for a usage error (argparse's, and atorch's examples')."""


def _exit_code(exitcode: int) -> int:
    """A failed worker's exit status as a shell reports it: 128 + N for signal N."""
    code = 128 - exitcode if exitcode < 0 else exitcode
    return code if 0 < code < 256 else 1


def run_job(args: argparse.Namespace, rdzv: Rendezvous, prog: str = PROG) -> int:
    """Run torchrun's parsed `args`; the exit status (0, the first failed worker's, or 1 for the launch)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import run as torch_run

    line = waiting_line(rdzv, prog)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    problem = store_problem(rdzv)
    if problem is not None:
        print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
        return 1
    try:
        with naming_this_launcher():   # the workers stop if this process is killed
            record(torch_run)(args)   # record: the root cause's error file, as torchrun's main
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = _exit_code(failure.exitcode)
        how = f"signal {-failure.exitcode} ({failure.signal_name()})" if failure.exitcode < 0 else \
            f"exit code {failure.exitcode}"
        restarts = args.max_restarts
        gave_up = f"; gave up after {restarts} restart{'s' if restarts > 1 else ''} (--max_restarts {restarts})" \
            if restarts > 0 else ""
        # Exit status 2 is the command-line usage convention (argparse's): the worker has printed its own
        # one-line message, which torch elastic's failure table (no traceback to show) would only bury.
        # The agent SIGTERMs the rest of the group when the first worker exits: a rank still on its way to its own
        # exit 2 then shows -15, and its usage error is no less one.
        usage = failure.exitcode == USAGE_EXIT_CODE and all(
            f.exitcode in (USAGE_EXIT_CODE, -signal.SIGTERM) for f in e.failures.values())
        if not usage:
            print(e.format_msg(), file=sys.stderr)
        what = " (a usage error: the worker's message is above)" if usage else ""
        print(f"{prog}: error: worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed "
              f"with {how}{what}{gave_up}; the launcher exits with {code}", file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        # SIGTERM/SIGINT to the launcher: torch elastic has stopped the workers; exit as a shell reports
        # a process ended by that signal (143, 130), with one line instead of the agent's traceback.
        print(f"{prog}: stopped by {e.sigval.name}; the workers were terminated; the launcher exits with "
              f"{128 + int(e.sigval)}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except Exception as e:   # noqa: BLE001 - only rendezvous failures are turned into one line
        message = _rendezvous_failure(e, rdzv)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Optional[List[str]] = None, prog: str = PROG) -> None:
    """The launcher's command line (`argv` None: sys.argv[1:]); exits with the job's status.

    `prog` names the launcher in messages (atorch.distributed.launch forwards its jobs here)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args[:_split_at_script(args)]):
        print(run_help(prog))
        raise SystemExit(0)
    try:
        translated = translate_args(args)
        check_environment(args)
        torch_args = _torch_parse_args(translated, prog)
        rdzv = prepare_rendezvous(torch_args, args[:_split_at_script(args)])
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    code = run_job(torch_args, rdzv, prog)
    if code:
        raise SystemExit(code)


def _torch_parse_args(translated: List[str], prog: str = PROG) -> argparse.Namespace:
    """torchrun's parser over `translated`, its usage errors under this launcher's name (torch's own parser
    names the file it was run as, `run.py`, and prints torchrun's usage); exits 2 on a usage error."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.usage = f"{prog} [atorch options] [torchrun options] SCRIPT.py [script args]   ({prog} --help)"
    return parser.parse_args(translated)


# -- ATorch's entry points (scripts and tests call these) ----------------------------------------

def parse_fault_tolerant_or_elastic_args(args: Optional[List[str]] = None, mode: str = "elastic"
                                         ) -> argparse.Namespace:
    """ATorch's parser: the torch elastic arguments for atorch launcher `args` (None: sys.argv[1:]).

    mode "fault_tolerant" restarts the worker group after a failure (as `--fault_tolerant`);
    "elastic" takes `--nnodes MIN:MAX` and `--max_restarts` as given. The result is for `elastic_run`.
    """
    if mode not in ("elastic", "fault_tolerant"):
        raise ValueError(f"mode={mode!r}; valid modes are 'elastic' and 'fault_tolerant'")
    argv = list(sys.argv[1:] if args is None else args)
    if mode == "fault_tolerant" and "--fault_tolerant" not in argv and "--fault-tolerant" not in argv:
        argv = ["--fault_tolerant", *argv]
    parsed = _torch_parse_args(translate_args(argv))
    parsed.atorch_rendezvous = prepare_rendezvous(parsed, argv[:_split_at_script(argv)])
    return parsed


def elastic_run(args: argparse.Namespace) -> None:
    """Run a job parsed by `parse_fault_tolerant_or_elastic_args`; raises torch's ChildFailedError on failure."""
    from torch.distributed.run import run as torch_run

    rdzv = getattr(args, "atorch_rendezvous", None)
    line = waiting_line(rdzv) if isinstance(rdzv, Rendezvous) else None
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    problem = store_problem(rdzv) if isinstance(rdzv, Rendezvous) else None
    if problem is not None:
        raise LaunchError(problem)
    with naming_this_launcher():
        torch_run(args)


if __name__ == "__main__":
    main()
