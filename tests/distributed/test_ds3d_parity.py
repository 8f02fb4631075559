"""DeepSpeed 3D (tensor x data x pipeline) through auto_accelerate trains exactly like one process.

For each layout, 5 `engine.train_batch` calls on the result's dataloader give the losses of
plain single-process training on the same global batches (micro 2 x gas 2 x data size).
Tolerance rel 1e-4 (fp32): the pipeline sums micro-batch gradients and tensor parallelism
all-reduces partial matmuls, so results differ from one process by summation order only;
Adam's normalization can amplify that on near-zero gradients, hence 1e-4 rather than 1e-6.
One spawn per world size runs every layout in sequence to amortize process start-up.

The 4-rank spawn also clips, with SGD (lr 0.5; Adam's normalization hides a rescaled gradient), against plain
training with `clip_grad_norm_(0.5)`, rel 1e-5: Llama on data 2 x pipeline 2 through `train_step(max_grad_norm=)`,
and GPT-2 (tied wte / lm_head on the first and last stage) on tensor 2 x pipeline 2 through ds_config's
`gradient_clipping`, on micro-batches padded each to its own longest sample, so their sequence lengths vary under
tensor parallelism too. DeepSpeed's norm counted only stage 0's parameters (rel 3e-4 off after 4 steps; the tied
case 7e-4), and a second sequence length failed in DeepSpeed's partitioned-activation all-gather.
"""

import math

import pytest
import torch
import torch.distributed as dist

from atorch.testing import run_distributed, tiny_gpt2, tiny_gpt2_config, tiny_llama, tiny_llama_config
from atorch.testing.parity import (
    TokenDataset,
    VarLenDataset,
    assert_close_losses,
    global_batches,
    pad_to_longest,
    reference_losses,
)

STEPS, MICRO, GAS, LAYERS, SEED, LR = 5, 2, 2, 4, 1234, 1e-3
REL = 1e-4


def _ds_config():
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "steps_per_print": 10 ** 9, "torch_adam": True}


def _meta_model(kind, layers=LAYERS):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from atorch.utils.meta_model_utils import record_module_init

    with record_module_init():
        if kind == "llama":
            return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
        return GPT2LMHeadModel(tiny_gpt2_config(n_layer=layers))


def _strategy(dims, name="deepspeed_3d_parallel", **overrides):
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig

    cfg = DeepSpeed3DParallelConfig(ds_config=overrides.pop("ds_config", _ds_config()), **overrides)
    return [("parallel_mode", (dims, None)), (name, cfg)]


def _expect_value_error(model_kind, dims, match, layers=LAYERS, dataset=None, **overrides):
    from atorch.auto import auto_accelerate

    try:
        auto_accelerate(_meta_model(model_kind, layers), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                        dataset=dataset, load_strategy=_strategy(dims, **overrides))
    except ValueError as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"no ValueError for {dims} {overrides}")


