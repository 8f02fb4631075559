"""Native `pipeline_parallel` (torch.distributed.pipelining) trains exactly like one process.

On 4 gloo ranks, through `auto_accelerate` + `train_step`: 4 stages (1F1B, 4 micro-batches),
2 stages x 2 data replicas (GPipe), and GPT2 whose tied wte/lm_head is split over the first
and last stage. Each gives the single-process losses on the same global batches and, gathered
from the stages under the model's own state-dict keys, the same final weights.
Tolerances (fp32): losses rel 1e-5; weights atol 1e-5 + rtol 1e-4. Micro-batch gradient sums
and the data all-reduce change the summation order; Adam normalizes near-zero gradients, so
rounding becomes parameter differences of up to a few 1e-6 after 5 steps (measured 2.7e-6).
1e-5 is 1% of one Adam step (lr 1e-3): a wrong or missing gradient moves weights ~100x more.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from atorch.testing import run_distributed, tiny_gpt2, tiny_gpt2_config, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, GLOBAL_BATCH, LAYERS, SEED, LR = 5, 8, 4, 1234, 1e-3


def _meta_model(kind, layers=LAYERS):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from atorch.utils.meta_model_utils import record_module_init

    with record_module_init():
        if kind == "llama":
            return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
        return GPT2LMHeadModel(tiny_gpt2_config(n_layer=layers))


def _accelerate(kind, dims, config, layers=LAYERS, batch_size=GLOBAL_BATCH):
    from atorch.auto import auto_accelerate

    return auto_accelerate(_meta_model(kind, layers), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                           dataset=TokenDataset(), dataloader_args={"batch_size": batch_size},
                           load_strategy=[("parallel_mode", (dims, None)), ("pipeline_parallel", config)])


def _expect_value_error(match, *args, **kwargs):
    try:
        _accelerate(*args, **kwargs)
    except ValueError as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"no ValueError for {args} {kwargs}")


def _train(cases):
    from atorch import distributed as adist
    from atorch.auto import train_step
    from atorch.modules.pipeline.native import gather_pipeline_state_dict

    # Bad input: a ValueError on every rank before any collective (a hang would time out).
    errors = [
        _expect_value_error("needs a 'pipeline' dimension", "llama", [("data", 4)], {"chunks": 2}),
        _expect_value_error("pipeline size 4 is larger than the number of transformer blocks 2", "llama",
                            [("pipeline", 4)], {"chunks": 2}, layers=2),
        _expect_value_error("combines with data parallelism only", "llama", [("tensor", 2), ("pipeline", 2)], {}),
        _expect_value_error("chunks=0 must be an integer >= 1", "llama", [("data", 2), ("pipeline", 2)],
                            {"chunks": 0}),
    ]
    # A batch that does not split into the micro-batches is an argument mistake: a ValueError on every
    # rank, naming the chunks, before anything is applied (it used to be status=False, issue 14).
    errors.append(_expect_value_error("pipeline_parallel chunks=3 does not divide", "llama",
                                      [("data", 2), ("pipeline", 2)], {"chunks": 3}))
    out = []
    for kind, dims, config in cases:
        status, result, chosen = _accelerate(kind, dims, config)
        assert status, f"auto_accelerate failed for {kind} {dims} {config}"
        data_size = adist.parallel_size_or_one("data")
        losses = []
        for _, batch in zip(range(STEPS), result.dataloader):
            loss = train_step(result, batch)
            # Each data replica reports the loss of its share of the global batch (same on all its stages).
            if data_size > 1:
                dist.all_reduce(loss, group=adist.parallel_group("data"))
            losses.append(loss.item() / data_size)
        state = gather_pipeline_state_dict(result.model, adist.parallel_group("pipeline"))
        out.append({"kind": kind, "dims": dims, "losses": losses, "names": chosen.names(),
                    "stage": result.args["pipeline_stage"],
                    "stage_keys": sorted(result.model.state_dict()),
                    "state": {k: v.numpy() for k, v in state.items()} if dist.get_rank() == 0 else None})
        del result
        dist.barrier()
    return out, errors


def _reference(kind):
    model = tiny_llama(seed=SEED, num_hidden_layers=LAYERS) if kind == "llama" else \
        tiny_gpt2(seed=SEED, n_layer=LAYERS)
    losses = reference_losses(model, global_batches(TokenDataset(), GLOBAL_BATCH, STEPS), lr=LR)
    return losses, model.state_dict()


@pytest.mark.heavy
def test_native_pipeline_2_and_4_stages_match_single_process():
    cases = [
        ("llama", [("pipeline", 4)], {"chunks": 4, "schedule": "1f1b"}),
        ("llama", [("data", 2), ("pipeline", 2)], {"chunks": 2}),
        ("gpt2", [("data", 2), ("pipeline", 2)], {"chunks": 2}),  # tied wte / lm_head on stages 0 and 1
    ]
    results = run_distributed(_train, 4, cases, timeout=480)
    for _, errors in results:
        assert len(errors) == 5
    for i, (kind, dims, _) in enumerate(cases):
        expected_losses, expected_state = _reference(kind)
        stages = {}
        for cases_out, _ in results:
            case = cases_out[i]
            assert case["names"] == ["parallel_mode", "pipeline_parallel"]
            assert_close_losses(case["losses"], expected_losses, rel=1e-5, what=f"{kind} {dims}")
            stages.setdefault(case["stage"], case["stage_keys"])
        # Stages split the model: disjoint keys (a tied pair appears once per side) that cover it all.
        all_keys = [k for keys in stages.values() for k in keys]
        assert len(all_keys) == len(set(all_keys)) and set(all_keys) == set(expected_state), sorted(stages)
        state = results[0][0][i]["state"]
        assert set(state) == set(expected_state)
        for key, value in expected_state.items():
            torch.testing.assert_close(torch.from_numpy(np.asarray(state[key])), value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, key=key: f"{kind} {dims} {key}: {m}")
