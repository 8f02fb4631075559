"""train_step on engines that run their own step (deepspeed_3d_parallel), with stand-in engines: clipping set per
call, and the one row-counting / micro-batch splitting that train_step and DeepSpeed 3D's step share."""

import types

import pytest
import torch

from atorch.auto.result import AutoAccelerateResult
from atorch.auto.train_step import split_batch, train_step_stats


class FakeEngine:
    """What train_step touches of a DeepSpeed pipeline engine: its clipping settings, norm and train_batch."""

    def __init__(self):
        self._config = types.SimpleNamespace(gradient_clipping=0.0)
        self.optimizer = types.SimpleNamespace(clip_grad=0.0)
        self.micro_batches = []

    def get_global_grad_norm(self):
        return 2.0

    def train_batch(self, batches):
        self.micro_batches = list(batches)
        return torch.tensor(0.5)


def _result(engine, custom_step, gas=1, micro=None):
    return AutoAccelerateResult(model=engine, optim=None, dataloader=None, loss_func=lambda b, o: o,
                                prepare_input=lambda b, d=None: b, engine=engine, custom_train_step=custom_step,
                                gradient_accumulation_steps=gas, micro_batch_size=micro)


def test_custom_step_clipping_is_set_at_every_call():
    engine = FakeEngine()
    result = _result(engine, lambda r, b: r.engine.train_batch(iter([b])))
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    stats = train_step_stats(result, batch, max_grad_norm=1.0)
    assert (engine._config.gradient_clipping, engine.optimizer.clip_grad) == (1.0, 1.0)
    assert float(stats.grad_norm) == 2.0
    # A later call without max_grad_norm does not clip: the engine's clipping is turned off again.
    stats = train_step_stats(result, batch)
    assert (engine._config.gradient_clipping, engine.optimizer.clip_grad) == (0.0, 0.0)
    assert stats.grad_norm is None
    # ... or goes back to the clipping its ds_config asked for (DeepSpeed 3D keeps a user's).
    result.deepspeed_config = {"gradient_clipping": 0.5}
    train_step_stats(result, batch, max_grad_norm=1.0)
    train_step_stats(result, batch)
    assert (engine._config.gradient_clipping, engine.optimizer.clip_grad) == (0.5, 0.5)


def test_deepspeed_3d_step_splits_batches_with_train_steps_rows():
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import ds3d_train_step
    from atorch.modules.pipeline.batches import batch_rows, find_batch_rows, split_micro_batches

    engine = FakeEngine()
    result = _result(engine, ds3d_train_step, gas=2, micro=2)
    ids = torch.arange(8).reshape(4, 2)
    # A non-tensor first value (a tag) and a per-batch scalar: counted and split as train_step does.
    batch = {"tag": "doc", "input_ids": ids, "labels": ids + 1, "scale": torch.tensor(2.0)}
    assert find_batch_rows(batch) == batch_rows(batch) == 4
    train_step_stats(result, batch)
    assert [m["input_ids"].tolist() for m in engine.micro_batches] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(m["tag"] == "doc" and float(m["scale"]) == 2.0 for m in engine.micro_batches)
    with pytest.raises(ValueError, match="deepspeed_3d_parallel train_step: a batch without tensors, but one step "
                                         r"takes train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2"):
        train_step_stats(result, {"tag": "doc"})
    assert find_batch_rows({"tag": "doc"}) is None
    with pytest.raises(ValueError, match="a batch of dict holds no tensor with rows"):
        batch_rows({"tag": "doc"})
    with pytest.raises(ValueError, match="a batch of 4 rows does not split into 3 equal micro-batches"):
        split_micro_batches(batch, 3)
    # train_step's own splitting is the same: nested sequences too, with its own messages.
    a, b = split_batch((ids, [ids, "x"]), 2)
    assert a[0].tolist() == [[0, 1], [2, 3]] and b[1][1] == "x"
