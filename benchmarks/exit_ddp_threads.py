"""Which gloo threads outlive `destroy_process_group()` + `gc.collect()`, after which step of a job.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/exit_ddp_threads.py

One process, world 1, plain torch (no atorch): each case runs in its own interpreter, does one
thing with the default gloo group, drops every reference of its own, destroys the group, collects
garbage, and lists the process's threads by name (/proc/self/task/*/comm). Threads left alive at
this point are joined only in interpreter finalization, where a worker that needs the GIL aborts
the process (benchmarks/RESULTS.md, "Clean exit"). Found in session 6: constructing a
`DistributedDataParallel` keeps them, because it imports `torch._dynamo`, and importing
`torch._dynamo` after the group exists is enough; imported before, nothing is left
(atorch.init_distributed now imports it first).
"""

from __future__ import annotations

import socket
import subprocess
import sys

CASE = r'''
import gc, os, sys, torch
import torch.distributed as dist
case = sys.argv[2]
if case.endswith("dynamo imported before init"):
    import torch._dynamo
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
if case == "dynamo imported after init":
    import torch._dynamo
if case == "all_reduce":
    t = torch.ones(3); dist.all_reduce(t); del t
elif case.startswith("reducer"):
    params = list(torch.nn.Linear(4, 4).parameters())
    r = dist.Reducer(params, [list(range(len(params)))], [1 << 20], dist.group.WORLD, [False] * len(params),
                     25 << 20, False, False, {}, False, None)
    logger = dist.Logger(r)
    if case == "reducer+set_logger":
        r.set_logger(logger)          # what DDP's constructor does
    del logger, r, params
elif case.startswith("ddp"):   # DDP's constructor imports torch._dynamo
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    del m
gc.collect(); dist.destroy_process_group(); gc.collect()
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(f"{case}: {len(names) - 1} threads left", [n for n in names if n != "python"])
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    for case in ("nothing", "all_reduce", "reducer", "reducer+set_logger", "ddp", "dynamo imported after init",
                 "dynamo imported before init", "ddp, dynamo imported before init"):
        out = subprocess.run([sys.executable, "-c", CASE, str(_free_port()), case], capture_output=True, text=True,
                             timeout=120)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else f"{case} failed: {out.stderr[-300:]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
