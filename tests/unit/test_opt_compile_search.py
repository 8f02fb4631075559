"""`compile` in the planner: its step-time factor in the cost model, and a model that does not
compile is a failed trial the search moves past (issue 19, section 2)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from atorch.auto.cost_model import StrategyTraits, estimate
from atorch.auto.opt_lib.compile import COMPUTE_TIME_FACTOR, CompileOptimization
from atorch.testing import tiny_llama


def test_compile_scales_compute_and_overhead_not_communication():
    model = tiny_llama(num_hidden_layers=4)
    for device in ("cpu", "cuda"):
        factor = COMPUTE_TIME_FACTOR[device]
        assert 0 < factor
        assert StrategyTraits.from_strategy(["parallel_mode", "compile"], 2, _shape(model), device) \
            .compute_time_factor == factor
        for base in (["parallel_mode"], ["parallel_mode", "amp_native", "fsdp", "checkpoint"]):
            eager = estimate(model, base, 8, 64, 2, device).breakdown
            compiled = estimate(model, base + ["compile"], 8, 64, 2, device).breakdown
            assert compiled["time_compute"] == pytest.approx(eager["time_compute"] * factor)
            assert compiled["time_overhead"] < eager["time_overhead"] or factor >= 1
            assert compiled["time_communication"] == eager["time_communication"]
            # Memory is not the compile trait's business.
            assert {k: v for k, v in compiled.items() if k.startswith("mem_")} == \
                {k: v for k, v in eager.items() if k.startswith("mem_")}
    # An accelerator without its own entry gets the GPU assumption.
    assert StrategyTraits.from_strategy(["compile"], 1, _shape(model), "xpu").compute_time_factor == \
        COMPUTE_TIME_FACTOR["cuda"]
    assert StrategyTraits.from_strategy(["parallel_mode"], 1, _shape(model)).compute_time_factor == 1.0


def _shape(model):
    from atorch.auto.cost_model import ModelShape

    return ModelShape.from_module(model)


class _NotCompilable(LlamaForCausalLM):
    """A model dynamo cannot capture whole: its forward breaks the graph (fatal under fullgraph=True)."""

    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return super().forward(*args, **kwargs)


def test_a_model_that_fails_to_compile_is_a_failed_trial_and_the_search_goes_on(monkeypatch, tmp_path):
    from atorch.auto import auto_accelerate, train_step
    from atorch.testing.parity import TokenDataset

    failing = ("compile", {"scope": "model", "fullgraph": True})
    monkeypatch.setattr(CompileOptimization, "search_choices", classmethod(lambda cls, context: [None, failing]))
    for key, value in {"ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_PROFILE_STEP": "2",
                       "ATORCH_DRYRUN_MAX_STEPS": "4", "ATORCH_DRYRUN_TIMEOUT": "120", "RANDOM_SAMPLE": "2",
                       "BO_SG_MAX_IETR": "4", "ATORCH_SEARCH_CACHE": "off"}.items():
        monkeypatch.setenv(key, value)
    torch._dynamo.reset()
    model = tiny_llama(seed=0)
    model.__class__ = _NotCompilable
    others = ["gradient_accumulation", "module_replace", "checkpoint", "amp_native", "fsdp", "zero1", "zero2",
              "tensor_parallel"]
    status, result, strategy = auto_accelerate(model, torch.optim.AdamW, TokenDataset(n=32, seq_len=16),
                                               optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 4},
                                               model_input_format="unpack_dict", excluded=others,
                                               report_path=str(tmp_path))
    assert status and strategy is not None
    assert "compile" not in strategy.names()
    trials = result.search.trials
    failed = trials[trials["strategy"].str.contains("compile")]
    assert len(failed) == 1 and failed.iloc[0]["status"] == "exception", trials
    assert "fullgraph" in failed.iloc[0]["reason"] or "graph" in failed.iloc[0]["reason"].lower(), \
        failed.iloc[0]["reason"]
    assert (trials[~trials["strategy"].str.contains("compile")]["status"] == "ok").all()
    float(train_step(result, next(iter(result.dataloader))))      # the chosen strategy trains
