"""amp_native's pieces in one process: autocast on the instance forward, the gradient-scaling loss
transform, and GradScalingOptimizer (steps, skips on overflow, shares state, works with LR schedulers)."""

import logging
import pickle

import pytest
import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import get_optimization
from atorch.auto.opt_lib._precision import add_autocast_to_forward, has_autocast_forward
from atorch.auto.opt_lib.amp_native import GradScalingOptimizer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def test_autocast_forward_keeps_state_dict_keys_and_computes_in_bf16():
    model = _model()
    keys = list(model.state_dict())
    add_autocast_to_forward(model, "cpu", torch.bfloat16)
    assert has_autocast_forward(model) and list(model.state_dict()) == keys
    assert model(torch.randn(2, 8)).dtype is torch.bfloat16
    assert next(model.parameters()).dtype is torch.float32  # weights stay fp32
    assert not has_autocast_forward(_model())


def test_loss_transform_keeps_the_value_and_scales_the_gradient():
    w = torch.tensor([2.0], requires_grad=True)
    optim = GradScalingOptimizer(torch.optim.SGD([w], lr=0.1), torch.amp.GradScaler("cpu", init_scale=1024.0))
    loss = (w * 3.0).sum()
    scaled = optim.scale_loss(loss)
    assert scaled.item() == loss.item() == 6.0
    scaled.backward()
    assert w.grad.item() == 3.0 * 1024.0


def test_grad_scaling_optimizer_trains_exactly_like_unscaled_training():
    x = torch.randn(4, 8)
    plain, scaled = _model(), _model()
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # a power of two: exact unscaling
    optim = GradScalingOptimizer(torch.optim.SGD(scaled.parameters(), lr=0.1), scaler)
    transform = optim.scale_loss
    for _ in range(3):
        plain(x).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
        transform(scaled(x).pow(2).mean()).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b)


def test_grad_scaling_optimizer_shares_state_and_drives_lr_schedulers():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optim = GradScalingOptimizer(inner, torch.amp.GradScaler("cpu"))
    assert optim.param_groups is inner.param_groups and optim.state is inner.state
    assert optim.state_dict() == inner.state_dict()
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    for _ in range(3):
        optim.scale_loss(model(torch.randn(2, 8)).sum()).backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


def test_overflow_skips_the_step_and_backs_off_the_scale():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    optim = GradScalingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    loss = optim.scale_loss(model(torch.full((1, 8), float("inf"))).sum())
    loss.backward()
    optim.step()
    assert scaler.get_scale() == 2.0 ** 15
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="step\\(closure\\) is not supported"):
        optim.step(lambda: 0.0)


def test_step_refuses_gradients_that_were_not_scaled():
    model = _model()
    optim = GradScalingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu"))
    model(torch.randn(2, 8)).sum().backward()  # the loss bypassed result.loss_func
    with pytest.raises(RuntimeError, match="no loss was computed with result.loss_func since the last step"):
        optim.step()


def test_apply_wrapper_builds_scaling_for_fp16_only_and_respects_wrappers(caplog):
    amp = get_optimization("amp_native")()
    fp16, bf16 = amp.parse_config(torch.float16), amp.parse_config(torch.bfloat16)

    def context(**kw):
        model = _model()
        return ModelContext(model=model, optim=torch.optim.SGD(model.parameters(), lr=0.1), **kw)

    ctx = context()
    amp.apply(ctx, fp16)
    amp.apply_wrapper(ctx, fp16)
    assert ctx.autocast_dtype is torch.float16 and has_autocast_forward(ctx.model)
    assert isinstance(ctx.optim, GradScalingOptimizer) and ctx.grad_scaler is ctx.optim.scaler
    assert ctx.loss_transforms == [ctx.optim.scale_loss]
    ctx = context()
    amp.apply(ctx, bf16)
    amp.apply_wrapper(ctx, bf16)
    assert isinstance(ctx.optim, torch.optim.SGD) and ctx.grad_scaler is None and not ctx.loss_transforms
    # A sharding wrapper that owns precision and loss scaling (DeepSpeed): amp adds nothing.
    ctx = context(autocast_by_wrapper=True, loss_scaling_by_wrapper=True)
    amp.apply(ctx, fp16)
    amp.apply_wrapper(ctx, fp16)
    assert not has_autocast_forward(ctx.model) and ctx.grad_scaler is None
    # A model already cast by `half` to the same dtype needs no autocast.
    ctx = context(half_dtype=torch.bfloat16)
    amp.apply(ctx, bf16)
    with caplog.at_level(logging.INFO):
        amp.apply_wrapper(ctx, bf16)
    assert not has_autocast_forward(ctx.model)
    assert "already cast to bfloat16 by `half`" in caplog.text


