"""Launcher: `python -m atorch.distributed.run [--fault_tolerant] [--max_restarts N] ... script.py ARGS`.

A thin front end over torch elastic (`torch.distributed.run`), not a process manager of its own:
- `--fault_tolerant` lets the elastic agent restart the whole worker group after a failure
  (`--max_restarts`, default 3). Restarts use the c10d rendezvous: measured with torch 2.13,
  the static rendezvous that `--master_addr/--master_port` select fails to re-form a gloo
  group after a restart ("Connection refused" in connectFullMesh), while c10d re-forms it.
- Without it, a crash fails the job at once (`--max_restarts` defaults to 0).
- A single-node job without `--master_port` runs `--standalone`, so concurrent jobs on one
  machine never fight over the default port 29500.
- Started by srun with one task per node (`srun --ntasks-per-node=1 atorch run ...`) and no
  placement flags, it takes `--nnodes`, `--node_rank` and the rendezvous (the step's first
  node, a port derived from the job id) from the step (atorch/distributed/slurm.py).
- Usage mistakes (`--nproc_per_node 0`, `--nnodes 0`, a `--node_rank` outside `--nnodes`, a port
  outside 1..65535, a missing script, a malformed ATORCH_*_TIMEOUT) exit with status 2 and one
  line naming the flag, before any process or socket is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Mapping, Optional, Tuple

from atorch.distributed import slurm

DEFAULT_FAULT_TOLERANT_RESTARTS = 3
DEFAULT_MASTER_PORT = 29500


def _split_at_script(argv: List[str]) -> int:
    """Index of the training script (first argument ending in .py, or the module after -m)."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            return i
        if not arg.startswith("-") and arg.endswith(".py"):
            return i
    return len(argv)


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
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fault_tolerant", "--fault-tolerant", action="store_true")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=None)
    parser.add_argument("--master_addr", "--master-addr", default=None)
    parser.add_argument("--master_port", "--master-port", type=int, default=None)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--rdzv_backend", "--rdzv-backend", default=None)
    parser.add_argument("--standalone", action="store_true")
    at = _split_at_script(argv)
    try:
        ours, rest = parser.parse_known_args(argv[:at])
    except SystemExit as e:  # argparse's own message went to stderr; say it as one usage error
        raise ValueError(f"bad launcher arguments {argv[:at]} (see the message above)") from e
    _check_usage(ours, argv[:at])
    if ours.fault_tolerant:
        restarts = DEFAULT_FAULT_TOLERANT_RESTARTS if ours.max_restarts is None else ours.max_restarts
    else:
        restarts = 0 if ours.max_restarts is None else ours.max_restarts
    out = [f"--max_restarts={restarts}", f"--nnodes={ours.nnodes}"]
    single_node = ours.nnodes in ("1", "1:1")
    if ours.rdzv_backend is not None or ours.standalone:
        out += [f"--rdzv_backend={ours.rdzv_backend}"] if ours.rdzv_backend else ["--standalone"]
        out += _master_args(ours)
    elif ours.fault_tolerant and (ours.master_port is not None or not single_node):
        port = ours.master_port or DEFAULT_MASTER_PORT
        addr = ours.master_addr or "127.0.0.1"
        out += ["--rdzv_backend=c10d", f"--rdzv_endpoint={addr}:{port}", f"--rdzv_id=atorch-{port}"]
    elif ours.master_port is None and single_node:
        out += ["--standalone"]
    else:
        out += _master_args(ours)
    return out + rest + argv[at:]


_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


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
    checker = argparse.ArgumentParser(add_help=False)
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
    _, max_nodes = _nnodes_range(ours.nnodes)
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


def check_environment(argv: List[str]) -> None:
    """What only the launching machine can check: the script exists, atorch's timeouts parse."""
    at = _split_at_script(argv)
    if at >= len(argv):
        raise ValueError(f"no training script in {argv}: give the script (a file ending in .py, or -m module) "
                         "after the launcher flags")
    script = argv[at]
    if script not in ("-m", "--module") and not os.path.isfile(script):
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


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.run import main as torch_run_main

    try:
        args = list(sys.argv[1:] if argv is None else argv)
        translated = translate_args(args)
        check_environment(args)
    except ValueError as e:
        print(f"atorch.distributed.run: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch_run_main(translated)


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
    from torch.distributed.run import parse_args as torch_parse_args

    return torch_parse_args(translate_args(argv))


def elastic_run(args: argparse.Namespace) -> None:
    """Run a job parsed by `parse_fault_tolerant_or_elastic_args`; raises torch's ChildFailedError on failure."""
    from torch.distributed.run import run as torch_run

    torch_run(args)


if __name__ == "__main__":
    main()
