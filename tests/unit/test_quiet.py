"""Quiet by default: levels per rank, ATORCH_LOG_LEVEL, and third-party warnings filtered only inside atorch."""

import logging
import warnings

import pytest

from atorch.utils.quiet import configure_logging, log_level, third_party_warnings_filtered


def test_levels(monkeypatch):
    monkeypatch.delenv("ATORCH_LOG_LEVEL", raising=False)
    assert log_level(0) == logging.INFO and log_level(1) == logging.WARNING
    monkeypatch.setenv("ATORCH_LOG_LEVEL", "debug")
    assert log_level(3) == logging.DEBUG
    assert configure_logging(3).level == logging.DEBUG
    monkeypatch.setenv("ATORCH_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="ATORCH_LOG_LEVEL='chatty' must be one of"):
        log_level(0)


def _warn(module: str) -> None:
    warnings.warn_explicit("internal API is deprecated", FutureWarning, filename=f"{module}.py", lineno=1,
                           module=module)


def test_third_party_warnings_are_hidden_inside_only():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_warnings_filtered():
            _warn("deepspeed.runtime.engine")
            _warn("transformers.modeling_utils")
            _warn("my_training_script")           # the user's own: kept
        _warn("deepspeed.runtime.engine")         # outside atorch's calls: kept
    assert [w.filename for w in seen] == ["my_training_script.py", "deepspeed.runtime.engine.py"]


def test_candidate_logs_are_quieted_during_a_dry_run_unless_asked_for(monkeypatch):
    """A search builds a candidate per dry run; its optimizations' INFO lines stay out (the dry run logs one)."""
    from atorch.utils.quiet import candidate_logs_quieted

    logger = logging.getLogger("atorch")
    child = logging.getLogger("atorch.auto.opt_lib.activation_checkpoint")
    previous = logger.level
    try:
        monkeypatch.delenv("ATORCH_LOG_LEVEL", raising=False)
        logger.setLevel(logging.INFO)
        with candidate_logs_quieted():
            assert not child.isEnabledFor(logging.INFO) and child.isEnabledFor(logging.WARNING)
        assert child.isEnabledFor(logging.INFO) and logger.level == logging.INFO
        monkeypatch.setenv("ATORCH_LOG_LEVEL", "INFO")   # the user asked for everything: nothing hidden
        with candidate_logs_quieted():
            assert child.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(previous)
