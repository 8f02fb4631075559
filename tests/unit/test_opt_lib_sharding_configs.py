"""Configs, conflicts and ordering of amp_native, half, fsdp, zero1, zero2, ddp: pure validation, no processes."""

import pytest
import torch
from torch import nn

from atorch.auto import Strategy
from atorch.auto.opt_lib import ValidationContext, get_optimization, resolve_strategy


def resolve(items, world_size=2, device_type="cpu", model=None):
    return resolve_strategy(Strategy(items), ValidationContext(world_size=world_size, device_type=device_type,
                                                                model=model))


def names(items, **kw):
    return [r.name for r in resolve(items, **kw)]


@pytest.mark.parametrize("pair", [("zero1", "zero2"), ("zero2", "fsdp"), ("zero1", "fsdp"), ("ddp", "fsdp"),
                                  ("ddp", "zero2")])
def test_conflicting_pairs_name_both(pair):
    first, second = sorted(pair)
    with pytest.raises(ValueError, match=f"'{first}' and '{second}' cannot be combined"):
        resolve(list(pair))
    with pytest.raises(ValueError, match=f"'{first}' and '{second}' cannot be combined"):
        resolve(list(reversed(pair)))


def test_half_and_amp_of_different_dtypes_conflict():
    with pytest.raises(ValueError, match=r"'half' \(dtype=float16\) and 'amp_native' \(dtype=bfloat16\) cannot be "
                                         r"combined"):
        resolve([("half", {"dtype": torch.float16}), ("amp_native", {"dtype": torch.bfloat16})])


def test_same_dtype_half_and_amp_is_accepted():
    # Harmless redundancy: amp_native skips autocast on the cast model (tests/unit/test_opt_lib_amp.py).
    assert names([("amp_native", "bf16"), "half"]) == ["parallel_mode", "half", "amp_native", "ddp"]


def test_application_order_is_fixed_whatever_the_listed_order():
    assert names(["ddp", "zero1", ("amp_native", torch.bfloat16), "parallel_mode"]) == [
        "parallel_mode", "amp_native", "zero1", "ddp"]
    assert names(["fsdp", "checkpoint", "half", "module_replace"], model=_tiny_llama()) == [
        "parallel_mode", "module_replace", "checkpoint", "half", "fsdp"]


def _tiny_llama():
    from atorch.testing import tiny_llama

    return tiny_llama()


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"fsdp: unknown config key\(s\) \['cpu_ofload'\]; valid keys are "
                                         r"\['wrap_cls', 'cpu_offload', 'sync_module_states', 'use_ds_zero', 'ds_config'\]"):
        resolve([("fsdp", {"cpu_ofload": True})])
    with pytest.raises(ValueError, match=r"zero1: unknown config key\(s\) \['stage'\]; valid keys are "
                                         r"\['use_ds_zero', 'ds_config'\]"):
        resolve([("zero1", {"stage": 1})])
    with pytest.raises(ValueError, match=r"amp_native: unknown config key\(s\) \['dtpye'\]; valid keys are "
                                         r"\['dtype'\]"):
        resolve([("amp_native", {"dtpye": torch.float16})])


@pytest.mark.parametrize("item, message", [
    (("fsdp", {"cpu_offload": "yes"}), "fsdp: cpu_offload='yes' must be True or False"),
    (("zero2", {"use_ds_zero": 1}), "zero2: use_ds_zero=1 must be True or False"),
    (("fsdp", {"wrap_cls": []}), r"fsdp: wrap_cls=\[\] must be None"),
    (("fsdp", {"wrap_cls": [42]}), "fsdp: wrap_cls entry 42 must be an nn.Module subclass"),
    (("zero2", [1, 2]), r"zero2: config \[1, 2\] must be None, a dict with keys"),
    (("amp_native", {"dtype": torch.float32}), r"amp_native: dtype=torch.float32 is not supported; use "
                                               r"torch.bfloat16 or torch.float16"),
    (("half", "fp8"), "half: dtype='fp8' is not supported"),
    (("ddp", {"bucket_cap_mb": -1}), "ddp: bucket_cap_mb=-1 must be a positive number or None"),
    (("ddp", {"find_unused_parameters": None}), "ddp: find_unused_parameters=None must be True or False"),
])
def test_malformed_configs_raise_with_the_value(item, message):
    with pytest.raises(ValueError, match=message):
        resolve([item])


