"""What a native `pipeline_parallel` takes from a batch: the batch's position_ids reach every stage that needs
them, and what the stages would never see is refused (other keys, tuple batches, the MoE router's aux loss).

In one process (milliseconds): the stage modules chained compute the Hugging Face model's own logits (fp32,
same kernels: atol 1e-6, as in tests/unit/test_pipeline_patchers.py) for left-padded rows with position_ids
and for rows packed with two documents whose position_ids restart and no attention_mask (Hugging Face masks
each document apart only where its forward makes no cache, use_cache=False); the checks name the key and what
the pipeline passes. (One file for both parts: a tests/unit file of the same name would collide with this one
under `pytest tests`, whose test directories are not packages.)

On 2 gloo ranks, one spawn, pipeline 2 x chunks 2, through `auto_accelerate` + `train_step`, 3 AdamW steps,
against plain single-process training on the same global batches, unsplit (the pipeline's loss is the
batch's token mean, however many tokens each micro-batch predicts):
- GPT-2 (learned position embeddings on the first stage), left-padded rows with position_ids and labels -100
  on the pads, so the two micro-batches predict different numbers of tokens, GPipe;
- Llama (rotary embeddings in every block, on both stages), rows packed with two documents whose position_ids
  restart and no attention_mask, `use_cache=False` (Hugging Face then masks each document apart; the "no mask"
  crosses the stage boundary), 1F1B; then one more step on a batch whose first key is position_ids of
  shape [1, tokens] (its rows are input_ids', not position_ids' one).
Losses within rel 1e-5 (fp32; only the micro-batch gradient sums change the order of summation; training
without the position_ids, on 0..seq-1 and one causal mask per row, moves the first loss by rel 4e-3 (GPT-2)
and 1e-3 (Llama); averaging the two micro-batches' token means instead moves GPT-2's by rel 7e-5).
Batches whose sequence length changes from step to step (a pad-to-longest collate_fn over samples of unequal
lengths, through the result's dataloader) train like one process too, rel 1e-5: the native pipeline over 7 steps
of 5 lengths, one revisited after the pipeline's cache of 4 schedules evicted it (torch fixes the shapes it sends
between stages at a schedule's first step: the second length crashed gloo, "Received data size doesn't match
expected size"), and DeepSpeed 3D's pipeline engine, whose micro-batches each have their own length (it reused
the first micro-batch's buffers: the labels of the second did not fit its logits).
A dataset of tuples and a batch key the pipeline would drop are ValueErrors on every rank, the first from
`auto_accelerate`, the second (added by a collate_fn, so only a batch shows it) from the first `train_step`,
before the schedule's first send (a rank left in a collective would time the test out).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.base import DataSetup
from atorch.auto.opt_lib.pipeline_parallel import _check_dataset_batches
from atorch.auto.strategy import Strategy
from atorch.modules.pipeline.batches import check_pipeline_batch, pipeline_inputs
from atorch.modules.pipeline.native import build_stage_module
from atorch.modules.pipeline.patchers import expand_patcher, get_custom_patcher, pieces_take_position_ids
from atorch.testing import run_distributed, tiny_gpt2, tiny_llama
from atorch.testing.parity import VarLenDataset, assert_close_losses, pad_to_longest, reference_losses

ROWS, USEQ = 4, 12


def _small(kind, **overrides):
    if kind == "llama":
        return tiny_llama(seed=3, num_hidden_layers=2, **overrides)
    return tiny_gpt2(seed=3, n_layer=2, **overrides)


def _small_batch(layout):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 1024, (ROWS, USEQ), generator=g)
    if layout == "left":        # left padding, positions counted from each row's first token
        mask = torch.ones_like(ids)
        for row, pad in enumerate((0, 3, 5, 1)):
            mask[row, :pad] = 0
        return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                "labels": ids.masked_fill(mask == 0, -100)}
    half = USEQ // 2            # two documents per row, no mask: position_ids restart at the second
    positions = torch.cat([torch.arange(half), torch.arange(USEQ - half)]).expand(ROWS, USEQ)
    return {"input_ids": ids, "position_ids": positions.clone(), "labels": ids.clone()}


def _stage_logits(model, batch):
    stages = [build_stage_module(model, s, 2) for s in range(2)]
    assert all(s.takes_position_ids for s in stages)
    x = pipeline_inputs(batch, takes_position_ids=True)
    for stage in stages:
        x = stage.module(*x) if isinstance(x, tuple) else stage.module(x)
    return x


# Llama's rotary embedding is blind to left padding (a shift of every position); packed rows are not.
# Without a mask, Hugging Face masks each document apart only where its forward makes no cache
# (use_cache=False); with the default use_cache=True it masks causally over the whole row.
@pytest.mark.parametrize("kind, layout, use_cache", [("gpt2", "left", True), ("gpt2", "packed", True),
                                                     ("llama", "packed", True), ("gpt2", "packed", False),
                                                     ("llama", "packed", False)])
def test_stages_use_the_batch_position_ids_like_hf(kind, layout, use_cache):
    model = _small(kind, use_cache=use_cache).eval()
    batch = _small_batch(layout)
    with torch.no_grad():
        expected = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        arange = model(**{k: v for k, v in batch.items() if k not in ("labels", "position_ids")}).logits
        got = _stage_logits(model, batch)
    assert not torch.allclose(arange, expected, atol=1e-3)   # the position ids matter for this batch
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_position_ids_of_one_row_are_repeated_for_every_row():
    batch = _small_batch("packed")
    batch["position_ids"] = batch["position_ids"][:1]
    ids, mask, positions = pipeline_inputs(batch, takes_position_ids=True)
    assert positions.shape == ids.shape and positions.is_contiguous() and mask.shape == (ROWS, 0)
    ids, mask, positions = pipeline_inputs(_small_batch("left"), True)
    assert mask.shape == ids.shape and torch.equal(positions, _small_batch("left")["position_ids"])
    assert len(pipeline_inputs({"input_ids": ids, "labels": ids}, True)) == 2   # no position_ids: as before


def test_ready_patchers_take_position_ids_and_custom_ones_do_not_unless_they_say_so():
    model = _small("llama")
    patcher = get_custom_patcher(model)
    assert pieces_take_position_ids(expand_patcher(model, patcher))

    def embed(module, inputs):
        return patcher["model.embed_tokens"](module, inputs[:2])

    custom = {**patcher, "model.embed_tokens": embed}
    assert not pieces_take_position_ids(expand_patcher(model, custom))
    embed.takes_position_ids = True
    assert pieces_take_position_ids(expand_patcher(model, custom))


def test_batches_the_pipeline_cannot_pass_on_are_refused():
    batch = _small_batch("left")
    check_pipeline_batch(batch, takes_position_ids=True)
    with pytest.raises(ValueError, match=r"passes only \['input_ids', 'attention_mask', 'labels'\].*"
                                         r"also has \['position_ids'\].*takes_position_ids = True"):
        check_pipeline_batch(batch, takes_position_ids=False)
    with pytest.raises(ValueError, match=r"also has \['token_type_ids'\], which the stages would never see"):
        check_pipeline_batch({**batch, "token_type_ids": batch["input_ids"]}, takes_position_ids=True)
    with pytest.raises(ValueError, match="needs dict batches with 'input_ids' and 'labels'.* is a tuple"):
        check_pipeline_batch((batch["input_ids"], batch["labels"]), takes_position_ids=True)
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        check_pipeline_batch({"labels": batch["labels"]}, takes_position_ids=True)
    with pytest.raises(ValueError, match=r"integer position_ids shaped like input_ids \[4, 12\]"):
        check_pipeline_batch({**batch, "position_ids": batch["position_ids"][:, :5]}, takes_position_ids=True)
    with pytest.raises(ValueError, match=r"2-D attention_mask"):
        check_pipeline_batch({**batch, "attention_mask": batch["attention_mask"][:, None, None]}, True)


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, dict_samples, extra=()):
        self.dict_samples, self.extra = dict_samples, extra

    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(USEQ) + 4
        if not self.dict_samples:
            return ids, ids
        return {"input_ids": ids, "labels": ids, **{k: ids for k in self.extra}}


@pytest.mark.parametrize("dataset, fmt, match", [
    (_Pairs(False), "unpack_sequence", "needs dict batches with 'input_ids' and 'labels'.*'unpack_sequence'"),
    (_Pairs(False), None, r"needs dict batches with 'input_ids' and 'labels'.*dataset\[0\] is a tuple"),
    (_Pairs(True, ["token_type_ids"]), "unpack_dict", r"dataset\[0\] also has \['token_type_ids'\]"),
])
def test_a_dataset_the_pipeline_cannot_take_is_refused_when_applied(dataset, fmt, match):
    with pytest.raises(ValueError, match=match):
        _check_dataset_batches(DataSetup.of(ModelContext(model=_small("llama"), dataset=dataset,
                                                         model_input_format=fmt)), True)
    _check_dataset_batches(DataSetup.of(ModelContext(model=_small("llama"), dataset=_Pairs(True))), True)  # accepted


def _resolve_moe(pipeline="pipeline_parallel", **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, **overrides)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    dims = [("data", 1), ("pipeline", 2)] if pipeline == "deepspeed_3d_parallel" else [("pipeline", 2)]
    strategy = Strategy([("parallel_mode", (dims, None)), (pipeline, None)])
    return resolve_strategy(strategy, ValidationContext(world_size=2, model=model, model_config=model.config))


@pytest.mark.parametrize("pipeline", ["pipeline_parallel", "deepspeed_3d_parallel"])
def test_moe_router_aux_loss_is_refused_at_validation(pipeline):
    with pytest.raises(ValueError, match=rf"{pipeline} cannot train mixtral with output_router_logits=True "
                                         r"\(router_aux_loss_coef=0.5\).*set model.config.output_router_logits = "
                                         r"False.*tensor_parallel or fsdp"):
        _resolve_moe(pipeline, output_router_logits=True, router_aux_loss_coef=0.5)
    _resolve_moe(pipeline, output_router_logits=False)
    _resolve_moe(pipeline, output_router_logits=True, router_aux_loss_coef=0.0)   # adds nothing: the model's loss


# ---- 2 ranks ------------------------------------------------------------------------------------------------

STEPS, GLOBAL_BATCH, CHUNKS, LAYERS, SEED, LR, REL, SEQ = 3, 8, 2, 4, 1234, 1e-3, 1e-5, 16


class Rows(Dataset):
    """`left`: left padding (mask, position_ids from the first real token, labels -100 on pads);
    `packed`: two documents per row, position_ids restarting at the second, no mask; `tuple`: (ids, labels)."""

    def __init__(self, layout: str, n: int = 32):
        g = torch.Generator().manual_seed(0)
        self.layout = layout
        self.tokens = torch.randint(4, 1000, (n, SEQ), generator=g)
        self.pads = torch.randint(0, SEQ // 2, (n,), generator=g)
        self.splits = torch.randint(3, SEQ - 3, (n,), generator=g)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> Any:
        ids = self.tokens[i].clone()
        if self.layout == "tuple":
            return ids, ids.clone()
        if self.layout == "left":
            mask = torch.ones(SEQ, dtype=torch.long)
            mask[:int(self.pads[i])] = 0
            ids[mask == 0] = 3
            return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(0) - 1).clamp(min=0),
                    "labels": ids.masked_fill(mask == 0, -100)}
        split = int(self.splits[i])
        positions = torch.cat([torch.arange(split), torch.arange(SEQ - split)])
        return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


CASES: List[Tuple[str, str, str]] = [("gpt2", "left", "gpipe"), ("llama", "packed", "1f1b")]


def _model(kind: str) -> torch.nn.Module:
    if kind == "gpt2":
        return tiny_gpt2(seed=SEED, n_layer=LAYERS)
    return tiny_llama(seed=SEED, num_hidden_layers=LAYERS, use_cache=False)


def _accelerate(kind: str, dataset: Dataset, schedule: str = "gpipe", **kwargs: Any) -> Any:
    from atorch.auto import auto_accelerate

    return auto_accelerate(_model(kind), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=dataset,
                           dataloader_args={"batch_size": GLOBAL_BATCH, **kwargs.pop("dataloader_args", {})},
                           load_strategy=[("parallel_mode", ([("pipeline", 2)], None)),
                                          ("pipeline_parallel", {"chunks": CHUNKS, "schedule": schedule})],
                           **kwargs)


def _with_token_type_ids(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    batch = default_collate(samples)
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return batch


def _train() -> Dict[str, Any]:
    from atorch import distributed as adist
    from atorch.auto import train_step

    out: Dict[str, Any] = {"errors": []}
    for kind, layout, schedule in CASES:
        status, result, _ = _accelerate(kind, Rows(layout), schedule)
        assert status, (kind, layout)
        out["stage"] = adist.parallel_rank_or_zero("pipeline")
        batches = iter(result.dataloader)
        out[f"{kind}/{layout}"] = [train_step(result, next(batches)).item() for _ in range(STEPS)]
        if kind == "llama":
            out["position_ids first"] = train_step(result, _position_ids_first(next(batches))).item()
        del result, batches
        dist.barrier()
    out.update(_train_on_varying_lengths())
    try:
        _accelerate("llama", Rows("tuple"), model_input_format="unpack_sequence")
    except ValueError as e:
        out["errors"].append(str(e))
    status, result, _ = _accelerate("gpt2", Rows("left"), dataloader_args={"collate_fn": _with_token_type_ids})
    assert status
    try:
        train_step(result, next(iter(result.dataloader)))
    except ValueError as e:
        out["errors"].append(str(e))
    del result
    dist.barrier()
    from atorch.auto import auto_accelerate

    try:   # DeepSpeed's pipeline passes input_ids and attention_mask: position_ids would be dropped
        auto_accelerate(_model("gpt2"), optim_func=torch.optim.AdamW, optim_args={"lr": LR}, dataset=Rows("left"),
                        dataloader_args={"batch_size": GLOBAL_BATCH},
                        load_strategy=[("parallel_mode", ([("data", 1), ("pipeline", 2)], None)),
                                       "deepspeed_3d_parallel"])
    except ValueError as e:
        out["errors"].append(str(e))
    return out


# Longest sample of each native global batch (8 rows): 16 comes back after 8, 10 and 12 evicted it from the
# pipeline's cache of 4 schedules; DeepSpeed's micro-batches (2 rows, 2 per step) each have their own.
NATIVE_LONGEST, DS_LONGEST, DS_MICRO, DS_GAS = (16, 12, 16, 20, 8, 10, 12, 16), (16, 12, 20, 8, 10, 14), 2, 2


def _train_on_varying_lengths() -> Dict[str, Any]:
    from atorch.auto import train_step
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig

    status, result, _ = _accelerate("llama", VarLenDataset(NATIVE_LONGEST, GLOBAL_BATCH),
                                    dataloader_args={"collate_fn": pad_to_longest})
    assert status
    native = [train_step(result, batch).item() for batch in result.dataloader]
    cached = len(result.pipeline._schedules)
    del result
    dist.barrier()
    from atorch.auto import auto_accelerate

    ds_config = {"train_micro_batch_size_per_gpu": DS_MICRO, "gradient_accumulation_steps": DS_GAS,
                 "steps_per_print": 10 ** 9, "torch_adam": True}
    status, result, _ = auto_accelerate(
        _model("llama"), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
        dataset=VarLenDataset(DS_LONGEST, DS_MICRO), dataloader_args={"collate_fn": pad_to_longest},
        load_strategy=[("parallel_mode", ([("data", 1), ("pipeline", 2)], None)),
                       ("deepspeed_3d_parallel", DeepSpeed3DParallelConfig(ds_config=ds_config))])
    assert status
    micro_batches = iter(result.dataloader)
    deepspeed = [result.model.train_batch(micro_batches).item() for _ in range(len(DS_LONGEST) // DS_GAS)]
    del result, micro_batches
    dist.barrier()
    return {"varying lengths": native, "schedules kept": cached, "varying lengths ds3d": deepspeed}


def _reference_on_varying_lengths() -> Tuple[List[float], List[float]]:
    """Plain training on the padded global batches; for DeepSpeed, on the mean of each step's micro-batch losses."""
    data = VarLenDataset(NATIVE_LONGEST, GLOBAL_BATCH)
    native = reference_losses(_model("llama"), [pad_to_longest([data[i] for i in range(k * GLOBAL_BATCH, (k + 1) *
                                                                                        GLOBAL_BATCH)])
                                                for k in range(len(NATIVE_LONGEST))], lr=LR)
    data = VarLenDataset(DS_LONGEST, DS_MICRO)
    micros = [pad_to_longest([data[i] for i in range(k * DS_MICRO, (k + 1) * DS_MICRO)])
              for k in range(len(DS_LONGEST))]
    deepspeed = reference_losses(_model("llama"), [micros[k:k + DS_GAS] for k in range(0, len(micros), DS_GAS)],
                                 lr=LR)
    return native, deepspeed


