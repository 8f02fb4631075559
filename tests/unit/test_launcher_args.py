"""The launchers' argument handling, rendezvous preparation and messages, without starting a job."""

import socket
import sys

import pytest

from atorch.distributed import launch, run
from atorch.distributed.run import (
    LaunchError,
    _exit_code,
    _rendezvous_failure,
    _split_at_script,
    check_environment,
    prepare_rendezvous,
    translate_args,
    waiting_line,
)

SCHEDULER_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ATORCH_INIT_TIMEOUT",
                 "PET_RDZV_ID", "PET_NODE_RANK", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID",
                 "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in SCHEDULER_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def taken_port():
    """A port held by a plain listening socket (something that is not a rendezvous store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def _prepared(argv, env=None):
    """torchrun's parsed arguments after `prepare_rendezvous`, and what it decided."""
    from torch.distributed.run import parse_args

    args = parse_args(translate_args(argv, env={}))
    rdzv = prepare_rendezvous(args, argv[:_split_at_script(argv)], env)
    return args, rdzv


def _conf(args):
    return dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- defect 3: --no_python runs any executable --------------------------------------------------------------

def test_no_python_takes_any_executable_as_the_script(tmp_path):
    argv = ["--nproc_per_node", "1", "--no_python", "/bin/echo", "hi", "there"]
    assert _split_at_script(argv) == 3
    assert translate_args(argv, env={})[-4:] == ["--no_python", "/bin/echo", "hi", "there"]
    check_environment(argv)                                   # was: "no training script ..."
    check_environment(["--no-python", "echo", "x.py"])        # a command on PATH
    with pytest.raises(ValueError, match="executable 'no_such_command_xyz' \\(after --no_python\\)"):
        check_environment(["--no_python", "no_such_command_xyz"])
    with pytest.raises(ValueError, match="--no_python runs an executable, -m runs a Python module"):
        check_environment(["--no_python", "-m", "json.tool"])
    # Without --no_python the script is still the first .py, and a flag's value is never the script.
    assert _split_at_script(["--nproc_per_node", "2", "train", "a.py"]) == 3
    assert _split_at_script(["--log_dir", "logs.py", "--nproc_per_node=2", "t.py", "--no_python"]) == 3
    with pytest.raises(ValueError, match=r"no training script in \['--nproc_per_node', '2', 'train'\]"):
        check_environment(["--nproc_per_node", "2", "train"])


def test_old_launcher_no_python_executable():
    args = launch.parse_args(["--nproc_per_node", "1", "--no_python", "/bin/echo", "hi", "there"])
    run_args = launch.to_run_args(args)
    assert run_args[-4:] == ["--no_python", "/bin/echo", "hi", "there"]
    check_environment(run_args)
    with pytest.raises(ValueError, match="training script 'train' must be a file ending in .py"):
        launch.to_run_args(launch.parse_args(["train", "a.py"]))


# -- defect 4: the old launcher's usage errors --------------------------------------------------------------

