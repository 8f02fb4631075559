"""The spawn helper forks ranks from its preloading forkserver only when that cannot change what a rank sees."""

from atorch.testing.spawn import _start_method

SERVER = {"PATH": "/bin", "DS_ACCELERATOR": "cpu", "PYTEST_CURRENT_TEST": "a (setup)"}


def test_forks_when_only_variables_no_preloaded_library_reads_differ():
    child = {**SERVER, "PYTEST_CURRENT_TEST": "b (call)", "ATORCH_COLLECTIVE_TIMEOUT": "5", "MAX_PATIENCE": "4",
             "RANK": "1", "MASTER_PORT": "2345"}
    assert _start_method(SERVER, child, cuda=False) == "forkserver"
    assert _start_method(SERVER, dict(SERVER), cuda=False) == "forkserver"


def test_spawns_when_a_variable_read_at_import_differs_or_without_a_server_or_with_cuda():
    assert _start_method(SERVER, {**SERVER, "DS_ACCELERATOR": "cuda"}, cuda=False) == "spawn"
    assert _start_method(SERVER, {**SERVER, "HF_HUB_OFFLINE": "0"}, cuda=False) == "spawn"     # added
    assert _start_method(SERVER, {"PATH": "/bin", "PYTEST_CURRENT_TEST": "x"}, cuda=False) == "spawn"   # removed
    assert _start_method(None, dict(SERVER), cuda=False) == "spawn"
    assert _start_method(SERVER, dict(SERVER), cuda=True) == "spawn"
