"""A finished job exits 0 every time: repeat a 2-rank training job with checkpointing, count failed exits.

    python benchmarks/exit_stress.py --repeats 50 --launchers-repeats 20 [--strategy fsdp] [--out DIR]
    python benchmarks/exit_stress.py --race {torch,torch-destroy,atorch} --repeats 30 --launchers-repeats 0

Each repeat runs `benchmarks/exit_stress_job.py` (train 3 steps, save a checkpoint, exit) under
`atorch.distributed.run --nproc_per_node 2`; then the two-launcher job (two launchers on
127.0.0.1 as two nodes of 1 process each) is repeated. A repeat fails when the launcher exits
non-zero or any output holds "terminate called" / "Aborted" / a signal. Prints one line per
repeat and a summary (failures, median and max seconds); failing logs are kept under --out.
`--race MODE` repeats `benchmarks/exit_race_job.py MODE` instead (the minimal reproduction of the
SIGABRT at exit, with and without atorch's exit teardown).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "exit_stress_job.py"
RACE_JOB = REPO / "benchmarks" / "exit_race_job.py"
BAD_MARKERS = ("terminate called", "Aborted", "SIGABRT", "Signals.SIG", "exitcode  : -")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _free_port() -> int:
    sys.path.insert(0, str(REPO))
    from atorch.distributed import find_free_port

    return find_free_port()


def one_node(work: Path, strategy: str, timeout: float) -> Tuple[bool, float, str]:
    cmd = [sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "2", str(JOB), str(work), strategy]
    if strategy.startswith("race:"):
        cmd = [sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "2", str(RACE_JOB),
               strategy.split(":", 1)[1]]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    except subprocess.TimeoutExpired as e:
        return False, time.monotonic() - start, f"timeout after {timeout} s\n{e.stdout}\n{e.stderr}"
    log = out.stdout + out.stderr
    ok = out.returncode == 0 and not any(m in log for m in BAD_MARKERS) and log.count(" done") == 2
    return ok, time.monotonic() - start, f"rc={out.returncode}\n{log}"


def two_launchers(work: Path, strategy: str, timeout: float) -> Tuple[bool, float, str]:
    port = _free_port()
    procs = []
    start = time.monotonic()
    for node in (0, 1):
        cmd = [sys.executable, "-m", "atorch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB),
               str(work), strategy]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                      cwd=REPO, start_new_session=True))
    logs: List[str] = []
    ok = True
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            ok = False
            out = f"timeout\n{out}"
        logs.append(f"rc={p.returncode}\n{out}")
        ok = ok and p.returncode == 0 and not any(m in out for m in BAD_MARKERS)
    ok = ok and "".join(logs).count(" done") == 2
    return ok, time.monotonic() - start, "\n=== node 1 ===\n".join(logs)


def run_series(name: str, fn, repeats: int, strategy: str, out_dir: Path, timeout: float) -> Tuple[int, List[float]]:
    failures, times = 0, []
    for i in range(repeats):
        work = Path(tempfile.mkdtemp(prefix=f"exit_stress_{name}_"))
        ok, seconds, log = fn(work, strategy, timeout)
        times.append(seconds)
        load = os.getloadavg()[0]
        if not ok:
            failures += 1
            (out_dir / f"{name}_{i}.log").write_text(log)
        print(f"{name} {i + 1}/{repeats}: {'ok' if ok else 'FAILED'} {seconds:.1f} s (load {load:.1f})", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return failures, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--launchers-repeats", type=int, default=20)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--out", default="exit_stress_logs")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--race", choices=["torch", "torch-destroy", "atorch"], default=None,
                        help="repeat the minimal exit-race job in this mode instead of the training job")
    args = parser.parse_args()
    if args.race:
        args.strategy = f"race:{args.race}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    for name, fn, repeats in (("one_node", one_node, args.repeats), ("two_launchers", two_launchers,
                                                                     args.launchers_repeats)):
        if repeats <= 0:
            continue
        failures, times = run_series(name, fn, repeats, args.strategy, out_dir, args.timeout)
        summary.append(f"{name} ({args.strategy}): {failures} failures in {repeats} runs; seconds median "
                       f"{statistics.median(times):.1f}, min {min(times):.1f}, max {max(times):.1f}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