@pytest.mark.parametrize("argv, env, expected", [
    (["--nproc_per_node", "0", "x.py"], {}, "--nproc_per_node=0 must be >= 1"),
    (["--coworker_size", "1", "x.py"], {}, "--coworker_size=1 is not supported"),
    (["--not_use_env", "x.py"], {}, "--not_use_env is not supported"),
    (["x.py"], {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' (read because --nnodes was not given)"),
    (["--nproc_per_node", "2", "x.py"], {"RANK": "5", "WORLD_SIZE": "2"},
     "environment variable RANK=5 (read because --node_rank was not given) must be below the number of nodes "
     "(WORLD_SIZE=2, read because --nnodes was not given)"),
    (["--nnodes", "2", "x.py"], {"RANK": "2"}, "RANK=2 (read because --node_rank was not given) must be below "
                                              "the number of nodes (--nnodes=2)"),
    (["x.py"], {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 (read because --master_port was not given)"),
    (["--master_port", "-3", "x.py"], {}, "--master_port=-3 must be a TCP port"),
    (["no_such_script.py"], {}, "training script 'no_such_script.py' does not exist"),   # forwarded by run
])
def test_old_launcher_usage_errors_are_one_line_and_exit_2(monkeypatch, capsys, argv, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("atorch.distributed.launch: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert "--node_rank='" not in err and "atorch.distributed.run" not in err


# -- defect 1: the store's host checks its port; the rendezvous id names the job ----------------------------

def test_fault_tolerant_single_node_refuses_a_taken_port(taken_port):
    with pytest.raises(LaunchError, match=f"port {taken_port} of the rendezvous at 127.0.0.1:{taken_port} is "
                                          "already in use on this host"):
        _prepared(["--fault_tolerant", "--master_port", str(taken_port), "--nproc_per_node", "1", "t.py"])
    # node rank 0 hosts the store of a multi-node job, with or without --fault_tolerant
    for extra in (["--fault_tolerant"], []):
        with pytest.raises(LaunchError, match="already in use"):
            _prepared([*extra, "--nnodes", "2", "--node_rank", "0", "--master_port", str(taken_port), "t.py"])
    # another node does not host it: no check, and c10d is told so (it would otherwise try to host)
    args, rdzv = _prepared(["--fault_tolerant", "--nnodes", "2", "--node_rank", "1", "--master_port",
                            str(taken_port), "t.py"])
    assert rdzv.hosts_store is False and _conf(args)["is_host"] == "false"


def test_main_port_in_use_is_one_line_exit_1(taken_port, capsys, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--fault_tolerant", "--master_port", str(taken_port), "--nproc_per_node", "1", str(script)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"atorch.distributed.run: error: port {taken_port} " in err, err


def test_store_host_is_told_to_host(monkeypatch):
    port = _free_port()
    args, rdzv = _prepared(["--fault_tolerant", "--master_port", str(port), "t.py"])
    assert rdzv.hosts_store is True and _conf(args)["is_host"] == "true"
    # several nodes on this machine without --node_rank: torch's guess (host if it can, else connect)
    args, rdzv = _prepared(["--fault_tolerant", "--nnodes", "2", "--master_port", str(port), "t.py"])
    assert rdzv.hosts_store is None and "is_host" not in _conf(args)
    # a store on another machine is not ours to check
    args, rdzv = _prepared(["--fault_tolerant", "--nnodes", "2", "--master_addr", "192.0.2.1", "--master_port",
                            str(port), "t.py"])
    assert rdzv.hosts_store is False


def test_rendezvous_id_is_unique_to_the_job():
    port = _free_port()
    single = ["--fault_tolerant", "--master_port", str(port), "t.py"]
    first, second = _prepared(single)[0].rdzv_id, _prepared(single)[0].rdzv_id
    assert first.startswith(f"atorch-{port}-") and first != second        # was atorch-<port> for every job
    multi = ["--fault_tolerant", "--nnodes", "2", "--master_addr", "192.0.2.1", "--master_port", str(port), "t.py"]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}
    assert _prepared(multi, env=slurm)[0].rdzv_id == f"atorch-{port}-slurm-4242.1"    # the same on every node
    assert _prepared(multi, env={})[0].rdzv_id == f"atorch-{port}"                  # nothing shared to name it
    assert _prepared(["--rdzv_id", "mine", *single])[0].rdzv_id == "mine"


# -- defect 2: ATORCH_INIT_TIMEOUT bounds the wait for the other nodes --------------------------------------

def test_join_timeout_from_atorch_init_timeout(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("ATORCH_INIT_TIMEOUT", "5")
    for extra in ([], ["--fault_tolerant"]):
        args, rdzv = _prepared([*extra, "--nnodes", "2", "--node_rank", "1", "--master_port", str(port), "t.py"])
        assert _conf(args)["join_timeout"] == "5" and _conf(args)["timeout"] == "5"
        assert waiting_line(rdzv) == (f"atorch.distributed.run: waiting up to 5 s (ATORCH_INIT_TIMEOUT) for 2 "
                                      f"nodes at 127.0.0.1:{port}")
    monkeypatch.setenv("ATORCH_INIT_TIMEOUT", "2.5")
    assert _prepared(["--nnodes", "1:3", "--master_port", str(port), "--node_rank", "1", "t.py"])[1].timeout_s == 3
    assert "for 1 to 3 nodes" in waiting_line(_prepared(["--nnodes", "1:3", "--node_rank", "1", "t.py"])[1])
    # one node waits for nobody: no line; the user's --rdzv_conf wins
    assert waiting_line(_prepared(["t.py"])[1]) is None
    args, rdzv = _prepared(["--fault_tolerant", "--nnodes", "2", "--rdzv_conf", "join_timeout=30", "t.py"])
    assert _conf(args)["join_timeout"] == "30" and rdzv.timeout_s == 30 and rdzv.timeout_source.startswith("--rdzv")
    monkeypatch.delenv("ATORCH_INIT_TIMEOUT")
    assert _prepared(["--nnodes", "2", "--node_rank", "1", "t.py"])[1].timeout_s == 600
    monkeypatch.setenv("ATORCH_INIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ATORCH_INIT_TIMEOUT='soon'"):
        _prepared(["t.py"])


def test_rendezvous_timeout_message(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    monkeypatch.setenv("ATORCH_INIT_TIMEOUT", "5")
    _, rdzv = _prepared(["--nnodes", "2", "--node_rank", "1", "--master_port", "29999", "t.py"])
    message = _rendezvous_failure(RendezvousTimeoutError(), rdzv)
    assert message is not None and ("the rendezvous at 127.0.0.1:29999 did not gather 2 nodes within 5 s "
                                    "(ATORCH_INIT_TIMEOUT)") in message
    store_timeout = RuntimeError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")
    assert "within 5 s (ATORCH_INIT_TIMEOUT)" in _rendezvous_failure(store_timeout, rdzv)
    assert _rendezvous_failure(RuntimeError("something else"), rdzv) is None


# -- defect 5: the failed worker's exit code ----------------------------------------------------------------

def test_exit_code_as_a_shell_reports_it():
    assert _exit_code(3) == 3 and _exit_code(-9) == 137 and _exit_code(-15) == 143 and _exit_code(0) == 1



def test_store_probe_accepts_a_store_and_names_a_port_where_something_else_listens():
    import datetime
    import socket

    import torch.distributed as dist

    from atorch.distributed.store_probe import StoreProbeError, check_store_endpoint

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    check_store_endpoint("127.0.0.1", store.port, wait_s=5, answer_s=5)      # a store answers at once
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(4)
        port = other.getsockname()[1]
        with pytest.raises(StoreProbeError, match=f"127.0.0.1:{port} is not a torch rendezvous store: it accepted "
                                                  "a connection but did not answer as a torch store within 0.5 s"):
            check_store_endpoint("127.0.0.1", port, wait_s=5, answer_s=0.5)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]      # bound, not listening: connections are refused
        with pytest.raises(StoreProbeError, match=f"nothing accepted connections at 127.0.0.1:{port} within 0.3 s"):
            check_store_endpoint("127.0.0.1", port, wait_s=0.3, poll_s=0.1)
    with pytest.raises(StoreProbeError, match="cannot resolve the rendezvous host"):
        check_store_endpoint("no-such-host.invalid", 1234, wait_s=1)


def _job_failing_with(monkeypatch, tmp_path, capsys, exitcodes):
    """run_job's stderr and status when torch elastic reports workers that exited with `exitcodes`."""
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                     error_file=str(tmp_path / f"absent_{rank}.json"))
                for rank, code in enumerate(exitcodes)}

    def failing(args):
        raise ChildFailedError(name="train.py", failures=failures)

    monkeypatch.setattr(torch_run, "run", failing)
    args, rdzv = _prepared(["--nproc_per_node", str(len(exitcodes)), "t.py"])
    code = run.run_job(args, rdzv)
    return code, capsys.readouterr().err


def test_a_usage_error_in_the_workers_is_not_buried_under_the_failure_table(monkeypatch, tmp_path, capsys):
    code, err = _job_failing_with(monkeypatch, tmp_path, capsys, [2, 2])
    assert code == 2 and "Root Cause" not in err and err.count("\n") == 1, err
    assert "failed with exit code 2 (a usage error: the worker's message is above); the launcher exits with 2" in err
    code, err = _job_failing_with(monkeypatch, tmp_path, capsys, [1, 2])   # a crash: the table, as torchrun's
    assert code in (1, 2) and "Root Cause" in err and "(a usage error" not in err, err
    # The agent SIGTERMed the other rank before it reached its own exit 2: still the usage line, no table.
    code, err = _job_failing_with(monkeypatch, tmp_path, capsys, [2, -15])
    assert code == 2 and "Root Cause" not in err and "(a usage error: the worker's message is above)" in err, err



def test_an_unknown_rendezvous_backend_is_a_usage_error_listing_the_registered_ones(capsys, tmp_path):
    """It failed only once torch elastic's agent started: a traceback and exit status 1."""
    from atorch.cli import main as cli_main

    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["run", "--nproc_per_node", "1", "--rdzv_backend", "foo", str(script)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--rdzv_backend='foo' is not a registered rendezvous backend; use one of [" in err, err
    assert "'c10d'" in err and "'static'" in err, err
    with pytest.raises(ValueError, match="--rdzv_backend='bar' is not a registered"):
        translate_args(["--rdzv-backend=bar", "x.py"], env={})
    assert "--rdzv_backend=c10d" in translate_args(["--rdzv-backend", "c10d", "x.py"], env={})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_an_unknown_launcher_flag_names_this_launcher(capsys, tmp_path):
    """torchrun's own parser named the file it ran as (`run.py: error: unrecognized arguments: --bogus`)
    under torchrun's 40-line usage; the error is the launcher's, with its one-line usage."""
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--nproc_per_node", "1", "--bogus", str(script)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "atorch.distributed.run: error: unrecognized arguments: --bogus" in err, err
    assert "run.py" not in err and len(err.splitlines()) == 2, err


def test_a_launcher_stopped_by_sigterm_exits_143_with_one_line(monkeypatch, capsys):
    """torch elastic stops the workers and raises SignalException in the agent: the launcher printed its
    30-line traceback and exited 1; it exits as a shell reports a process ended by the signal."""
    import signal

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        raise SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch_run, "run", stopped)
    args, rdzv = _prepared(["--nproc_per_node", "2", "t.py"])
    assert run.run_job(args, rdzv) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_node_range_uses_the_c10d_rendezvous(monkeypatch):
    """`--nnodes 1:2` ran the static rendezvous, which waits for all 2 nodes, while saying "1 to 2 nodes"."""
    monkeypatch.setenv("ATORCH_INIT_TIMEOUT", "15")
    argv = ["--nnodes", "1:2", "--nproc_per_node", "1", "t.py"]
    assert "--rdzv_backend=c10d" in translate_args(argv, env={})
    assert "--rdzv_endpoint=10.0.0.1:1234" in translate_args(["--master_addr", "10.0.0.1", "--master_port", "1234",
                                                              *argv], env={})
    args, rdzv = _prepared(["--node_rank", "1", *argv])
    # One node starts once no other joined for the last call, which must end within the join timeout.
    assert _conf(args)["last_call_timeout"] == "7" and _conf(args)["join_timeout"] == "15"
    assert waiting_line(rdzv).endswith("for 1 to 2 nodes at 127.0.0.1:29500; starts once 1 have joined and no other "
                                       "joined for 7 s")
    monkeypatch.delenv("ATORCH_INIT_TIMEOUT")
    assert _conf(_prepared(["--node_rank", "1", *argv])[0])["last_call_timeout"] == "30"   # torch's default
    assert "last_call_timeout" not in _conf(_prepared(["--nnodes", "2", "--node_rank", "1", "t.py"])[0])
    with pytest.raises(ValueError, match="--nnodes=1:2 .a range. needs an elastic rendezvous, but "
                                         "--rdzv_backend=static waits for all 2 nodes"):
        translate_args(["--rdzv_backend", "static", *argv], env={})


def test_nproc_per_node_gpu_without_cuda_and_an_ambiguous_flag_are_usage_lines(monkeypatch, capsys, tmp_path):
    """torch's "ValueError: Cuda is not available." traceback (exit 1); `run.py: error: ambiguous option`."""
    import torch

    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--nproc_per_node", "gpu"], "--nproc_per_node=gpu starts one worker per CUDA device, "
                                                        "but this machine has none"),
                          (["--nproc", "2"], "ambiguous option: --nproc could match")):
        with pytest.raises(SystemExit) as exit_info:
            run.main([*argv, str(script)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(f"atorch.distributed.run: error: {message}"), err
        assert err.count("\n") == 1 and "run.py" not in err, err
