"""`lora` targets on pipeline stages: each stage adapts the targets it holds; a stage holding none is refused.

Pure: validation on a meta model, and target resolution on a stage cut in this process (no process group).
The training parity of these cases is tests/distributed/test_pipeline_lora.py.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.lora import LoraConfig, resolve_target_modules
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama, tiny_llama_config

EDGE_TARGETS = ["q_proj", "lm_head", "embed_tokens"]


def _validate(targets):
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    strategy = Strategy([("parallel_mode", ([("pipeline", 2)], None)), "pipeline_parallel",
                         ("lora", {"target_modules": targets})])
    return resolve_strategy(strategy, ValidationContext(world_size=2, model=model))


def test_targets_on_one_stage_each_are_accepted_and_a_stage_holding_none_is_refused():
    assert [r.name for r in _validate(EDGE_TARGETS)][-1] == "lora"
    with pytest.raises(ValueError, match=r"pipeline_parallel: stage 0 of 2 \(model.embed_tokens, model.layers.0\) "
                                         r"holds none of lora's target_modules \['lm_head'\] \(they name lm_head\)"):
        _validate(["lm_head"])
    # a target on no stage at all is lora's own refusal, naming the model's adaptable layers
    with pytest.raises(ValueError, match=r"lora: target module\(s\) \['lm_heads'\] match no layer of LlamaForCausalLM"):
        _validate(["q_proj", "lm_heads"])


def test_a_stage_resolves_the_targets_it_holds_and_names_itself_when_it_holds_none():
    from atorch.modules.pipeline.native import build_stage_module

    first = build_stage_module(tiny_llama(seed=0), 0, 2).module
    # every stage's peft config names all targets (the same adapter config on every stage); peft adapts those here
    assert resolve_target_modules(first, LoraConfig(target_modules=EDGE_TARGETS), on_stage=True) == tuple(EDGE_TARGETS)
    with pytest.raises(ValueError, match=r"none of the target module\(s\) \['lm_head'\] is on pipeline stage 0 of 2"):
        resolve_target_modules(first, LoraConfig(target_modules=["lm_head"]), on_stage=True)
    # outside a pipeline a missing target is still refused
    with pytest.raises(ValueError, match=r"target module\(s\) \['lm_head'\] match no layer of PipelineStageModule"):
        resolve_target_modules(first, LoraConfig(target_modules=EDGE_TARGETS))
