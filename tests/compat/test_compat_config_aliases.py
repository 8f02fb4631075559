"""ATorch's strategy config spellings map onto atorch's typed configs, or fail naming what to use instead.

From ATorch's optimization library (dlrover bfd04ef1, `atorch/auto/opt_lib`): fsdp takes FSDP1
keyword arguments plus `atorch_wrap_cls`; checkpoint takes `wrap_class`/`no_reentrant` or the
block classes themselves; amp_native `{"enabled": True, "dtype": ...}`; half a "bf16"/"fp16"
string; parallel_mode a `(dims, rank_order, multi_instance)` 3-tuple. Pure parsing: milliseconds.
"""

import pytest
import torch
from torch import nn

from atorch.auto.opt_lib import get_optimization
from atorch.auto.opt_lib.base import ConfigAlias, Optimization


class Block(nn.Module):
    pass


def parse(name, raw):
    return get_optimization(name).parse_config(raw)


def test_fsdp_and_zero2_accept_atorch_fsdp_keys():
    for name in ("fsdp", "zero2"):
        cfg = parse(name, {"atorch_wrap_cls": (Block,), "limit_all_gathers": True, "use_orig_params": True,
                           "forward_prefetch": False, "sync_module_states": True, "cpu_offload": True})
        assert (cfg.wrap_cls, cfg.sync_module_states, cfg.cpu_offload) == ((Block,), True, True)
        assert parse(name, {"atorch_wrap_cls": "Block"}).wrap_cls == ("Block",)


@pytest.mark.parametrize("key, value, hint", [
    ("auto_wrap_policy", lambda *a: True, r"pass wrap_cls \(or atorch_wrap_cls\)"),
    ("use_orig_params", False, "FSDP2 always keeps the original parameters"),
    ("limit_all_gathers", False, "as limit_all_gathers=True"),
    ("forward_prefetch", True, "set_modules_to_forward_prefetch"),
])
def test_fsdp_options_fsdp2_cannot_honour_raise_with_the_alternative(key, value, hint):
    with pytest.raises(ValueError, match=rf"fsdp: {key}=.* is not supported: .*{hint}"):
        parse("fsdp", {key: value})


def test_alias_and_own_key_with_different_values_is_an_error():
    with pytest.raises(ValueError, match="'atorch_wrap_cls' .* and 'wrap_cls' are both given"):
        parse("fsdp", {"atorch_wrap_cls": ["A"], "wrap_cls": ["B"]})
    assert parse("fsdp", {"atorch_wrap_cls": ("A",), "wrap_cls": ("A",)}).wrap_cls == ("A",)


def test_checkpoint_forms():
    assert parse("checkpoint", Block).wrap_cls == (Block,)
    assert parse("checkpoint", (Block, "Other")).wrap_cls == (Block, "Other")
    assert parse("checkpoint", {"wrap_class": Block, "no_reentrant": True}).wrap_cls == (Block,)
    with pytest.raises(ValueError, match="checkpoint: no_reentrant=False is not supported: atorch always"):
        parse("checkpoint", {"wrap_class": Block, "no_reentrant": False})


def test_zero_options():
    assert parse("zero1", {"cpu_offload": False}).use_ds_zero is False
    with pytest.raises(ValueError, match="zero1: cpu_offload=True is not supported: .*fsdp/zero2 with cpu_offload=True"):
        parse("zero1", {"cpu_offload": True})
    for name in ("zero1", "zero2"):
        with pytest.raises(ValueError, match=rf"{name}: static_loss_scale=1.0 is not supported: .*amp_native"):
            parse(name, {"static_loss_scale": 1.0})
    assert parse("zero2", {"cpu_offload": True}).cpu_offload is True


def test_precision_forms():
    assert parse("amp_native", {"enabled": True, "dtype": torch.float16}).dtype is torch.float16
    assert parse("amp_native", {"dtype": "bf16"}).dtype is torch.bfloat16
    assert parse("amp_native", "fp16").dtype is torch.float16
    with pytest.raises(ValueError, match="amp_native: enabled=False is not supported: .*leave amp_native out"):
        parse("amp_native", {"enabled": False})
    assert parse("half", "bf16").dtype is torch.bfloat16
    assert parse("half", "fp16").dtype is torch.float16
    with pytest.raises(ValueError, match="half: dtype='fp8' is not supported"):
        parse("half", "fp8")


def test_parallel_mode_three_tuple():
    cfg = parse("parallel_mode", ([("tensor", 2), ("data", 2)], None, False))
    assert cfg.dims == (("tensor", 2), ("data", 2)) and cfg.rank_order is None
    with pytest.raises(ValueError, match="multi_instance=True .* is not supported in a strategy"):
        parse("parallel_mode", ([("data", 2)], None, True))


def test_the_hook_is_declared_per_class():
    """A new optimization gets aliases by declaring them; nothing else lists names."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        size: int = 1

    class Toy(Optimization):
        name = "toy"
        Config = Cfg
        config_aliases = {"old_size": ConfigAlias(to="size"), "legacy": ConfigAlias(instead="drop it")}

    assert Toy.parse_config({"old_size": 4}) == Cfg(4)
    with pytest.raises(ValueError, match="toy: legacy=1 is not supported: drop it"):
        Toy.parse_config({"legacy": 1})
    with pytest.raises(ValueError, match=r"toy: unknown config key\(s\) \['other'\]"):
        Toy.parse_config({"other": 1})