def _position_ids_first(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`batch` with position_ids 0..seq-1 of shape [1, seq], as its first key (one row standing for all)."""
    return {"position_ids": torch.arange(batch["input_ids"].shape[1]).unsqueeze(0), **{
        k: v for k, v in batch.items() if k != "position_ids"}}


def _reference(kind: str, layout: str) -> List[float]:
    """Plain training on each global batch unsplit, its loss the token mean over the whole batch; for Llama,
    also the loss of the next batch with `_position_ids_first`."""
    model = _model(kind)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    data, losses = Rows(layout), []

    def batch_of(step: int) -> Dict[str, torch.Tensor]:
        return default_collate([data[i] for i in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)])

    for step in range(STEPS):
        loss = model(**batch_of(step)).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if kind == "llama":
        with torch.no_grad():
            losses.append(model(**_position_ids_first(batch_of(STEPS))).loss.item())
    return losses


def test_pipeline_trains_on_position_ids_and_refuses_what_it_cannot_pass_on():
    results = run_distributed(_train, 2, timeout=300)
    last = next(r for r in results if r["stage"] == 1)      # the last stage computes the loss
    for kind, layout, _ in CASES:
        got = last[f"{kind}/{layout}"] + ([last["position_ids first"]] if kind == "llama" else [])
        assert_close_losses(got, _reference(kind, layout), rel=REL, what=f"{kind} {layout}")
    assert results[0]["position_ids first"] == last["position_ids first"]   # every stage returns the loss
    native, deepspeed = _reference_on_varying_lengths()
    for r in results:       # every stage returns the loss
        assert_close_losses(r["varying lengths"], native, rel=REL, what="native, varying lengths")
        assert r["schedules kept"] == 4, r["schedules kept"]        # 5 lengths seen, the cache is bounded
    assert_close_losses(last["varying lengths ds3d"], deepspeed, rel=REL, what="deepspeed_3d, varying lengths")
    for r in results:       # every rank raised both, the same
        tuple_error, key_error, deepspeed_error = r["errors"]
        assert "deepspeed_3d_parallel passes only ['input_ids', 'attention_mask', 'labels']" in deepspeed_error
        assert "dataset[0] also has ['position_ids']" in deepspeed_error, deepspeed_error
        assert "needs dict batches with 'input_ids' and 'labels'" in tuple_error, tuple_error
        assert "also has ['token_type_ids'], which the stages would never see" in key_error, key_error
        assert "['input_ids', 'attention_mask', 'position_ids', 'labels']" in key_error, key_error
