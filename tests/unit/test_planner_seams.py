"""Seams of the planner: one reader of parallel_mode's config, the docstring examples of `plan`, and
the cost model's comments whole (each next to what it describes)."""

import ast
import inspect
import re

import pytest

from atorch.auto.calibration import option_keys
from atorch.auto.cost_model import StrategyTraits, activations, memory, predict, shape, step_time, traits
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.parallel_mode import ParallelModeConfig, ParallelModeOptimization
from atorch.auto.opt_lib.resolve import plan, plan_steps
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama_config


def test_every_reader_of_a_parallel_mode_config_uses_its_own_parser(monkeypatch):
    # A form only parallel_mode's parse_config knows ("tensor=2,data=2"): the cost model's layout, the
    # refit's option keys and resolve's data-parallel size must all see what it parses to.
    original = ParallelModeOptimization.parse_config.__func__

    def parse_config(cls, raw):
        if isinstance(raw, str):
            return ParallelModeConfig(tuple((n, int(s)) for n, s in (d.split("=") for d in raw.split(","))))
        return original(cls, raw)

    monkeypatch.setattr(ParallelModeOptimization, "parse_config", classmethod(parse_config))
    s = Strategy([("parallel_mode", "tensor=2,data=2"), "tensor_parallel"])
    layout = StrategyTraits.from_strategy(s, 4, _shape())
    assert (layout.tensor, layout.data, layout.ddp_buckets) == (2, 2, True)
    assert option_keys(s) == ("parallel_mode:data=2", "parallel_mode:tensor=2", "tensor_parallel")
    resolved = [r.name for r in resolve_strategy(s, ValidationContext(world_size=4))]
    assert resolved == ["parallel_mode", "tensor_parallel", "ddp"]
    one_data_rank = Strategy([("parallel_mode", "tensor=2,data=1"), "tensor_parallel"])
    assert [r.name for r in resolve_strategy(one_data_rank, ValidationContext(world_size=2))] == \
        ["parallel_mode", "tensor_parallel"]


def test_a_parallel_mode_config_parse_config_refuses_is_refused_by_the_cost_model_too():
    # ATorch's multi_instance=True (a layout smaller than the world, repeated) is not supported.
    atorch_form = ([("data", 2)], None, True)
    with pytest.raises(ValueError, match="multi_instance=True"):
        StrategyTraits.from_strategy([("parallel_mode", atorch_form)], 4, _shape())
    # The refit keys a config it cannot read as a layout by the config itself.
    assert option_keys([("parallel_mode", atorch_form)])[0].startswith("parallel_mode:[")


def _shape():
    from atorch.auto.cost_model import ModelShape

    return ModelShape.from_config(tiny_llama_config(num_hidden_layers=2))


def test_plan_docstring_examples_are_what_plan_prints():
    doc = " ".join(plan_steps.__doc__.split())
    match = re.search(r"e\.g\. (\[.*?\]) on (\d+) ranks gives (\[.*?\]) \(a parallel_mode given dims shows them: "
                      r"'(.*?)'\)", doc)
    assert match, plan_steps.__doc__
    strategy, world, steps, with_dims = ast.literal_eval(match[1]), int(match[2]), ast.literal_eval(match[3]), match[4]
    assert plan_steps(resolve_strategy(Strategy(strategy), ValidationContext(world_size=world))) == steps
    dims = tuple((n, int(s)) for n, s in (d.split("=") for d in with_dims[len("parallel_mode("):-1].split(",")))
    assert ParallelModeOptimization.describe_step(ParallelModeConfig(dims)) == with_dims
    doc = " ".join(plan.__doc__.split())
    match = re.search(r"`plan\(Strategy\((\[.*?\])\), world_size=(\d+)\)` -> '(.*?)'", doc)
    assert match, plan.__doc__
    assert plan(Strategy(ast.literal_eval(match[1])), world_size=int(match[2])) == match[3]


def test_each_cost_model_comment_is_whole_and_next_to_what_it_describes():
    for module in (activations, memory, predict, shape, step_time, traits):
        lines = [line for line in inspect.getsource(module).splitlines() if line.strip()]
        assert not lines[-1].lstrip().startswith("#"), f"{module.__name__} ends with a comment: {lines[-1]!r}"
    source = inspect.getsource(memory)
    assert ('# Entries of `memory_breakdown` that are model states (the ZeRO paper\'s "model states"), and\n'
            "# those that stay allocated from one step to the next (what a rank holds once a backward pass\n"
            "# has finished and its activations are freed); the others exist only during part of a step.\n"
            "MODEL_STATE_KEYS = ") in source
