"""`pipeline_parallel` strategy validation: pure, no process group, a ValueError naming the values."""

import inspect

import pytest
import torch
from transformers import LlamaForCausalLM

from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama_config


def _meta(layers=4):
    with torch.device("meta"):
        return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))


def _resolve(dims, config=None, world=4, layers=4, extra=()):
    strategy = Strategy([("parallel_mode", (dims, None)), ("pipeline_parallel", config), *extra])
    return resolve_strategy(strategy, ValidationContext(world_size=world, model=_meta(layers)))


def test_valid_strategy_orders_pipeline_after_groups():
    resolved = _resolve([("data", 2), ("pipeline", 2)], {"chunks": 4, "schedule": "1f1b"})
    assert [r.name for r in resolved] == ["parallel_mode", "pipeline_parallel"]
    assert resolved[1].config.chunks == 4 and resolved[1].config.schedule == "1f1b"
    # 1F1B with one micro-batch per stage (chunks None: as many as stages), GPipe with fewer: accepted.
    _resolve([("pipeline", 4)], {"schedule": "1f1b"})
    _resolve([("pipeline", 4)], {"chunks": 4, "schedule": "1f1b"})
    _resolve([("pipeline", 4)], {"chunks": 1, "schedule": "gpipe"})


def test_meta_models_are_materialized_from_one_default_seed():
    from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelConfig
    from atorch.auto.opt_lib.tensor_parallel import TensorParallelConfig
    from atorch.modules.pipeline.native import build_stage_module
    from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED

    assert PipelineParallelConfig().base_seed == TensorParallelConfig().base_seed == DEFAULT_BASE_SEED == 1234
    assert inspect.signature(build_stage_module).parameters["base_seed"].default == DEFAULT_BASE_SEED


@pytest.mark.parametrize("dims, config, world, layers, match", [
    ([("data", 4)], None, 4, 4, "needs a 'pipeline' dimension in parallel_mode"),
    ([("pipeline", 4)], None, 4, 2, "pipeline size 4 is larger than the number of transformer blocks 2"),
    ([("tensor", 2), ("pipeline", 2)], None, 4, 4, r"combines with data parallelism only, but parallel_mode has "
                                                   r"\{'tensor': 2\}"),
    ([("data", 2), ("pipeline", 2)], {"chunks": 0}, 4, 4, "chunks=0 must be an integer >= 1"),
    ([("data", 2), ("pipeline", 2)], {"schedule": "zb"}, 4, 4, r"schedule='zb'; valid schedules are \['gpipe', "),
    ([("data", 2), ("pipeline", 2)], {"partition_method": "type:Block"}, 4, 4, "valid methods are"),
    ([("data", 2), ("pipeline", 2)], {"micro_batches": 2}, 4, 4, r"unknown config key\(s\) \['micro_batches'\]"),
    ([("data", 2), ("pipeline", 3)], None, 4, 4, "= 6 does not equal world size 4"),
    # torch's Schedule1F1B refuses fewer micro-batches than stages: refused here, before anything is split.
    ([("pipeline", 4)], {"chunks": 2, "schedule": "1f1b"}, 4, 4, r"schedule='1f1b' needs at least one micro-batch "
                                                                r"per stage, but chunks=2 is fewer than the 4 pipeline "
                                                                r"stages; set chunks >= 4"),
    ([("data", 2), ("pipeline", 2)], {"chunks": 1, "schedule": "1f1b"}, 4, 4, "chunks=1 is fewer than the 2"),
])
def test_bad_input_raises_value_error(dims, config, world, layers, match):
    with pytest.raises(ValueError, match=match):
        _resolve(dims, config, world, layers)


def test_conflicts_and_precision():
    with pytest.raises(ValueError, match="'fsdp' and 'pipeline_parallel' cannot be combined"):
        _resolve([("data", 2), ("pipeline", 2)], extra=[("fsdp", None)])
    with pytest.raises(ValueError, match="amp_native fp16 is not supported"):
        _resolve([("data", 2), ("pipeline", 2)], extra=[("amp_native", {"dtype": torch.float16})])
    _resolve([("data", 2), ("pipeline", 2)], extra=[("amp_native", {"dtype": torch.bfloat16})])


def test_single_process_is_refused():
    with pytest.raises(ValueError, match="needs more than one process"):
        _resolve([("pipeline", 1)], world=1)


def test_a_stage_the_user_froze_entirely_is_refused_before_the_split():
    model = _meta(4)
    for name, param in model.named_parameters():
        if "embed_tokens" in name or any(f".layers.{i}." in name for i in range(3)):
            param.requires_grad_(False)
    strategy = Strategy([("parallel_mode", ([("data", 2), ("pipeline", 2)], None)), "pipeline_parallel"])
    # Stages are balanced over all parameters, frozen ones included: two blocks per stage.
    with pytest.raises(ValueError, match=r"stage 0 of 2 \(model\.embed_tokens, model\.layers\.0, model\.layers\.1\) "
                                         r"has no trainable parameter.*fewer pipeline stages"):
        resolve_strategy(strategy, ValidationContext(world_size=4, model=model))
    # With layer 1 trainable again every stage has something to train; LoRA adds adapters to every stage.
    for param in model.model.layers[1].parameters():
        param.requires_grad_(True)
    resolve_strategy(strategy, ValidationContext(world_size=4, model=model))
    for param in model.parameters():
        param.requires_grad_(False)
    resolve_strategy(Strategy([*strategy, "lora"]), ValidationContext(world_size=4, model=model))


@pytest.mark.parametrize("order", ["pipeline_first", "tensor_first"])
def test_tensor_parallel_with_the_native_pipeline_points_to_deepspeed_3d(order):
    """The README's tensor-parallel section once read as if the native pipeline split layers inside its stages."""
    extra = [("tensor_parallel", None)]
    dims = [("tensor", 2), ("pipeline", 2)]
    with pytest.raises(ValueError, match=r"'pipeline_parallel' and 'tensor_parallel' cannot be combined: the native "
                                         r"pipeline does not split layers .* use deepspeed_3d_parallel"):
        if order == "pipeline_first":
            _resolve(dims, extra=extra)
        else:
            resolve_strategy(Strategy([("parallel_mode", (dims, None)), *extra, ("pipeline_parallel", None)]),
                             ValidationContext(world_size=4, model=_meta()))
