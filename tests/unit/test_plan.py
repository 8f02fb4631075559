"""The stack a strategy builds, printed: every optimization's place in the apply and wrapper phases.

`plan()` is what a reader checks instead of following sort keys and flags; these tests pin it
for every registered optimization, so a new one must state where it goes.
"""

import pytest
import torch

from atorch.auto.opt_lib.base import Optimization, get_optimization, registered_names
from atorch.auto.opt_lib.resolve import ResolvedOptimization, plan, plan_steps
from atorch.auto.strategy import Strategy, StrategyItem

# Each optimization alone (with what it needs), as the stack it builds. Validation is skipped
# here (fp8 needs a GPU); `test_plans_of_valid_strategies` below goes through validation.
EXPECTED = {
    "amp_native": (["amp_native"], "amp_native(bfloat16) -> optimizer -> amp_native(bfloat16)"),
    "checkpoint": (["checkpoint"], "checkpoint -> optimizer"),
    "compile": (["checkpoint", "compile", "fsdp"], "checkpoint -> compile(block) -> fsdp(torch FSDP2, reshard) -> optimizer"),
    "ddp": (["ddp"], "optimizer -> ddp"),
    "deepspeed_3d_parallel": (["parallel_mode", "deepspeed_3d_parallel"],
                              "parallel_mode -> deepspeed_3d_parallel -> optimizer -> deepspeed_3d_parallel"),
    "fp8": (["fp8"], "fp8 -> optimizer"),
    "fsdp": (["fsdp"], "fsdp(torch FSDP2, reshard) -> optimizer"),
    "half": (["half"], "half(bfloat16) -> optimizer"),
    "lora": (["lora"], "lora -> optimizer"),
    "module_replace": (["module_replace"], "module_replace -> optimizer"),
    "parallel_mode": (["parallel_mode"], "parallel_mode -> optimizer"),
    "pipeline_parallel": (["parallel_mode", "pipeline_parallel"],
                          "parallel_mode -> pipeline_parallel(gpipe) -> optimizer -> pipeline_parallel(gpipe)"),
    "tensor_parallel": (["parallel_mode", "tensor_parallel"], "parallel_mode -> tensor_parallel -> optimizer"),
    "zero1": (["zero1"], "zero1(torch ZeroRedundancyOptimizer) -> optimizer"),
    "zero2": (["zero2"], "zero2(torch FSDP2, no reshard) -> optimizer"),
}


def _unvalidated_plan(names):
    resolved = []
    for name in names:
        cls = get_optimization(name)
        resolved.append(ResolvedOptimization(cls(), cls.parse_config(None), StrategyItem(name)))
    return " -> ".join(plan_steps(sorted(resolved, key=lambda r: type(r.optimization).order)))


def test_every_registered_optimization_has_a_pinned_plan():
    assert sorted(EXPECTED) == registered_names(), "add the new optimization's plan to EXPECTED"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_optimization_takes_its_declared_place(name):
    names, expected = EXPECTED[name]
    assert _unvalidated_plan(names) == expected


@pytest.mark.parametrize("name", registered_names())
def test_wrapper_order_is_declared_exactly_when_there_is_a_wrapper(name):
    cls = get_optimization(name)
    overrides = cls.apply_wrapper is not Optimization.apply_wrapper
    assert overrides == (cls.wrapper_order is not None), (
        f"{name}: a class with apply_wrapper declares wrapper_order, and only such a class")


def test_plans_of_valid_strategies():
    # DDP is added when two data ranks would otherwise not average gradients, and runs last.
    assert plan(Strategy(["checkpoint", "amp_native"]), world_size=2) == (
        "parallel_mode -> checkpoint -> amp_native(bfloat16) -> optimizer -> amp_native(bfloat16) -> ddp")
    # FSDP2 reduces gradients itself: no DDP; its mixed precision replaces autocast at apply time.
    assert plan(Strategy(["fsdp", "checkpoint", "module_replace", ("amp_native", torch.bfloat16)]),
                world_size=4) == ("parallel_mode -> module_replace -> checkpoint -> amp_native(bfloat16) -> "
                                  "fsdp(torch FSDP2, reshard) -> optimizer -> amp_native(bfloat16)")
    # A DeepSpeed engine is built after the optimizer, before any precision wrapper.
    assert plan(Strategy([("zero2", {"use_ds_zero": True}), "amp_native"]), world_size=2) == (
        "parallel_mode -> amp_native(bfloat16) -> zero2(deepspeed stage 2) -> optimizer -> "
        "zero2(deepspeed stage 2) -> amp_native(bfloat16)")
    assert plan(Strategy([("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel"]),
                world_size=4) == "parallel_mode(tensor=2,data=2) -> tensor_parallel -> optimizer -> ddp"
    assert plan(Strategy([]), world_size=1) == "parallel_mode -> optimizer"


def test_allow_lists_refuse_untested_partners():
    layout = ("parallel_mode", ([("data", 2), ("pipeline", 2)], None))
    with pytest.raises(ValueError, match=r"'pipeline_parallel' combines only with \["):
        plan(Strategy([layout, "pipeline_parallel", "zero1"]), world_size=4)
    # An allowed partner is accepted.
    assert "checkpoint" in plan(Strategy([layout, "pipeline_parallel", "checkpoint"]), world_size=4)
