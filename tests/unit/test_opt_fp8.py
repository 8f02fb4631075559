"""`fp8`: a clear ValueError naming the requirement wherever float8 training cannot run; config checks."""

import importlib.util

import pytest
import torch
from torch import nn

from atorch.auto.opt_lib import ValidationContext, get_optimization, resolve_strategy
from atorch.auto.opt_lib import fp8 as fp8_module
from atorch.auto.opt_lib.fp8 import Fp8Config, convertible_linears
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama

REQUIREMENT = (r"fp8 needs an NVIDIA GPU with compute capability >= 8\.9 \(Ada/Hopper or newer\) and torchao "
               r"installed \(pip install torchao\)")


def _validate(raw=None, device_type="cpu", model=None):
    opt = get_optimization("fp8")()
    opt.validate(opt.parse_config(raw), ValidationContext(world_size=1, model=model, device_type=device_type))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to be on a CUDA device of a chosen capability, with or without torchao."""

    def configure(capability, torchao_installed):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(fp8_module.importlib.util, "find_spec",
                            lambda name, *a: (object() if torchao_installed else None) if name == "torchao"
                            else real_find_spec(name, *a))

    return configure


def test_cpu_raises_naming_the_requirement_and_the_device():
    with pytest.raises(ValueError, match=REQUIREMENT + r"; this process has device 'cpu'$"):
        _validate()
    # The same error through strategy resolution (what auto_accelerate runs on every rank).
    model = tiny_llama()
    with pytest.raises(ValueError, match=REQUIREMENT):
        resolve_strategy(Strategy(["fp8"]), ValidationContext(world_size=1, model=model, device_type="cpu"))


def test_old_gpu_raises_naming_its_capability(fake_gpu):
    fake_gpu((8, 0), torchao_installed=True)
    with pytest.raises(ValueError, match=REQUIREMENT + r"; this GPU \(Fake GPU\) has compute capability 8\.0"):
        _validate(device_type="cuda")


def test_missing_library_raises(fake_gpu):
    fake_gpu((9, 0), torchao_installed=False)
    with pytest.raises(ValueError, match=REQUIREMENT + "; torchao is not installed"):
        _validate(device_type="cuda")


def test_supported_gpu_validates_and_refuses_a_no_op(fake_gpu):
    fake_gpu((8, 9), torchao_installed=True)
    _validate(device_type="cuda", model=tiny_llama())
    with pytest.raises(ValueError, match=r"Sequential has no nn.Linear with both dimensions divisible by 16 outside "
                                         r"skip_modules=\['lm_head'\]; fp8 would change nothing"):
        _validate(device_type="cuda", model=nn.Sequential(nn.Linear(10, 24), nn.Linear(24, 8)))


def test_config_errors_come_before_hardware_errors():
    with pytest.raises(ValueError, match=r"recipe='delayed'; valid recipes are \['tensorwise', 'rowwise', "
                                         r"'rowwise_with_gw_hp'\]"):
        _validate({"recipe": "delayed"})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['scaling'\]; valid keys are \['recipe', "
                                         r"'skip_modules'\]"):
        _validate({"scaling": "dynamic"})


def test_convertible_linears_skip_the_head_and_odd_shapes():
    names = convertible_linears(tiny_llama(num_hidden_layers=1), Fp8Config())
    assert "lm_head" not in names
    assert sorted(n.rsplit(".", 1)[-1] for n in names) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert convertible_linears(tiny_llama(num_hidden_layers=1), Fp8Config(skip_modules="q_proj")).count(
        "lm_head") == 1
