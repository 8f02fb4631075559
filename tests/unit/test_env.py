"""The one environment reader: typed values and errors that name the variable."""

import pytest

from atorch.utils.env import env_bool, env_float, env_int, env_str


def test_values_defaults_and_errors():
    env = {"A": "3", "B": "1e3", "C": "", "D": "x", "E": "2.5", "F": "yes", "G": "off", "H": " 7 "}
    assert env_int("A", 1, env) == 3 and env_int("B", 1, env) == 1000 and env_int("H", 1, env) == 7
    assert env_int("C", 5, env) == 5 and env_int("MISSING", None, env) is None
    assert env_float("E", 0.0, env) == 2.5 and env_str("D", None, env) == "x" and env_str("C", "d", env) == "d"
    assert env_bool("F", False, env) is True and env_bool("G", True, env) is False and env_bool("Z", True, env)
    with pytest.raises(ValueError, match=r"environment variable D='x' must be an integer"):
        env_int("D", 1, env)
    with pytest.raises(ValueError, match=r"environment variable E='2.5' must be an integer"):
        env_int("E", 1, env)
    with pytest.raises(ValueError, match=r"environment variable D='x' must be a number"):
        env_float("D", 1.0, env)
    with pytest.raises(ValueError, match=r"environment variable A=3 must be >= 4"):
        env_int("A", 1, env, minimum=4)
    with pytest.raises(ValueError, match=r"environment variable D='x' must be one of"):
        env_bool("D", False, env)