def test_dtype_spellings_and_json_round_trip():
    cls = get_optimization("amp_native")
    for raw in (torch.float16, "fp16", "float16", "torch.float16", {"dtype": "half"}):
        assert cls.parse_config(raw).dtype is torch.float16
    s = Strategy([("amp_native", {"dtype": torch.float16}), ("fsdp", {"wrap_cls": [nn.Linear], "cpu_offload": True})])
    back = Strategy.from_json(s.to_json())
    resolved = {r.name: r.config for r in resolve(list(back))}
    assert resolved["amp_native"].dtype is torch.float16
    assert resolved["fsdp"].wrap_cls == (nn.Linear,) and resolved["fsdp"].cpu_offload is True


def test_wrap_cls_names_must_exist_in_the_model_when_applied():
    from atorch.utils.module_utils import resolve_module_classes

    cfg = get_optimization("fsdp").parse_config({"wrap_cls": "LlamaDecoderLayer"})
    assert cfg.wrap_cls == ("LlamaDecoderLayer",)
    with pytest.raises(ValueError, match=r"'GPT2Block' is not in the model; its module classes are "
                                         r"\[.*LlamaDecoderLayer"):
        resolve_module_classes(_tiny_llama(), ["GPT2Block"], "fsdp: wrap_cls")


def test_deepspeed_limits_are_checked_before_anything_runs():
    tp = ("parallel_mode", ([("tensor", 2), ("data", 2)], None))
    with pytest.raises(ValueError, match=r"zero2 with use_ds_zero=True needs every rank data-parallel, but "
                                         r"parallel_mode has \{'tensor': 2\}"):
        resolve([tp, ("zero2", {"use_ds_zero": True})], world_size=4)
    with pytest.raises(ValueError, match=r"'ddp' and 'zero1' cannot be combined: the DeepSpeed engine \(use_ds_zero=True\)"):
        resolve(["ddp", ("zero1", {"use_ds_zero": True})])
    with pytest.raises(ValueError, match=r"'fsdp' and 'half' cannot be combined: DeepSpeed keeps fp32 master weights"):
        resolve(["half", ("fsdp", {"use_ds_zero": True})])
    with pytest.raises(ValueError, match=r"amp_native\(dtype=float16\) with zero1 \(use_ds_zero=True\) is not "
                                         r"supported on CPU"):
        resolve([("amp_native", torch.float16), ("zero1", {"use_ds_zero": True})])
    with pytest.raises(ValueError, match="cpu_offload=True with use_ds_zero=True is not what offloads DeepSpeed; put"):
        resolve([("fsdp", {"use_ds_zero": True, "cpu_offload": True})])
    with pytest.raises(ValueError, match=r"zero2: wrap_cls=\['LlamaDecoderLayer'\] applies to torch FSDP2 only"):
        resolve([("zero2", {"use_ds_zero": True, "wrap_cls": "LlamaDecoderLayer"})])
    # fp16 DeepSpeed is fine where DeepSpeed has fp16 (GPUs); torch zero1 with ddp is fine anywhere.
    assert names([("amp_native", torch.float16), ("zero1", {"use_ds_zero": True})], device_type="cuda")[-1] == "zero1"
    assert names(["ddp", "zero1"]) == ["parallel_mode", "zero1", "ddp"]


@pytest.mark.parametrize("name", ["fsdp", "zero2", "checkpoint", "compile"])
def test_wrap_cls_is_parsed_alike_by_every_optimization_that_takes_it(name):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cls = get_optimization(name)
    parse = cls.parse_config
    assert parse({"wrap_cls": LlamaDecoderLayer}).wrap_cls == (LlamaDecoderLayer,)
    assert parse({"wrap_cls": "LlamaDecoderLayer"}).wrap_cls == ("LlamaDecoderLayer",)
    assert parse({"wrap_cls": ["B", LlamaDecoderLayer]}).wrap_cls == ("B", LlamaDecoderLayer)
    # ATorch's configs give sets: a sorted tuple, the same whatever the set's iteration order.
    both = parse({"wrap_cls": {LlamaDecoderLayer, GPT2Block}}).wrap_cls
    assert both == (GPT2Block, LlamaDecoderLayer) == parse({"wrap_cls": frozenset(both)}).wrap_cls
    for bad, shown in (([5], "entry 5 "), ((LlamaDecoderLayer, nn.Linear(2, 2)), "entry Linear"), ({5}, "entry 5 "),
                       ([int], "entry <class 'int'>"), ([], r"wrap_cls=\[\]"), (5, "wrap_cls=5")):
        with pytest.raises(ValueError, match=f"^{name}: wrap_cls {shown}|^{name}: {shown}"):
            parse({"wrap_cls": bad})
