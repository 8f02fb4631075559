"""srun without torchrun: every task gets its rank from Slurm's environment."""

import pytest

from atorch.distributed.slurm import expand_hostlist, is_slurm_task, slurm_environment


def test_hostlists():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a[9-11]b,c") == ["a9b", "a10b", "a11b", "c"]
    with pytest.raises(ValueError, match="bad range '5-3'"):
        expand_hostlist("n[5-3]")


def test_two_nodes_four_tasks_each():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "0"}
    assert is_slurm_task(env)
    out = slurm_environment(env)
    assert out["RANK"] == "5" and out["WORLD_SIZE"] == "8" and out["LOCAL_RANK"] == "1"
    assert out["LOCAL_WORLD_SIZE"] == "4" and out["MASTER_ADDR"] == "gpu12"
    # Every task of the step derives the same port from the job and step ids.
    assert out["MASTER_PORT"] == slurm_environment({**env, "SLURM_PROCID": "0", "SLURM_NODEID": "0"})["MASTER_PORT"]
    assert 15000 <= int(out["MASTER_PORT"]) < 30000


def test_step_values_win_and_explicit_master_is_kept():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "a[1-8]", "SLURM_STEP_NODELIST": "a3",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555"}
    out = slurm_environment(env)
    assert (out["WORLD_SIZE"], out["LOCAL_WORLD_SIZE"], out["MASTER_ADDR"], out["MASTER_PORT"]) == (
        "2", "2", "10.1.2.3", "29555")
    assert slurm_environment({k: v for k, v in env.items() if k != "MASTER_ADDR"})["MASTER_ADDR"] == "a3"


def test_not_a_slurm_task_and_bad_values():
    assert not is_slurm_task({"SLURM_PROCID": "0", "RANK": "0"})          # torchrun inside an allocation
    assert not is_slurm_task({"SLURM_PROCID": "0", "TORCHELASTIC_RUN_ID": "x"})
    assert not is_slurm_task({})
    with pytest.raises(ValueError, match=r"SLURM_PROCID=4 is not in \[0, 4\)"):
        slurm_environment({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n1"})
    with pytest.raises(ValueError, match="SLURM_NTASKS='x' must be an integer"):
        slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "SLURM_LOCALID": "0"})
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='2x' is not in Slurm's format"):
        slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                           "SLURM_TASKS_PER_NODE": "2x", "SLURM_NODELIST": "n1"})


# Captured from Slurm 22.05 (scripts/slurm_local.sh): `sbatch --ntasks=2`'s batch script, and a
# task of `srun -n1` inside it.
BATCH_SCRIPT_ENV = {"SLURM_JOB_ID": "3", "SLURM_JOBID": "3", "SLURM_JOB_NODELIST": "vm", "SLURM_NODELIST": "vm",
                    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
                    "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1"}
STEP_ENV = {**BATCH_SCRIPT_ENV, "SLURM_NTASKS": "1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1"}


def test_a_batch_script_is_not_a_task_of_the_job():
    # Its SLURM_PROCID=0 with the job's SLURM_NTASKS=2 would make it rank 0 of 2, waiting for a rank 1 that
    # never starts; it is a world of one, with a hint to use srun.
    from atorch.distributed.slurm import outside_step_note

    assert not is_slurm_task(BATCH_SCRIPT_ENV)
    note = outside_step_note(BATCH_SCRIPT_ENV)
    assert note is not None and "Slurm job 3 (2 tasks) but outside an srun step" in note and "srun python" in note
    assert outside_step_note({**BATCH_SCRIPT_ENV, "SLURM_NTASKS": "1"}) is None    # nothing left idle
    assert outside_step_note(STEP_ENV) is None
    assert outside_step_note({**BATCH_SCRIPT_ENV, "RANK": "0"}) is None            # a launcher's worker
    assert is_slurm_task(STEP_ENV)
    out = slurm_environment(STEP_ENV)
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"], out["LOCAL_WORLD_SIZE"], out["MASTER_ADDR"]) == (
        "0", "1", "0", "1", "vm")


def _launcher_step(nodes: int, tasks: int, node_id: int) -> dict:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(node_id), "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks // nodes}(x{nodes})", "SLURM_STEP_NODELIST": f"gpu[1-{nodes}]",
            "SLURM_NTASKS": str(tasks)}


def test_launcher_takes_its_placement_from_the_step():
    from atorch.distributed.run import translate_args

    # srun -N2 --ntasks-per-node=1 atorch run --nproc_per_node 8 train.py, on the second node.
    args = translate_args(["--nproc_per_node", "8", "train.py", "--lr", "1"], env=_launcher_step(2, 2, 1))
    port = slurm_environment(_launcher_step(2, 2, 0))["MASTER_PORT"]   # the same on every node
    assert args == ["--max_restarts=0", "--nnodes=2", "--master_addr=gpu1", f"--master_port={port}",
                    "--node_rank=1", "--nproc_per_node", "8", "train.py", "--lr", "1"]
    # Restarts: the c10d rendezvous on the first node.
    args = translate_args(["--fault_tolerant", "--nproc_per_node", "8", "train.py"], env=_launcher_step(2, 2, 0))
    assert f"--rdzv_endpoint=gpu1:{port}" in args and "--nnodes=2" in args
    # One node: unchanged (standalone, a free port); explicit placement flags win; outside a step nothing changes.
    assert translate_args(["--nproc_per_node", "2", "t.py"], env=_launcher_step(1, 1, 0)) == \
        translate_args(["--nproc_per_node", "2", "t.py"], env={})
    assert "--nnodes=1" in translate_args(["--nnodes", "1", "t.py"], env=_launcher_step(2, 2, 1))
    assert "--nnodes=2" not in translate_args(["t.py"], env={**_launcher_step(2, 2, 1), "RANK": "1"})


def test_launcher_refuses_several_launchers_per_node():
    from atorch.distributed.run import translate_args

    with pytest.raises(ValueError, match=r"runs as 4 tasks of an srun step on 2 node\(s\); start one launcher per "
                                         r"node \(srun --ntasks-per-node=1"):
        translate_args(["--nproc_per_node", "2", "t.py"], env=_launcher_step(2, 4, 0))


def test_launcher_warns_when_its_task_has_fewer_cpus_than_workers():
    from atorch.distributed.slurm import launcher_cpu_note

    # srun -n1 atorch run --nproc_per_node 2: Slurm bound the task to one CPU (seen with 22.05's task/affinity).
    note = launcher_cpu_note(STEP_ENV, nproc_per_node=2, cpus=1)
    assert note is not None and "job 3 may use 1 CPU(s) but the launcher starts 2 workers" in note
    assert "--cpus-per-task=2" in note
    assert launcher_cpu_note(STEP_ENV, nproc_per_node=2, cpus=2) is None
    assert "job 3 may use 2 CPU(s)" in launcher_cpu_note(BATCH_SCRIPT_ENV, nproc_per_node=8, cpus=2)
    assert launcher_cpu_note({}, nproc_per_node=8, cpus=1) is None                      # not in a Slurm job
    assert launcher_cpu_note({**STEP_ENV, "RANK": "0"}, nproc_per_node=8, cpus=1) is None


def test_cuda_device_of_a_task_that_sees_one_gpu(monkeypatch):
    # srun --gpus-per-task=1: every task sees only its own GPU, device 0, whatever its LOCAL_RANK.
    import torch

    from atorch.distributed.process_group import cuda_index

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_index() == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)     # all of the node's GPUs: LOCAL_RANK picks
    assert cuda_index() == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3 but this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES='4,5'\)"):
        cuda_index()