def test_a_half_model_gets_its_float_inputs_in_its_dtype():
    """`half` (and DeepSpeed's half engines, tests/distributed/test_opt_parity_deepspeed.py) hold the
    weights in bf16/fp16: fp32 inputs are cast, nested ones included; ids, float64 and bools are not."""
    import collections

    from atorch.auto.opt_lib._precision import cast_float_inputs

    Pair = collections.namedtuple("Pair", "a b")
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def forward(self, x, extra=None, ids=None):
            seen.update(x=x.dtype, extra=extra, ids=ids.dtype)
            return self.linear(x)

    model = Probe().to(torch.bfloat16)
    cast_float_inputs(model, torch.bfloat16)
    extra = {"f": [torch.zeros(1)], "p": Pair(torch.zeros(1), torch.zeros(1, dtype=torch.float64))}
    out = model(torch.randn(2, 8), extra=extra, ids=torch.ones(2, dtype=torch.long))
    assert out.dtype is torch.bfloat16 and seen["x"] is torch.bfloat16 and seen["ids"] is torch.int64
    assert seen["extra"]["f"][0].dtype is torch.bfloat16 and isinstance(seen["extra"]["p"], Pair)
    assert seen["extra"]["p"].a.dtype is torch.bfloat16 and seen["extra"]["p"].b.dtype is torch.float64

    # Through the optimization itself: before, this forward raised "mat1 and mat2 must have the same dtype".
    half = get_optimization("half")()
    ctx = ModelContext(model=_model())
    half.apply(ctx, half.parse_config(torch.bfloat16))
    assert ctx.model(torch.randn(2, 8)).dtype is torch.bfloat16
    copied = pickle.loads(pickle.dumps(ctx.model))              # the hook does not stop a model from pickling
    assert copied(torch.randn(2, 8)).dtype is torch.bfloat16


def test_half_casts_floating_tensors_only_and_keeps_a_complex_rope_table():
    """A Meta-Llama-style rope table (`freqs_cis`, complex) stays complex under `half` (nn.Module.to(dtype) would
    keep only its real part); float parameters and buffers are cast, integer buffers kept."""

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("freqs_cis", torch.polar(torch.ones(3, 2), torch.rand(3, 2) + 0.5), persistent=False)
            self.register_buffer("positions", torch.arange(3))
            self.register_buffer("scale", torch.full((4,), 0.5))

        def forward(self, x):   # x: (3, 4), rotated pairwise by freqs_cis
            rotated = torch.view_as_real(torch.view_as_complex(x.float().reshape(3, 2, 2)) * self.freqs_cis)
            return self.linear(rotated.reshape(3, 4).type_as(x) * self.scale)

    torch.manual_seed(0)
    model, x = Rope(), torch.randn(3, 4)
    expected = Rope()
    expected.load_state_dict(model.state_dict())
    expected.freqs_cis.copy_(model.freqs_cis)
    expected.bfloat16()                                      # torch's own cast: floating tensors only
    half = get_optimization("half")()
    ctx = ModelContext(model=model)
    half.apply(ctx, half.parse_config(torch.bfloat16))
    assert model.freqs_cis.dtype is torch.complex64 and model.positions.dtype is torch.int64
    assert model.linear.weight.dtype is torch.bfloat16 and model.scale.dtype is torch.bfloat16
    assert torch.equal(model(x), expected(x.bfloat16()))


def test_deploy_worker_casts_an_atorch_checkpoint_model_to_floating_dtype_only(monkeypatch):
    """The deploy worker's `dtype` of a served model keeps complex buffers complex, like `half`."""
    from atorch.deploy import worker

    model = nn.Linear(2, 2)
    model.register_buffer("freqs_cis", torch.polar(torch.ones(2), torch.ones(2)))
    monkeypatch.setattr(worker, "_load_atorch_checkpoint", lambda path, verified=False: model)
    loaded = worker.load_model({"source": "atorch_checkpoint", "path": "x", "dtype": "bfloat16"}, {})
    assert loaded.weight.dtype is torch.bfloat16 and loaded.freqs_cis.dtype is torch.complex64
