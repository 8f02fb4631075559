"""ATorch's static launcher: `python -m atorch.distributed.launch --nproc_per_node N script.py ARGS`.

`parse_args` accepts ATorch's options; `main(args)` runs the job through torch elastic (as
`python -m atorch.distributed.run`, without restarts) and blocks until every worker exits,
raising torch's `ChildFailedError` when one fails. As in ATorch, when an option is not given
the node count comes from the environment variable WORLD_SIZE, the node rank from RANK and
the master from MASTER_ADDR/MASTER_PORT (how a cluster scheduler describes the job's pods);
one node without a port picks a free one.
Options without an equivalent here raise ValueError: `--coworker_size` > 0 (CPU coworker
pods), `--nsys_profiling_rank`, `--not_use_env` (the script always gets LOCAL_RANK in its
environment); `--master_port2` is ignored (it served the coworker data service).
From the command line, a usage mistake (also in a value read from WORLD_SIZE, RANK or MASTER_PORT,
which the message names) exits with status 2 and one line, as `atorch.distributed.run`; a failed
worker's exit code is the launcher's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from argparse import REMAINDER
from typing import Any, List, Optional, Sequence, Union

from atorch.distributed.run import main as run_main

PROG = "atorch.distributed.launch"

__all__ = ["check_process_loop", "main", "parse_args", "to_run_args"]


def parse_args(args: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """ATorch's launcher command line (`args` None: sys.argv[1:])."""
    parser = argparse.ArgumentParser(prog=PROG,
                                     description="atorch static launcher (ATorch's atorch.distributed.launch)")
    parser.add_argument("--nsys_profiling_rank", type=int, default=-1)
    parser.add_argument("--nsys_command", type=str, default="nsys")
    parser.add_argument("--nnodes", type=int, default=0, help="number of nodes; 0: $WORLD_SIZE or 1")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's rank; -1: $RANK or 0")
    parser.add_argument("--nproc_per_node", type=int, default=1)
    parser.add_argument("--master_addr", type=str, default="", help="'': $MASTER_ADDR or 127.0.0.1")
    parser.add_argument("--master_port", type=int, default=0, help="0: $MASTER_PORT, or a free port on one node")
    parser.add_argument("--master_port2", type=int, default=0)
    parser.add_argument("--not_use_env", action="store_true")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--coworker_size", type=int, default=-1)
    parser.add_argument("--rank_log_dir", type=str, default="")
    parser.add_argument("training_script", type=str)
    parser.add_argument("training_script_args", nargs=REMAINDER)
    return parser.parse_args(None if args is None else list(args))


def to_run_args(args: argparse.Namespace) -> List[str]:
    """The `python -m atorch.distributed.run` arguments for ATorch launcher options; ValueError for unsupported ones."""
    if args.coworker_size > 0:
        raise ValueError(f"--coworker_size={args.coworker_size} is not supported: atorch has no CPU coworker pods")
    if args.nsys_profiling_rank >= 0:
        raise ValueError("--nsys_profiling_rank is not supported; wrap the training command in nsys yourself, e.g. "
                         "python -m atorch.distributed.run --no_python ... nsys profile python train.py")
    if args.not_use_env:
        raise ValueError("--not_use_env is not supported: workers read LOCAL_RANK from the environment")
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node={args.nproc_per_node} must be >= 1")
    if not (args.no_python or args.module or args.training_script.endswith(".py")):
        raise ValueError(f"training script {args.training_script!r} must be a file ending in .py (or give -m for a "
                         "module, --no_python for an executable)")
    nnodes = args.nnodes if args.nnodes > 0 else _env_int("WORLD_SIZE", 1, 1, "--nnodes")
    node_rank = args.node_rank if args.node_rank >= 0 else _env_int("RANK", 0, 0, "--node_rank")
    if node_rank >= nnodes:
        rank_from = f"--node_rank={node_rank}" if args.node_rank >= 0 else \
            f"environment variable RANK={node_rank} (read because --node_rank was not given)"
        if args.nnodes > 0:
            nodes_from = f"--nnodes={nnodes}"
        elif os.environ.get("WORLD_SIZE", "").strip():
            nodes_from = f"WORLD_SIZE={nnodes}, read because --nnodes was not given"
        else:
            nodes_from = "one node: neither --nnodes nor WORLD_SIZE was given"
        raise ValueError(f"{rank_from} must be below the number of nodes ({nodes_from})")
    out = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={args.nproc_per_node}"]
    addr = args.master_addr or os.environ.get("MASTER_ADDR", "")
    if args.master_port and not 1 <= args.master_port <= 65535:
        raise ValueError(f"--master_port={args.master_port} must be a TCP port, 1..65535 (0: MASTER_PORT or a free "
                         "port)")
    port = args.master_port or _env_int("MASTER_PORT", 0, 0, "--master_port")
    if port > 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} (read because --master_port was not given) must "
                         "be a TCP port, 1..65535")
    if nnodes > 1 or port:
        out += [f"--master_addr={addr or '127.0.0.1'}", f"--master_port={port or 29500}"]
    # One node and no port: the launcher's standalone rendezvous picks a free port.
    if args.rank_log_dir:
        path = args.rank_log_dir.split(",")[0]
        out += [f"--log_dir={path}", "--redirects=3"]  # every rank's stdout and stderr to files under path
    if args.no_python:
        out.append("--no_python")
    if args.module:
        out.append("--module")
    return out + [args.training_script, *args.training_script_args]


def _env_int(name: str, default: int, minimum: int, flag: str) -> int:
    """The scheduler's value of `name` for a launcher option that was not given (`default` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} (read because {flag} was not given) must be an "
                         f"integer >= {minimum}")
    return value


def main(args: Union[argparse.Namespace, Sequence[str], None] = None) -> None:
    """Run the job described by ATorch launcher `args` (a parsed Namespace, an argument list, or sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    try:
        run_args = to_run_args(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    run_main(run_args, prog=PROG)


if __name__ == "__main__":
    main()


def check_process_loop(processes: Sequence[Any], poll_interval_s: float = 1.0) -> None:
    """Wait for ATorch-style worker entries `(subprocess.Popen, stdout, stderr)` to finish.

    When one exits non-zero the others are terminated and the caller exits with that code
    (128 + N for a worker killed by signal N), as ATorch's launcher did; returns when all
    succeeded.
    """
    while True:
        codes = [entry[0].poll() for entry in processes]
        failed = [(i, c if c >= 0 else 128 - c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            for entry, code in zip(processes, codes):
                if code is None:
                    entry[0].terminate()
            print(f"worker process(es) failed (index, exit code): {failed}", file=sys.stderr)
            sys.exit(failed[0][1])
        if all(c == 0 for c in codes):
            return
        time.sleep(poll_interval_s)
