"""ATorch's launcher entry points: `atorch.distributed.launch.parse_args/main` and the `atorch.distributed.run`
functions its test utilities call (`parse_fault_tolerant_or_elastic_args`, `elastic_run`).

From ATorch (dlrover bfd04ef1, `atorch/distributed/launch.py`, `tests/utils/test_utils.py`):
`parse_args([...])` gives node_rank/nproc_per_node/nnodes/training_script/training_script_args,
`main(args)` runs the workers; `elastic_run(parse_fault_tolerant_or_elastic_args(argv, mode))`.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from atorch.distributed.launch import parse_args, to_run_args

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, atorch
    atorch.init_distributed("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    open(f"{sys.argv[1]}.{dist.get_rank()}", "w").write(str(t.item()))
    atorch.reset_distributed()
""")

DRIVER = textwrap.dedent("""
    import sys
    from atorch.distributed.launch import main, parse_args
    from atorch.distributed.run import elastic_run, parse_fault_tolerant_or_elastic_args
    script, out = sys.argv[1], sys.argv[2]
    main(parse_args(["--nproc_per_node=2", script, out + "_launch"]))
    elastic_run(parse_fault_tolerant_or_elastic_args(["--nproc_per_node=2", script, out + "_elastic"],
                                                     mode="fault_tolerant"))
""")


def test_parse_args_as_atorch(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    args = parse_args(["--nnodes=1", "--node_rank=0", "--nproc_per_node=8", "mycode.py", "params for my code"])
    assert (args.node_rank, args.nproc_per_node, args.nnodes) == (0, 8, 1)
    assert (args.training_script, args.training_script_args) == ("mycode.py", ["params for my code"])
    assert to_run_args(args) == ["--nnodes=1", "--node_rank=0", "--nproc_per_node=8", "mycode.py",
                                 "params for my code"]
    # Node count, node rank and master from the environment, as ATorch's launcher reads them.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert to_run_args(parse_args(["--nproc_per_node=4", "-m", "pkg.train"]))[:5] == [
        "--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=10.0.0.1", "--master_port=29500"]
    with pytest.raises(ValueError, match="--coworker_size=1 is not supported"):
        to_run_args(parse_args(["--coworker_size=1", "x.py"]))


def test_launch_main_and_elastic_run_start_workers(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "job.py"),
                          str(tmp_path / "done")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for how in ("launch", "elastic"):
        assert sorted(p.read_text() for p in tmp_path.glob(f"done_{how}.*")) == ["3.0", "3.0"], how


def test_check_process_loop_waits_and_stops_the_others_on_a_failure():
    from atorch.distributed.launch import check_process_loop

    ok = [(subprocess.Popen([sys.executable, "-c", "pass"]), None, None) for _ in range(2)]
    check_process_loop(ok, poll_interval_s=0.05)
    assert all(p.returncode == 0 for p, _, _ in ok)
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bad = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(SystemExit) as exit_info:
        check_process_loop([(slow, None, None), (bad, None, None)], poll_interval_s=0.05)
    assert exit_info.value.code == 3
    assert slow.wait(timeout=30) != 0     # terminated, not left running
