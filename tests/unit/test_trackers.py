"""MetricsLogger: TensorBoard event files and JSON lines that read back with the logged values."""

import json

import pytest

from atorch.utils.metrics import StepMetrics
from atorch.utils.trackers import MetricsLogger, parse_log_with


def test_tensorboard_and_jsonl_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), log_with="tensorboard,jsonl", enabled=True) as logger:
        for step in (1, 2, 3):
            logger.log(StepMetrics(step=step, loss=4.0 - step, step_s=0.5, samples_s=8.0, tokens_s_per_device=64.0,
                                   tflops_model=0.01, tflops_hw=0.02, mfu=0.1, hfu=0.2, peak_mem_mb=100.0), step)
        logger.log({"lr": 1e-3, "note": "skipped", "nan": float("nan")}, 3)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert events.Scalars("train/lr")[0].value == pytest.approx(1e-3)
    assert "train/note" not in events.Tags()["scalars"] and "train/nan" not in events.Tags()["scalars"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["loss"] == 3.0 and lines[0]["mfu"] == 0.1
    assert lines[-1] == {"step": 3, "lr": 1e-3}


def test_other_ranks_and_bad_names(tmp_path):
    quiet = MetricsLogger(str(tmp_path / "r1"), log_with="jsonl", enabled=False)
    quiet.log({"loss": 1.0}, 1)
    quiet.close()
    assert not (tmp_path / "r1").exists()
    assert parse_log_with(None) == [] and parse_log_with("none") == []
    assert parse_log_with(["jsonl", "tensorboard", "jsonl"]) == ["jsonl", "tensorboard"]
    with pytest.raises(ValueError, match=r"log_with='wandb': unknown tracker\(s\) \['wandb'\]"):
        parse_log_with("wandb")
