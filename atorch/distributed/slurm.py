"""Rank and rendezvous from Slurm's environment, for `srun python train.py` (one task per device).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; `srun` sets SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID and the node list instead. `slurm_environment` translates the
latter into the former (pure: an environment in, the variables to set out), so
`init_distributed` gives every task its rank instead of making each a world of one. The step's
values (SLURM_STEP_*) win over the job's: a job may run several steps of different sizes, and
only a process inside a step (SLURM_STEP_ID set) is a task; the batch script itself is not.
Checked against a real Slurm 22.05 (scripts/slurm_local.sh, tests/distributed/test_slurm_real.py).
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional

# Ports derived from the job id, so every task of a job agrees without talking; the range is
# outside the usual ephemeral ports (32768+) and below common service ports.
PORT_BASE, PORT_SPAN = 15000, 15000


def expand_hostlist(hostlist: str) -> List[str]:
    """Slurm's compressed host list, e.g. "gpu[01-03,07],login1" -> ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]."""
    hosts: List[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"SLURM node list {hostlist!r}: bad range {item!r}")
            width = len(lo)
            hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
    if not hosts:
        raise ValueError(f"SLURM node list {hostlist!r} names no host")
    return hosts


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1") for the node of SLURM_NODEID."""
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: List[int] = []
    for item in filter(None, raw.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={raw!r} is not in Slurm's format, e.g. '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node < len(counts):
        return counts[node]
    return int(env.get("SLURM_NTASKS_PER_NODE", "0")) or 1


def _in_step(env: Mapping[str, str]) -> bool:
    # srun sets SLURM_STEP_ID (and the older SLURM_STEPID) in every task of a step. A batch
    # script has neither, yet it has SLURM_PROCID=0 and the job's SLURM_NTASKS (seen with Slurm
    # 22.05: `sbatch --ntasks=2` runs its script with SLURM_PROCID=0, SLURM_NTASKS=2 and no step
    # variables), so reading it as a task would make rank 0 of 2 wait for a rank that never comes.
    return bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


def is_slurm_task(env: Mapping[str, str]) -> bool:
    """A task of an srun step without a launcher of its own (torchrun sets RANK, which wins).

    A batch script, or a shell of `salloc`, is not a task of a step: it trains as a world of
    one, as a plain `python train.py` does (`outside_step_note` says how to use the allocation).
    """
    return "SLURM_PROCID" in env and _in_step(env) and "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env


def outside_step_note(env: Mapping[str, str]) -> Optional[str]:
    """A hint when a process runs in an allocation of several tasks but outside any srun step."""
    if "RANK" in env or "TORCHELASTIC_RUN_ID" in env or _in_step(env) or not env.get("SLURM_JOB_ID"):
        return None
    tasks = env.get("SLURM_NTASKS", "")
    if not tasks.isdigit() or int(tasks) < 2:
        return None
    return (f"running in Slurm job {env['SLURM_JOB_ID']} ({tasks} tasks) but outside an srun step: training as a "
            f"world of one; start one process per task with `srun python ...` (or one launcher per node with "
            f"`srun --ntasks-per-node=1 atorch run --nproc_per_node N ...`)")


def slurm_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for an srun task.

    Values the environment already has (MASTER_ADDR, MASTER_PORT) are kept. Raises ValueError
    naming the variable when Slurm's values are inconsistent.
    """
    def number(*names: str) -> int:
        for name in names:
            if env.get(name, "") != "":
                try:
                    return int(env[name])
                except ValueError:
                    raise ValueError(f"{name}={env[name]!r} must be an integer") from None
        raise ValueError(f"srun task without {' or '.join(names)}; is this a Slurm step?")

    rank = number("SLURM_PROCID")
    world = number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    local_rank = number("SLURM_LOCALID")
    if not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is not in [0, {world}) (SLURM_NTASKS={world})")
    out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(_tasks_on_this_node(env))}
    if env.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = env["MASTER_ADDR"]
    else:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes:
            raise ValueError("srun task without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find the first node")
        out["MASTER_ADDR"] = expand_hostlist(nodes)[0]
    if env.get("MASTER_PORT"):
        out["MASTER_PORT"] = env["MASTER_PORT"]
    else:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
        if not (job.isdigit() and step.isdigit()):
            raise ValueError(f"SLURM_JOB_ID={job!r} and SLURM_STEP_ID={step!r} must be integers")
        out["MASTER_PORT"] = str(PORT_BASE + (int(job) * 97 + int(step)) % PORT_SPAN)
    return out


# The launcher's flags that say where it stands in the job; given any of them, Slurm's values are not used.
LAUNCHER_PLACEMENT_FLAGS = ("--nnodes", "--node_rank", "--node-rank", "--master_addr", "--master-addr",
                            "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
                            "--rdzv-endpoint", "--standalone")


def launcher_placement(env: Mapping[str, str]) -> List[str]:
    """The launcher's --nnodes/--node_rank/--master_addr/--master_port for `srun --ntasks-per-node=1 atorch run`.

    One launcher task per node of the step: node count and this node's rank from the step, the
    rendezvous on the step's first node at the job's derived port. [] outside a step and for a
    one-node step (the launcher's own standalone rendezvous picks a free port there). ValueError
    when the step runs several launchers on a node: each would start its own workers.
    """
    if not is_slurm_task(env):
        return []
    nodes_list = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or (
        str(len(expand_hostlist(nodes_list))) if nodes_list else "1")
    if not (tasks.isdigit() and nodes.isdigit()):
        raise ValueError(f"SLURM_STEP_NUM_TASKS={tasks!r} and SLURM_STEP_NUM_NODES={nodes!r} must be integers")
    if int(tasks) != int(nodes):
        raise ValueError(
            f"the launcher runs as {tasks} tasks of an srun step on {nodes} node(s); start one launcher per node "
            f"(srun --ntasks-per-node=1 atorch run --nproc_per_node N ...), or one process per device without "
            f"the launcher (srun python train.py)")
    if int(nodes) == 1:
        return []
    placement = slurm_environment(env)
    return [f"--nnodes={nodes}", f"--node_rank={env.get('SLURM_NODEID', placement['RANK'])}",
            f"--master_addr={placement['MASTER_ADDR']}", f"--master_port={placement['MASTER_PORT']}"]


def launcher_cpu_note(env: Mapping[str, str], nproc_per_node: int, cpus: int) -> Optional[str]:
    """A warning when a launcher in a Slurm job may use fewer CPUs than it starts workers.

    Slurm binds a task to its CPUs (one by default): `srun -n1 atorch run --nproc_per_node 2`
    runs both workers on one core (seen with Slurm 22.05's task/affinity), at half speed or worse.
    A batch script is bound to the job's CPUs on its node in the same way.
    """
    if not env.get("SLURM_JOB_ID") or "RANK" in env or nproc_per_node <= cpus:
        return None
    return (f"this process of Slurm job {env['SLURM_JOB_ID']} may use {cpus} CPU(s) but the launcher starts "
            f"{nproc_per_node} workers, which will share them; give the task a CPU per worker "
            f"(srun --cpus-per-task={nproc_per_node} ...) or, without the launcher, one task per worker "
            "(srun -n N python train.py)")
