"""Parallel groups over 8 and 4 gloo ranks, init_distributed, and bad input before any collective."""

import atexit
import datetime
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import atorch
from atorch import distributed as adist
from atorch.distributed import timeouts
from atorch.testing import DistributedTestError, run_distributed


def _groups_8_ranks(marker_dir):
    # The helper lets a rank exit as an interpreter does: its atexit handlers run (atorch's wait for
    # an asynchronous save and its group teardown are some), also when the rank was forked.
    marker = os.path.join(marker_dir, f"atexit ran on rank {adist.rank()}")
    atexit.register(lambda: open(marker, "w").close())
    adist.create_parallel_group(([("tensor", 2), ("data", 2), ("pipeline", 2)], None))
    out = {}
    for name in ("tensor", "data", "pipeline"):
        group = adist.parallel_group(name)
        # The group really connects the ranks of the table: all_gather the global ranks over it.
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(adist.parallel_group_size(name))]
        dist.all_gather(gathered, torch.tensor([adist.rank()]), group=group)
        out[name] = ([int(t) for t in gathered], adist.parallel_rank(name), adist.parallel_group_size(name))
        # The DeviceMesh exposes the same groups.
        assert adist.device_mesh(name).mesh.tolist() == out[name][0]
    assert adist.parallel_config() == ([("tensor", 2), ("data", 2), ("pipeline", 2)], None)
    assert adist.device_mesh().mesh_dim_names == ("pipeline", "data", "tensor")
    assert adist.init_distributed("gloo") is True  # idempotent
    assert adist.device() == torch.device("cpu")
    adist.destroy_parallel_group()
    assert not adist.is_parallel_group_created()
    return out


def test_eight_rank_tables_are_real_groups(tmp_path):
    results = run_distributed(_groups_8_ranks, 8, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [f"atexit ran on rank {r}" for r in range(8)]
    expected = {
        "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    for rank, out in enumerate(results):
        for name, tables in expected.items():
            group = next(g for g in tables if rank in g)
            assert out[name] == (group, group.index(rank), 2), (rank, name, out[name])


def _bad_inputs_raise_everywhere():
    messages = []
    for config in [([("tensor", 2), ("data", 3)], None), ([("tensor", 0), ("data", 4)], None),
                   ([("data", 2), ("data", 2)], None), ([("", 4)], None), ([], None)]:
        try:
            adist.create_parallel_group(config)
        except ValueError as e:
            messages.append(str(e))
    adist.create_parallel_group(([("tensor", 2), ("data", 2)], None))
    try:
        adist.parallel_group("pipeline")
    except ValueError as e:
        messages.append(str(e))
    # Nothing above touched the network: the group still works for everyone.
    t = torch.ones(1)
    dist.all_reduce(t)
    messages.append(float(t))
    messages.append(_rank_two_skips_a_data_collective())
    return messages


# Short, so the case costs seconds; the test's bound on the wait is generous (a loaded 2-core machine).
SUBGROUP_TIMEOUT_S = 5


def _rank_two_skips_a_data_collective():
    """Rank 2 never enters an all_reduce on its data group [0, 2]: (outcome, seconds) on rank 0.

    Before, the mesh's groups had torch's 30-minute timeout whatever ATORCH_COLLECTIVE_TIMEOUT said.
    Rank 2 stays alive (no closed connection) until rank 0 is done: only the timeout can end the wait.
    """
    store = timeouts._store
    assert store is not None
    if adist.rank() == 2:
        store.wait(["skipped_collective_done"], datetime.timedelta(seconds=60))
        return None
    start = time.monotonic()
    try:
        with timeouts.diagnose_collective_timeouts():
            dist.all_reduce(torch.ones(1), group=adist.parallel_group("data"))   # ranks 1 and 3 complete it
        outcome = "completed"
    except timeouts.CollectiveTimeoutError as e:
        outcome = str(e)
    elapsed = time.monotonic() - start
    if adist.rank() == 0:
        store.set("skipped_collective_done", "1")
    return outcome, elapsed


def test_bad_input_raises_on_every_rank_without_hanging_and_subgroups_time_out():
    results = run_distributed(_bad_inputs_raise_everywhere, 4, timeout=150,
                              env={"ATORCH_COLLECTIVE_TIMEOUT": str(SUBGROUP_TIMEOUT_S)})
    for messages in results:
        assert len(messages) == 8, messages
        assert "tensor=2 x data=3 = 6 does not equal world size 4" in messages[0]
        assert "size 0" in messages[1] and "duplicated" in messages[2]
        assert "non-empty" in messages[3] and "empty" in messages[4]
        assert "unknown parallel group 'pipeline'" in messages[5]
        assert messages[6] == 4.0
    # The data group [0, 2] takes ATORCH_COLLECTIVE_TIMEOUT: rank 0 fails after it (plus the roll call's
    # grace of the same length) with the diagnosis naming the collective and rank 2; [1, 3] is unaffected.
    message, elapsed = results[0][7]
    assert f"did not complete within ATORCH_COLLECTIVE_TIMEOUT={SUBGROUP_TIMEOUT_S} s" in message, message
    assert "collective gloo:all_reduce" in message and "mesh_data" in message, message
    assert "rank(s) [2] did not arrive" in message, message
    assert elapsed < 60, f"rank 0 waited {elapsed:.0f} s"   # was torch's 1800 s
    assert results[2][7] is None
    assert [results[r][7][0] for r in (1, 3)] == ["completed", "completed"]


def _fails_on_rank_one():
    # What a rank sees: the caller's environment at the call, then env=; its output goes to the
    # caller's (captured) stdout and stderr, whether it was spawned or forked.
    seen = (os.environ.get("ATORCH_TEST_CALLER"), os.environ.get("ATORCH_TEST_ENV_ARG"))
    print(f"rank {adist.rank()} says hello on stdout", flush=True)
    print(f"rank {adist.rank()} says hello on stderr", file=sys.stderr, flush=True)
    if adist.rank() == 1:
        raise RuntimeError(f"boom on rank one, seeing {seen}")
    dist.barrier()  # rank 0 blocks here; the helper must kill it, not hang


def test_spawn_helper_reports_tracebacks_and_kills_stuck_ranks(monkeypatch, capfd):
    monkeypatch.setenv("ATORCH_TEST_CALLER", "set by the caller")
    with pytest.raises(DistributedTestError, match=r"boom on rank one, seeing \('set by the caller', 'env='\)"):
        run_distributed(_fails_on_rank_one, 2, timeout=60, env={"ATORCH_TEST_ENV_ARG": "env="})
    out, err = capfd.readouterr()
    assert "rank 1 says hello on stdout" in out and "rank 1 says hello on stderr" in err, (out, err)


def test_init_distributed_in_a_plain_process(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        import os, atorch
        import atorch.distributed as d
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        assert atorch.init_distributed() is True and atorch.init_distributed() is True
        print("world", d.rank(), d.world_size(), d.local_rank(), d.device(), os.environ["MASTER_ADDR"])
        try:
            atorch.init_distributed("mpi")
        except ValueError as e:
            print("error", e)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "world 0 1 0 cpu 127.0.0.1" in out.stdout
    assert "backend='mpi' is not supported" in out.stdout
