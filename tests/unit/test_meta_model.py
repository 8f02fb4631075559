"""record_module_init / build_recorded_module / materialize_module, in one process (no groups)."""

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from atorch.testing import tiny_gpt2_config, tiny_llama_config
from atorch.utils.meta_model_utils import (
    build_recorded_module,
    init_record,
    is_meta_module,
    is_recorded,
    materialize_module,
    record_module_init,
)

MODELS = [(LlamaForCausalLM, tiny_llama_config), (GPT2LMHeadModel, lambda: tiny_gpt2_config(n_layer=3))]


@pytest.mark.parametrize("cls,config_fn", MODELS, ids=["llama", "gpt2"])
def test_recorded_build_equals_seeded_construction(cls, config_fn):
    config = config_fn()
    before = torch.get_rng_state()
    with record_module_init():
        meta = cls(config)
    assert is_meta_module(meta) and all(p.is_meta for p in meta.parameters())
    assert torch.equal(before, torch.get_rng_state()), "recording must not draw random numbers"
    assert init_record(meta).cls is cls and is_recorded(meta.get_submodule(next(n for n, _ in meta.named_modules()
                                                                                if n)))

    torch.manual_seed(99)  # the caller's stream must survive a seeded build
    caller_state = torch.get_rng_state()
    real = build_recorded_module(meta, seed=7)
    assert torch.equal(caller_state, torch.get_rng_state())
    torch.manual_seed(7)
    expected = cls(config)
    assert list(real.state_dict()) == list(expected.state_dict())
    for key, value in expected.state_dict().items():
        assert torch.equal(real.state_dict()[key], value), key
    for name, buf in expected.named_buffers():  # non-persistent buffers (rotary inv_freq) too
        assert torch.equal(real.get_buffer(name), buf), name
    assert not is_meta_module(real) and is_meta_module(meta)  # the meta model is left as it was


def test_unseeded_build_draws_from_the_callers_stream():
    with record_module_init():
        meta = nn.Linear(4, 3)
    torch.manual_seed(3)
    real = build_recorded_module(meta)
    torch.manual_seed(3)
    assert torch.equal(real.weight, nn.Linear(4, 3).weight)


def test_modules_defined_inside_the_block_keep_working():
    init_of_linear = nn.Linear.__init__
    with record_module_init():
        class Inner(nn.Module):
            def __init__(self, width: int, *, bias: bool = True):
                super().__init__()
                self.proj = nn.Linear(width, width, bias=bias)

            def forward(self, x):
                return self.proj(x)

        class Child(Inner):  # no __init__ of its own: the recorded args are Inner's
            pass

        inside = Child(5, bias=False)
        assert inside.proj.weight.is_meta
        record = init_record(inside)
        assert record.cls is Child and record.args == (5,) and record.kwargs == {"bias": False}
        assert init_record(inside.proj).args == (5, 5) and init_record(inside.proj).kwargs == {"bias": False}
    assert nn.Linear.__init__ is init_of_linear, "patched __init__ must be restored"
    assert "__init_subclass__" not in nn.Module.__dict__
    after = Child(5)  # classes defined inside the block construct normally afterwards
    assert not after.proj.weight.is_meta and init_record(after) is None
    assert after(torch.ones(2, 5)).shape == (2, 5)
    torch.manual_seed(1)
    real = build_recorded_module(inside, seed=1)
    assert real.proj.bias is None and not real.proj.weight.is_meta


def _sets_config_after_init(cls):
    """A class decorator wrapping __init__ as transformers' `use_experts_implementation` does."""
    original = cls.__init__

    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        self.config = config

    cls.__init__ = __init__
    return cls


def test_an_init_a_decorator_wrapped_inside_the_block_keeps_the_decorator():
    # transformers imports a model's module lazily, so its experts class can be defined (and decorated)
    # inside the block: the block's exit once put back the undecorated __init__ and the experts built
    # afterwards (materialization, DeepSpeed 3D's stages) had no `config`.
    with record_module_init():
        @_sets_config_after_init
        class Experts(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.weight = nn.Parameter(torch.empty(config, 4))

        meta = Experts(3)
        assert meta.config == 3 and meta.weight.is_meta and init_record(meta).args == (3,)
    assert Experts(2).config == 2
    assert build_recorded_module(meta, seed=0).config == 3
    with record_module_init():   # recorded again in a second block
        again = Experts(5)
    assert again.config == 5 and init_record(again).args == (5,) and Experts(1).config == 1


def test_patches_restored_when_the_block_raises_and_blocks_nest():
    init_of_module = nn.Module.__init__
    with pytest.raises(RuntimeError, match="boom"):
        with record_module_init():
            with record_module_init():
                nested = nn.Linear(2, 2)
            still = nn.Linear(2, 2)
            assert nested.weight.is_meta and still.weight.is_meta and is_recorded(still)
            raise RuntimeError("boom")
    assert nn.Module.__init__ is init_of_module
    assert not nn.Linear(2, 2).weight.is_meta


def test_build_errors_name_the_problem():
    with pytest.raises(ValueError, match="was not built under record_module_init"):
        build_recorded_module(nn.Linear(2, 2))
    with record_module_init():
        meta = nn.Sequential(nn.Linear(2, 2))
    meta.append(nn.Linear(2, 2))  # changed after recording: replaying would not give this module
    with pytest.raises(ValueError, match="was changed after it was recorded"):
        build_recorded_module(meta)


def test_per_block_materialization_bounded_and_tied():
    config = tiny_gpt2_config(n_layer=2)
    with record_module_init():
        meta = GPT2LMHeadModel(config)
    built = []

    def transform(prefix, real, meta_piece):
        built.append((prefix, sum(p.numel() for p in real.parameters())))
        assert meta_piece is meta.get_submodule(prefix) if prefix else meta_piece is meta
        return real

    model = materialize_module(meta, 5, transform=transform, per_block=True, block_classes=(GPT2Block,))
    names = [p for p, _ in built]
    assert "transformer.h.0" in names and "transformer.h.1" in names and "transformer.wte" in names
    # No piece larger than one block is ever built at full size.
    block = sum(p.numel() for p in meta.transformer.h[0].parameters())
    assert max(n for p, n in built if p != "lm_head" and p != "transformer.wte") <= block
    assert not is_meta_module(model) and is_meta_module(meta)
    assert model.lm_head.weight is model.transformer.wte.weight
    # HF's init rules were applied per block: c_proj is scaled by 1/sqrt(2 * n_layer).
    c_proj_std = model.transformer.h[0].attn.c_proj.weight.std().item()
    c_attn_std = model.transformer.h[0].attn.c_attn.weight.std().item()
    assert abs(c_attn_std - 0.02) < 0.004 and abs(c_proj_std - 0.02 / 2) < 0.003, (c_attn_std, c_proj_std)
    again = materialize_module(meta, 5, per_block=True, block_classes=(GPT2Block,))
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    ids = torch.randint(0, 1024, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