def _bad_inputs_raise_everywhere():
    """Each bad input raises ValueError on every rank before any collective (a hang would time out)."""
    world = dist.get_world_size()
    return [
        _expect_value_error("llama", [("tensor", 2), ("data", 1), ("pipeline", 1)],
                            f"= 2 does not equal world size {world}"),
        _expect_value_error("llama", [("pipeline", 2), ("data", world // 2)], "supports the parallel order"),
        _expect_value_error("llama", [("tensor", 1), ("data", 1), ("pipeline", world)],
                            f"pipeline size {world} is larger than the number of transformer blocks 2", layers=2),
        _expect_value_error("llama", [("tensor", 1), ("data", 2), ("pipeline", world // 2)],
                            "zero_optimization.stage=2",
                            ds_config={**_ds_config(), "zero_optimization": {"stage": 2}}),
        _expect_value_error("llama", [("tensor", 1), ("data", 2), ("pipeline", world // 2)],
                            "train_batch_size=6 != train_micro_batch_size_per_gpu=2",
                            ds_config={**_ds_config(), "train_batch_size": 6}),
        # The engine's first step ran out of micro-batches on the first stage only (StopIteration there).
        _expect_value_error("llama", [("tensor", 1), ("data", 2), ("pipeline", world // 2)],
                            "dataset has 7 samples, fewer than one global batch (train_batch_size=8 = "
                            "train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2 x data size 2",
                            dataset=TokenDataset(n=7)),
    ]


def _train_layouts(cases):
    from atorch import distributed as adist
    from atorch.auto import auto_accelerate, train_step
    from atorch.modules.pipeline import hf_batch_fn

    errors = _bad_inputs_raise_everywhere()
    out = []
    for kind, dims, name, with_hooks in cases:
        calls = {"logit_helper": 0, "batch_fn": 0}
        hooks = {}
        if with_hooks:  # the user's logit_helper and batch_fn are the ones DeepSpeed calls
            def logit_helper(logits):
                calls["logit_helper"] += 1
                return logits

            def batch_fn(batch):
                calls["batch_fn"] += 1
                return hf_batch_fn(batch)

            hooks = {"logit_helper": logit_helper, "batch_fn": batch_fn}
        status, result, chosen = auto_accelerate(
            _meta_model(kind), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=TokenDataset(),
            load_strategy=_strategy(dims, name=name, **hooks), ignore_dryrun_on_load_strategy=True)
        assert status, f"auto_accelerate failed for {kind} {dims}"
        engine = result.model
        assert type(engine).__name__ == "PipelineEngine", type(engine)
        data_iter = iter(result.dataloader)
        losses = [engine.train_batch(data_iter).item() for _ in range(STEPS - 1)]
        # The generic helper drives the same engine: one global batch = GAS micro-batches per data rank.
        losses.append(train_step(result, [next(data_iter) for _ in range(GAS)]).item())
        if with_hooks:
            stage, stages = adist.parallel_rank_or_zero("pipeline"), adist.parallel_size_or_one("pipeline")
            # Every micro-batch: the helper runs on the last stage; first and last stages load batches.
            assert calls["logit_helper"] == (STEPS * GAS if stage == stages - 1 else 0), (calls, stage)
            assert calls["batch_fn"] == (STEPS * GAS if stage in (0, stages - 1) else 0), (calls, stage)
        out.append({"kind": kind, "dims": dims, "losses": losses, "names": chosen.names(),
                    "global_batch": result.args["global_batch_size"],
                    "stage_params": sum(p.numel() for p in engine.module.parameters())})
        del engine, result, data_iter
        dist.barrier()
    return out, errors


CLIP_LR, MAX_NORM, CLIP_STEPS, CLIP_REL = 0.5, 0.5, 4, 1e-5
VARYING_LONGEST = (16, 12, 20, 8, 10, 14, 12, 18)   # each micro-batch's longest sample (2 rows), 2 per step


def _train_clipped():
    """SGD with clipping: Llama on data 2 x pipeline 2 by train_step(max_grad_norm=), tied GPT-2 on tensor 2 x
    pipeline 2 by ds_config gradient_clipping on micro-batches of varying sequence length."""
    from atorch.auto import auto_accelerate, train_step

    out = {}
    status, result, _ = auto_accelerate(
        _meta_model("llama"), optim_func=torch.optim.SGD, optim_args={"lr": CLIP_LR}, dataset=TokenDataset(),
        load_strategy=_strategy([("tensor", 1), ("data", 2), ("pipeline", 2)]))
    assert status
    data_iter = iter(result.dataloader)
    out["llama"] = [train_step(result, [next(data_iter) for _ in range(GAS)], max_grad_norm=MAX_NORM).item()
                    for _ in range(CLIP_STEPS)]
    del result, data_iter
    dist.barrier()
    status, result, _ = auto_accelerate(
        _meta_model("gpt2"), optim_func=torch.optim.SGD, optim_args={"lr": CLIP_LR},
        dataset=VarLenDataset(VARYING_LONGEST, MICRO), dataloader_args={"collate_fn": pad_to_longest},
        load_strategy=_strategy([("tensor", 2), ("data", 1), ("pipeline", 2)],
                                ds_config={**_ds_config(), "gradient_clipping": MAX_NORM}))
    assert status
    data_iter = iter(result.dataloader)
    out["gpt2"] = [result.model.train_batch(data_iter).item() for _ in range(len(VARYING_LONGEST) // GAS)]
    del result, data_iter
    dist.barrier()
    return out


def _train_layouts_and_clipped(cases):
    return (*_train_layouts(cases), _train_clipped())


def _clipped_references():
    llama = reference_losses(tiny_llama(seed=SEED, num_hidden_layers=LAYERS),
                             global_batches(TokenDataset(), MICRO * GAS * 2, CLIP_STEPS), optim_func=torch.optim.SGD,
                             lr=CLIP_LR, max_grad_norm=MAX_NORM)
    data = VarLenDataset(VARYING_LONGEST, MICRO)
    micros = [pad_to_longest([data[i] for i in range(k * MICRO, (k + 1) * MICRO)]) for k in range(len(VARYING_LONGEST))]
    steps = [micros[k:k + GAS] for k in range(0, len(micros), GAS)]
    gpt2 = reference_losses(tiny_gpt2(seed=SEED, n_layer=LAYERS), steps, optim_func=torch.optim.SGD, lr=CLIP_LR,
                            max_grad_norm=MAX_NORM)
    return {"llama": llama, "gpt2": gpt2}


def _reference(kind, data_size):
    model = tiny_llama(seed=SEED, num_hidden_layers=LAYERS) if kind == "llama" else \
        tiny_gpt2(seed=SEED, n_layer=LAYERS)
    return reference_losses(model, global_batches(TokenDataset(), MICRO * GAS * data_size, STEPS), lr=LR)


def _check(results):
    for cases, errors, *_ in results:
        assert len(errors) == 6, errors
        for case in cases:
            data_size = dict(case["dims"]).get("data", 1)
            assert case["global_batch"] == MICRO * GAS * data_size
            assert case["names"] == ["parallel_mode", "deepspeed_3d_parallel"]
            assert_close_losses(case["losses"], _reference(case["kind"], data_size), rel=REL,
                                what=f"{case['kind']} {case['dims']}")


@pytest.mark.heavy
def test_ds3d_4_ranks_layouts_match_single_process():
    cases = [
        ("llama", [("tensor", 1), ("data", 2), ("pipeline", 2)], "deepspeed_3d_parallel", False),
        ("llama", [("tensor", 2), ("data", 1), ("pipeline", 2)], "ds_3d_parallel", False),  # the alias
        ("llama", [("tensor", 2), ("data", 2), ("pipeline", 1)], "deepspeed_3d_parallel", False),
        # tied wte / lm_head over two stages, the user's logit_helper and batch_fn
        ("gpt2", [("tensor", 2), ("data", 1), ("pipeline", 2)], "deepspeed_3d_parallel", True),
    ]
    results = run_distributed(_train_layouts_and_clipped, 4, cases, timeout=600)
    _check(results)
    expected = _clipped_references()
    for _, _, clipped in results:     # DeepSpeed's train_batch returns the loss on every stage
        for kind in ("llama", "gpt2"):
            assert_close_losses(clipped[kind], expected[kind], rel=CLIP_REL, what=f"ds3d clipped {kind}")


@pytest.mark.heavy
def test_ds3d_8_ranks_tensor2_data2_pipeline2_matches_single_process():
    cases = [("llama", [("tensor", 2), ("data", 2), ("pipeline", 2)], "deepspeed_3d_parallel", False)]
    results = run_distributed(_train_layouts, 8, cases, timeout=480)
    _check(results)
    # Each rank holds half of the blocks (pipeline 2), tensor-sharded in two: about a quarter of the model.
    full = sum(p.numel() for p in tiny_llama(seed=SEED, num_hidden_layers=LAYERS).parameters())
    per_rank = [case["stage_params"] for cases, _ in results for case in cases]
    assert max(per_rank) <= 0.26 * full, (per_rank, full)


def _train_zero1(dims):
    """DeepSpeed 3D with ZeRO-1 over "data": losses, and the reduce bucket the engine was given."""
    from atorch.auto import auto_accelerate

    ds_config = {**_ds_config(), "zero_optimization": {"stage": 1}}
    status, result, _ = auto_accelerate(
        _meta_model("llama"), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=TokenDataset(),
        load_strategy=_strategy(dims, ds_config=ds_config), ignore_dryrun_on_load_strategy=True)
    assert status
    engine = result.model
    data_iter = iter(result.dataloader)
    losses = [engine.train_batch(data_iter).item() for _ in range(STEPS)]
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    out = {"losses": losses, "bucket": engine.zero_reduce_bucket_size(), "trainable": trainable,
           "stage": engine.zero_optimization_stage()}
    del engine, result, data_iter
    dist.barrier()
    return out


@pytest.mark.heavy
def test_ds3d_zero1_sizes_its_bucket_from_the_stage_and_matches_single_process():
    """DeepSpeed's 5e8-element default bucket (1 GB a rank in bf16) would hold a 2 MB model's
    gradients 500 times over: atorch sizes it from the stage's trainable elements, as for the
    ZeRO engines, and the cost model assumes the same."""
    dims = [("tensor", 1), ("data", 2), ("pipeline", 1)]
    for r in run_distributed(_train_zero1, 2, dims, timeout=300):
        assert r["stage"] == 1, r
        assert r["bucket"] == r["trainable"], r
        assert_close_losses(r["losses"], _reference("llama", 2), rel=REL, what="ds3d zero1 data 2")


def _train_without_ds_config(global_batch):
    """No ds_config: the dataloader's global batch is DeepSpeed's, one micro-batch per stage; a ds_config
    whose batch keys contradict it raises ValueError on every rank before any collective."""
    from atorch.auto import auto_accelerate, train_step

    dims = [("pipeline", dist.get_world_size())]
    error = ""
    try:
        auto_accelerate(_meta_model("llama"), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                        dataset=TokenDataset(), dataloader_args={"batch_size": global_batch},
                        load_strategy=_strategy(dims, ds_config={"train_batch_size": 2 * global_batch}))
    except ValueError as e:
        error = str(e)
    status, result, _ = auto_accelerate(
        _meta_model("llama"), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=TokenDataset(),
        dataloader_args={"batch_size": global_batch}, load_strategy=_strategy(dims, ds_config=None))
    assert status
    data_iter = iter(result.dataloader)
    gas = result.gradient_accumulation_steps
    losses = [train_step(result, [next(data_iter) for _ in range(gas)]).item() for _ in range(3)]
    out = {"error": error, "losses": losses, "gas": gas, "micro": result.micro_batch_size,
           "global_batch": result.args["global_batch_size"]}
    del result, data_iter
    dist.barrier()
    out["epoch"] = _epoch_ending_mid_step(global_batch)
    return out


def _epoch_ending_mid_step(global_batch):
    """An epoch of 10 samples in global batches of 4: the loader holds 2 whole steps of micro-batches and nothing
    else; the 2 samples left would start a third step the engine cannot finish (its stages run out of
    micro-batches in the middle of it), so the loader leaves them out. A loop calling train_batch until
    StopIteration ends on every stage after those 2 steps, as does one over an iterator ending mid-step."""
    from atorch.auto import auto_accelerate

    status, result, _ = auto_accelerate(
        _meta_model("llama"), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=TokenDataset(n=10),
        dataloader_args={"batch_size": global_batch}, load_strategy=_strategy([("pipeline", dist.get_world_size())],
                                                                               ds_config=None))
    assert status
    engine, data_iter = result.model, iter(result.dataloader)
    # A loop until StopIteration: the first stage reads before sending anything, the last only after receiving,
    # so without the ranks agreeing on the end of the data the last stage waited forever in the third step.
    losses = []
    while True:
        try:
            losses.append(engine.train_batch(data_iter).item())
        except StopIteration:
            break
    out = {"losses": losses, "items": len(result.dataloader), "left": len(list(data_iter))}
    # An iterator (the user's own) ending one micro-batch into a step: every rank stops, none waits.
    items = list(result.dataloader)
    partial = iter(items[:result.gradient_accumulation_steps + 1])
    out["partial"] = [engine.train_batch(partial).item()]
    try:
        engine.train_batch(partial)
        out["partial"].append("no StopIteration")
    except StopIteration:
        pass
    # ... and the engine trains on: a StopIteration from inside train_batch left its timer started, and the next
    # epoch's first step failed ("train_batch timer has already been started").
    out["next_epoch"] = engine.train_batch(iter(result.dataloader)).item()
    del engine, result, data_iter, partial, items
    dist.barrier()
    return out


@pytest.mark.heavy
def test_ds3d_without_ds_config_takes_the_dataloader_batch():
    """The repro of a default ds_config overriding dataloader_args batch_size=4 with train_batch_size=1; and an
    epoch whose micro-batches are not a whole number of steps (the last incomplete step is left out)."""
    batch = 4
    for r in run_distributed(_train_without_ds_config, 2, batch, timeout=300):
        assert "dataloader_args batch_size=4 (global) differs from ds_config train_batch_size=8" in r["error"], r
        assert (r["global_batch"], r["gas"], r["micro"]) == (batch, 2, 2), r
        reference = reference_losses(tiny_llama(seed=SEED, num_hidden_layers=LAYERS),
                                     global_batches(TokenDataset(), batch, 3), lr=LR)
        assert_close_losses(r["losses"], reference, rel=REL, what="ds3d pipeline 2 without ds_config")
        # 2 whole steps of 2 micro-batches; nothing of a third was run.
        assert (len(r["epoch"]["losses"]), r["epoch"]["items"], r["epoch"]["left"]) == (2, 4, 0), r["epoch"]
        assert len(r["epoch"]["partial"]) == 1 and math.isfinite(r["epoch"]["next_epoch"]), r["epoch"]
        assert_close_losses(r["epoch"]["losses"], reference[:2], rel=REL, what="ds3d epoch ending mid-step")
