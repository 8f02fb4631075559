import pytest

from atorch.distributed.parallel_layout import ParallelLayout
from atorch.distributed.run import translate_args

DIMS_8 = [("tensor", 2), ("data", 2), ("pipeline", 2)]


def test_rank_tables_for_8_ranks():
    layout = ParallelLayout.create(DIMS_8, 8)
    assert layout.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(6) == {"tensor": 0, "data": 1, "pipeline": 1}


def test_rank_order_permutes_ranks():
    layout = ParallelLayout.create([("tensor", 2), ("data", 2)], 4, rank_order=[3, 2, 1, 0])
    assert layout.groups("tensor") == [[1, 0], [3, 2]]
    assert layout.groups("data") == [[2, 0], [3, 1]]


@pytest.mark.parametrize("dims, world, message", [
    ([("tensor", 2), ("data", 2)], 8, "tensor=2 x data=2 = 4 does not equal world size 8"),
    ([("tensor", 0), ("data", 8)], 8, "'tensor' has size 0"),
    ([("data", -1)], 8, "'data' has size -1"),
    ([("data", 2), ("data", 4)], 8, "'data' is duplicated"),
    ([("", 8)], 8, "must be a non-empty string"),
    ([], 8, "parallel dims are empty"),
])
def test_bad_dims_raise_value_error_naming_the_value(dims, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout.create(dims, world)


def test_unknown_group_name_raises():
    layout = ParallelLayout.create(DIMS_8, 8)
    with pytest.raises(ValueError, match="unknown parallel group 'expert'.*tensor"):
        layout.groups("expert")


def test_bad_rank_order():
    with pytest.raises(ValueError, match="permutation of range"):
        ParallelLayout.create([("data", 2)], 2, rank_order=[0, 0])


def test_launcher_translates_fault_tolerance():
    args = translate_args(["--fault_tolerant", "--max_restarts", "1", "--nproc_per_node", "2",
                           "--master_port", "1234", "a.py", "--x"])
    assert args == ["--max_restarts=1", "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1234",
                    "--rdzv_id=atorch-1234", "--nproc_per_node", "2", "a.py", "--x"]
    # Script arguments that look like launcher options belong to the script.
    assert translate_args(["--nproc_per_node", "2", "a.py", "--max_restarts", "5"]) == \
        ["--max_restarts=0", "--nnodes=1", "--standalone", "--nproc_per_node", "2", "a.py", "--max_restarts", "5"]
    assert translate_args(["--fault_tolerant", "a.py"])[0] == "--max_restarts=3"
    assert translate_args(["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "9",
                           "a.py"]) == ["--max_restarts=0", "--nnodes=2", "--master_addr=10.0.0.1",
                                        "--master_port=9", "--node_rank", "1", "a.py"]
    with pytest.raises(ValueError, match="--max_restarts=-1"):
        translate_args(["--max_restarts", "-1", "a.py"])
