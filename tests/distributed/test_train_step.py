"""`train_step` with gradient accumulation and clipping, on 2 gloo ranks, against plain training.

Every strategy trains 3 steps on the same global batches with `gradient_accumulation` (2
micro-batches per rank and step) and `max_grad_norm` clipping, and is compared with
single-process training on the whole global batch with `torch.nn.utils.clip_grad_norm_`:
one step on the concatenated batch. The clip norm is below the gradient norm of every
reference step (asserted), so clipping changes every update, and with SGD (whose update is
proportional to the gradient, unlike Adam's) a wrong norm or a missed scaling changes the
losses that follow.

FSDP2 reduce-scatters in every micro-step by default and DDP only in the last; each is also trained the
other way (`sync_each_micro_step`), with the same parity, and the sync is observed: DDP's bucket
reductions are counted, and FSDP2's gradients at the start of each micro-step are sharded or absent.

Tolerance rel 1e-5, fp32: the micro-batch losses are means over equal row counts, so the
accumulated gradient is the full-batch mean gradient up to the summation order (observed
differences ~1e-7, as in test_opt_parity.py); the norm is the same sum of squares over
shards, reduced in another order. One spawn of 2 ranks runs every strategy; a second of 4 ranks
(marked heavy) runs the 2D layouts, tensor parallel x FSDP2 and x DDP. With drop_last=False the
epoch's last, smaller batch (2 rows per rank at 4 micro-batches) trains like plain training on it.

`loss_weighting="tokens"` runs in the same spawns, on right-padded rows of very unequal lengths (the long
ones on data rank 0): losses, gradient norms and trained weights equal plain training on the global
batch's token mean (fp32, rel 1e-5; the weights' error is measured against the size of their update;
observed: losses 2e-7, norms 1.4e-6, weights 1.7e-6), while the default "rows" is off on the same data
(the update by 78%).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from atorch.auto import auto_accelerate
from atorch.auto.train_step import train_step_stats
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, global_batches

STEPS, GLOBAL_BATCH, LR, WORLD = 3, 8, 0.5, 2
ACCUMULATION = 2
MAX_NORM = 0.5
REL = 1e-5
LEARNABLE_VOCAB = 20
GA = ("gradient_accumulation", {"steps": ACCUMULATION})

STRATEGIES: Dict[str, List[Any]] = {
    "ddp": [GA],
    "zero1": [GA, "zero1"],
    "zero2(fsdp2)": [GA, "zero2"],
    "fsdp": [GA, "fsdp"],
    "tensor_parallel": [GA, ("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"],
    "pipeline": [GA, ("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), "pipeline_parallel"],
    "zero2(deepspeed)": [GA, ("zero2", {"use_ds_zero": True})],
    # The other side of each wrapper's default: FSDP2 reduce-scatters once a step (unsharded gradients in
    # between), DDP all-reduces every micro-step.
    "fsdp sync once": [("gradient_accumulation", {"steps": ACCUMULATION, "sync_each_micro_step": False}), "fsdp"],
    "ddp sync each": [("gradient_accumulation", {"steps": ACCUMULATION, "sync_each_micro_step": True})],
}


def dataset() -> TokenDataset:
    return TokenDataset(vocab_size=LEARNABLE_VOCAB)


@functools.lru_cache(maxsize=None)
def reference() -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    return _plain_training(global_batches(dataset(), GLOBAL_BATCH, STEPS))


def _plain_training(batches: List[Dict[str, torch.Tensor]]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """(losses, gradient norms before clipping) of plain training on whole global batches."""
    losses, norms, _ = _plain_training_model(batches)
    return losses, norms


def _plain_training_model(batches: List[Dict[str, torch.Tensor]]) -> Tuple[Tuple[float, ...], Tuple[float, ...],
                                                                            torch.nn.Module]:
    """`_plain_training`, also returning the trained model."""
    model = tiny_llama(seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return tuple(losses), tuple(norms), model


def _global_loss(loss: torch.Tensor, result: Any) -> float:
    # Per-rank losses are means over the rank's data shard; ranks of one data replica hold the same.
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _count_ddp_reductions(model: Any) -> List[int]:
    """Count DDP bucket all-reduces (a comm hook that forwards to the default all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    calls: List[int] = []
    if isinstance(model, DistributedDataParallel):
        def hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        model.register_comm_hook(model.process_group, hook)   # the "data" group (not WORLD: 2D layouts)
    return calls


def _record_gradients_at_each_forward(model: Any) -> List[Tuple[int, int]]:
    """(gradient elements this rank holds, parameter elements in all) at the start of every forward:
    what the earlier micro-steps of a step left behind."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    seen: List[Tuple[int, int]] = []
    params = list(model.parameters())

    def hook(module, args, kwargs=None):
        held = sum(local(p.grad).numel() for p in params if p.grad is not None)
        seen.append((held, sum(p.numel() for p in params)))

    model.register_forward_pre_hook(hook)
    return seen


def _train(strategy: List[Any]) -> Dict[str, Any]:
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, f"auto_accelerate returned status=False for {strategy}"
    reductions = _count_ddp_reductions(result.model)
    grads_at_forward = _record_gradients_at_each_forward(result.model)
    losses, norms = [], []
    for _, batch in zip(range(STEPS), result.dataloader):
        stats = train_step_stats(result, batch, max_grad_norm=MAX_NORM)
        assert stats.micro_batches == ACCUMULATION
        losses.append(_global_loss(stats.loss, result))
        norms.append(float(stats.grad_norm))
    out = {"losses": losses, "norms": norms, "ddp_reductions": reductions, "grads_at_forward": grads_at_forward,
           "ddp": type(result.model).__name__ == "DistributedDataParallel"}
    _release(result)
    del result
    return out


# 2D on 4 ranks: tensor-parallel slices inside FSDP2 shards (a gradient reduced over both groups), and
# tensor parallelism under DDP (replicated over "data", sliced over "tensor").
TWO_D = ("parallel_mode", ([("tensor", 2), ("data", 2)], None))
STRATEGIES_2D: Dict[str, List[Any]] = {
    "tensor x fsdp": [GA, TWO_D, "tensor_parallel", "fsdp"],
    "tensor x ddp": [GA, TWO_D, "tensor_parallel"],
}


# The epoch's last, smaller batch with drop_last=False: 20 samples in global batches of 8 (8, 8, then 4:
# 2 rows per rank, which do not split into 4 micro-batches); each micro-batch's loss is weighted by its
# share of the rows. Found by the combination sweep: it raised at the end of every epoch.
LAST_SAMPLES, LAST_ACCUMULATION = 20, 4
LAST_BATCH_STRATEGIES: Dict[str, List[Any]] = {
    "last batch ddp": [("gradient_accumulation", {"steps": LAST_ACCUMULATION})],
    "last batch fsdp": [("gradient_accumulation", {"steps": LAST_ACCUMULATION}), "fsdp"],
    "last batch zero2(deepspeed)": [("gradient_accumulation", {"steps": LAST_ACCUMULATION}),
                                    ("zero2", {"use_ds_zero": True})],
}


# A pipeline's schedule fixes its micro-batch shapes at its first step: the last batch (4 rows in 2 chunks
# of 2, after chunks of 4) gets a schedule of its own. It crashed in the loss ("Expected input batch_size").
LAST_BATCH_PIPELINE = [("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), ("pipeline_parallel", {"chunks": 2})]


@functools.lru_cache(maxsize=None)
def reference_last_batch() -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    data = TokenDataset(n=LAST_SAMPLES, vocab_size=LEARNABLE_VOCAB)
    batches = []
    for start in range(0, LAST_SAMPLES, GLOBAL_BATCH):
        items = [data[i] for i in range(start, min(start + GLOBAL_BATCH, LAST_SAMPLES))]
        batches.append({key: torch.stack([it[key] for it in items]) for key in items[0]})
    return _plain_training(batches)


def _train_last_batch(strategy: List[Any]) -> Dict[str, Any]:
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, optim_args={"lr": LR}, model_input_format="unpack_dict",
        dataset=TokenDataset(n=LAST_SAMPLES, vocab_size=LEARNABLE_VOCAB),
        dataloader_args={"batch_size": GLOBAL_BATCH, "drop_last": False}, load_strategy=strategy)
    assert status, f"auto_accelerate returned status=False for {strategy}"
    losses, norms, micro = [], [], []
    for batch in result.dataloader:
        stats = train_step_stats(result, batch, max_grad_norm=MAX_NORM)
        losses.append(_global_loss(stats.loss, result))
        norms.append(float(stats.grad_norm))
        micro.append(stats.micro_batches)
    _release(result)
    del result
    return {"losses": losses, "norms": norms, "micro_batches": micro}


def _release(result: Any) -> None:
    """Destroy a DeepSpeed engine the result holds, then wait for every rank."""
    engine = result.args.get("engine")
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    dist.barrier()


def _tensor_peers_fed_different_batches() -> Dict[str, Any]:
    """Tensor peers given different rows (a DistributedSampler over the world, say): every rank raises the
    same error at the first step, before training on a mix of the two."""
    _, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
        load_strategy=STRATEGIES["tensor_parallel"])
    batch = next(iter(result.dataloader))
    rows = {k: v.roll(dist.get_rank(), dims=0) for k, v in batch.items()}   # rank 1: the rows in another order
    try:
        train_step_stats(result, rows)
        error = None
    except ValueError as e:
        error = str(e)
    del result
    dist.barrier()
    return {"error": error}


def _data_ranks_fed_one_batch() -> Dict[str, Any]:
    """Both DDP ranks given the whole global batch (a loader of the user's own without a sampler): it trains, like
    one replica at the cost of two; rank 0 warns once, at the first step. Then each rank its own rows: no warning."""
    import logging

    _, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
        load_strategy=STRATEGIES["ddp"])
    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())     # type: ignore[method-assign]
    logging.getLogger("atorch.auto.train_step").addHandler(handler)
    try:
        whole = global_batches(dataset(), GLOBAL_BATCH, 1)[0]
        train_step_stats(result, whole)
        train_step_stats(result, whole)
        same = list(records)
        records.clear()
        _, own, _ = auto_accelerate(
            tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
            model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
            load_strategy=STRATEGIES["ddp"])
        train_step_stats(own, next(iter(own.dataloader)))
    finally:
        logging.getLogger("atorch.auto.train_step").removeHandler(handler)
    del result, own
    dist.barrier()
    return {"same": same, "own": list(records)}


def _a_bad_first_batch_on_one_rank() -> Dict[str, Any]:
    """FSDP2 where rank 1's first batch holds a token id beyond the vocabulary: the first call's checks are voted
    on, so both ranks raise the same error (rank 0 used to wait in the forward's all-gather until the collective
    timeout). Then a good batch trains."""
    _, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=["fsdp"])
    batch = next(iter(result.dataloader))
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    if dist.get_rank() == 1:
        bad["input_ids"][0, 0] = 10 ** 6
    try:
        train_step_stats(result, bad)
        error = None
    except ValueError as e:
        error = f"{type(e).__name__}: {e}"
    loss = float(train_step_stats(result, batch).loss)
    del result
    dist.barrier()
    return {"error": error, "loss": loss}


def _nan_losses() -> Dict[str, Any]:
    """FSDP2 on 2 ranks, two kinds of nan loss on rank 1.

    Its rows with only -100 labels: the model's token mean is 0/0 = nan with a zero gradient, so the step trains
    on rank 0's rows; rank 1 warns, naming the cause. A loss_func that divides by 0 on rank 1's batch: its
    gradient is inf/nan and the reduce-scatter spreads it to every shard. With max_grad_norm the global norm is
    nan on every rank, so every rank raises the same FloatingPointError before the optimizer and nothing
    changes; without it the step goes ahead (every parameter turns nan) and rank 1 warns."""
    import logging

    def setup(loss_func: Any) -> Tuple[Any, Dict[str, torch.Tensor]]:
        _, result, _ = auto_accelerate(
            tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=dataset(), optim_args={"lr": LR},
            model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=["fsdp"],
            loss_func=loss_func)
        return result, next(iter(result.dataloader))

    def weights(result: Any) -> List[torch.Tensor]:
        return [p.detach().full_tensor().clone() for p in result.model.parameters()]

    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())     # type: ignore[method-assign]
    logging.getLogger("atorch.auto.train_step").addHandler(handler)
    out: Dict[str, Any] = {}
    try:
        result, batch = setup(None)
        if dist.get_rank() == 1:
            batch = dict(batch, labels=torch.full_like(batch["labels"], -100))
        out["no label loss"] = float(train_step_stats(result, batch).loss)
        out["no label finite after"] = all(bool(w.isfinite().all()) for w in weights(result))
        out["no label warned"], records[:] = list(records), []

        # A loss of the user's that divides by the smallest label: 0 on rank 1 (token 0 is in the vocabulary).
        result, batch = setup(lambda batch, output: output.loss / batch["labels"].min())
        if dist.get_rank() == 1:
            batch = dict(batch, labels=batch["labels"].clamp(max=0))
        before = weights(result)
        try:
            train_step_stats(result, batch, max_grad_norm=MAX_NORM)
            out["refused"] = None
        except FloatingPointError as e:
            out["refused"] = str(e)
        out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, weights(result)))
        out["cleared"] = all(p.grad is None for p in result.model.parameters())
        out["refused warned"], records[:] = list(records), []
        train_step_stats(result, batch)
        out["nan after"] = any(bool(w.isnan().any()) for w in weights(result))
        out["warned"] = list(records)
    finally:
        logging.getLogger("atorch.auto.train_step").removeHandler(handler)
    del result
    dist.barrier()
    return out


class PaddedTokenDataset(TokenDataset):
    """TokenDataset rows right-padded to `PADDED_LENGTHS[i % 8]` real tokens (pad id 3, labels -100, attention 0).

    Global batches of 8 go to 2 data ranks as the even and the odd samples (DistributedSampler, no shuffle):
    data rank 0 gets the long rows (15 + 15 and then 7 + 4 predicted tokens in its 2 micro-batches), rank 1
    the short ones (2 + 2 and 2 + 2)."""

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        real = torch.arange(item["input_ids"].shape[0]) < PADDED_LENGTHS[i % GLOBAL_BATCH]
        return {"input_ids": item["input_ids"].masked_fill(~real, 3), "attention_mask": real.long(),
                "labels": item["labels"].masked_fill(~real, -100)}


PADDED_LENGTHS = (16, 3, 16, 3, 8, 3, 5, 3)
TOKEN_STRATEGIES: Dict[str, List[Any]] = {
    "tokens ddp": STRATEGIES["ddp"],
    "tokens zero1": STRATEGIES["zero1"],
    "tokens fsdp": STRATEGIES["fsdp"],
    "tokens zero2(deepspeed)": STRATEGIES["zero2(deepspeed)"],
    "tokens pipeline": STRATEGIES["pipeline"],
}
# The default weighting on the same data: what "tokens" fixes.
ROW_STRATEGIES: Dict[str, List[Any]] = {"rows ddp": STRATEGIES["ddp"]}
# 4 ranks: tensor peers share a batch and are not counted twice; the pipeline's data ranks weigh by their tokens.
TOKEN_STRATEGIES_2D: Dict[str, List[Any]] = {
    "tokens tensor x ddp": STRATEGIES_2D["tensor x ddp"],
    "tokens pipeline x data": [GA, ("parallel_mode", ([("data", 2), ("pipeline", 2)], None)), "pipeline_parallel"],
}


def padded_dataset() -> PaddedTokenDataset:
    return PaddedTokenDataset(vocab_size=LEARNABLE_VOCAB)


@functools.lru_cache(maxsize=None)
def reference_tokens() -> Tuple[Tuple[float, ...], Tuple[float, ...], Dict[str, torch.Tensor]]:
    """Plain training on the padded global batches: the model's loss is the global batch's token mean."""
    losses, norms, model = _plain_training_model(global_batches(padded_dataset(), GLOBAL_BATCH, STEPS))
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


def _trained_weights(result: Any) -> Dict[str, torch.Tensor]:
    """The parameters this rank holds whole, by the model's own names (a pipeline stage's only; FSDP2's
    DTensors gathered, a collective every rank joins in the same order)."""
    from torch.distributed.tensor import DTensor

    model = result.pipeline.stage_module if result.pipeline is not None else result.model
    model = getattr(model, "module", model)       # DDP, DeepSpeed engines
    out = {}
    for name, p in model.named_parameters():
        value = p.detach()
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu()
    return out


def _update_error(weights: Dict[str, torch.Tensor]) -> float:
    """|trained - reference| / |reference - initial| over the weights given: the error relative to the update."""
    _, _, reference = reference_tokens()
    initial = dict(tiny_llama(seed=0).named_parameters())
    assert weights and set(weights) <= set(reference), sorted(set(weights) - set(reference))
    diff = sum(float((weights[n] - reference[n]).pow(2).sum()) for n in weights)
    update = sum(float((reference[n] - initial[n].detach()).pow(2).sum()) for n in weights)
    return (diff / update) ** 0.5


def _train_weighted(strategy: List[Any], loss_weighting: str, compare_weights: bool = True) -> Dict[str, Any]:
    """3 clipped steps of `loss_weighting` on the padded batches; losses as train_step reports them."""
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.SGD, dataset=padded_dataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, f"auto_accelerate returned status=False for {strategy}"
    losses, norms = [], []
    for _, batch in zip(range(STEPS), result.dataloader):
        stats = train_step_stats(result, batch, max_grad_norm=MAX_NORM, loss_weighting=loss_weighting)
        # "tokens" reports the global token mean on every rank; "rows" this rank's mean, averaged here.
        losses.append(float(stats.loss) if loss_weighting == "tokens" else _global_loss(stats.loss, result))
        norms.append(float(stats.grad_norm))
    error = _update_error(_trained_weights(result)) if compare_weights else None
    _release(result)
    del result
    return {"losses": losses, "norms": norms, "update_error": error}


def _train_all() -> Dict[str, Dict[str, Any]]:
    out = {name: _train(strategy) for name, strategy in STRATEGIES.items()}
    out["tensor peers fed different batches"] = _tensor_peers_fed_different_batches()
    out["data ranks fed one batch"] = _data_ranks_fed_one_batch()
    out["nan losses"] = _nan_losses()
    out["a bad first batch on one rank"] = _a_bad_first_batch_on_one_rank()
    out.update({name: _train_last_batch(strategy) for name, strategy in LAST_BATCH_STRATEGIES.items()})
    out["last batch pipeline"] = _train_last_batch(LAST_BATCH_PIPELINE)
    out.update({name: _train_weighted(strategy, "tokens") for name, strategy in TOKEN_STRATEGIES.items()})
    out.update({name: _train_weighted(strategy, "rows") for name, strategy in ROW_STRATEGIES.items()})
    return out


def _train_all_2d() -> Dict[str, Dict[str, Any]]:
    out = {name: _train(strategy) for name, strategy in STRATEGIES_2D.items()}
    # Tensor-parallel weights are slices: compared through the losses and the global gradient norms.
    out.update({name: _train_weighted(strategy, "tokens", compare_weights="pipeline" in name)
                for name, strategy in TOKEN_STRATEGIES_2D.items()})
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train_all, WORLD, timeout=600)


@pytest.fixture(scope="module")
def runs_2d():
    return run_distributed(_train_all_2d, 4, timeout=600)


def test_reference_clips_every_step():
    _, norms = reference()
    assert all(n > 1.5 * MAX_NORM for n in norms), norms


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_accumulated_and_clipped_step_matches_one_plain_step(name, runs):
    _check(name, runs)


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(STRATEGIES_2D))
def test_2d_accumulated_and_clipped_step_matches_one_plain_step(name, runs_2d):
    _check(name, runs_2d)


def _check(name: str, runs: List[Dict[str, Dict[str, Any]]]) -> None:
    losses, norms = reference()
    for rank, per_rank in enumerate(runs):
        run = per_rank[name]
        for step in range(STEPS):
            assert run["norms"][step] == pytest.approx(norms[step], rel=REL), (name, rank, step, run["norms"], norms)
            assert run["losses"][step] == pytest.approx(losses[step], rel=REL), (name, rank, step, run["losses"],
                                                                                 losses)


@pytest.mark.parametrize("name", list(LAST_BATCH_STRATEGIES))
def test_the_epochs_smaller_last_batch_accumulates_weighted_micro_batches(name, runs):
    losses, norms = reference_last_batch()
    assert len(losses) == 3
    for rank, per_rank in enumerate(runs):
        run = per_rank[name]
        assert run["micro_batches"] == [LAST_ACCUMULATION, LAST_ACCUMULATION, 2], (name, rank, run)
        assert run["losses"] == pytest.approx(list(losses), rel=REL), (name, rank, run["losses"], losses)
        assert run["norms"] == pytest.approx(list(norms), rel=REL), (name, rank, run["norms"], norms)


def test_a_pipeline_trains_the_epochs_smaller_last_batch_like_one_process(runs):
    losses, norms = reference_last_batch()
    for rank, per_rank in enumerate(runs):
        run = per_rank["last batch pipeline"]
        assert run["losses"] == pytest.approx(list(losses), rel=REL), (rank, run["losses"], losses)
        assert run["norms"] == pytest.approx(list(norms), rel=REL), (rank, run["norms"], norms)


def test_tensor_peers_fed_different_batches_raise_on_every_rank(runs):
    errors = [per_rank["tensor peers fed different batches"]["error"] for per_rank in runs]
    assert errors[0] is not None and errors == [errors[0]] * len(runs), errors
    assert "ranks [0, 1] hold one model replica together (tensor peers)" in errors[0]
    assert "iterate result.dataloader" in errors[0]


def test_data_ranks_fed_the_same_batch_are_warned_about_once(runs):
    warned = [m for m in runs[0]["data ranks fed one batch"]["same"] if "were given the same batch" in m]
    assert len(warned) == 1, runs[0]["data ranks fed one batch"]
    assert warned[0].startswith("train_step: all 2 data-parallel replicas were given the same batch at the first step")
    assert not any("same batch" in m for m in runs[1]["data ranks fed one batch"]["same"])   # rank 0 says it
    assert not any("same batch" in m for per_rank in runs for m in per_rank["data ranks fed one batch"]["own"])


def test_a_bad_first_batch_on_one_rank_raises_the_same_error_on_every_rank(runs):
    outs = [per_rank["a bad first batch on one rank"] for per_rank in runs]
    assert outs[0]["error"] is not None and outs[1]["error"] == outs[0]["error"], outs
    assert outs[0]["error"].startswith("UserValueError: train_step: checking the first batch failed on rank [1]: "
                                       "train_step: batch['input_ids'] holds token id 1000000"), outs
    assert all(math.isfinite(o["loss"]) for o in outs), outs


def test_a_nan_gradient_norm_refuses_the_step_on_every_rank(runs):
    outs = [per_rank["nan losses"] for per_rank in runs]
    assert all(o["refused"] is not None for o in outs), outs
    assert outs[0]["refused"].startswith("train_step: the global gradient norm is nan (rank 0's loss: ")
    assert outs[1]["refused"].startswith("train_step: the global gradient norm is nan (rank 1's loss: inf), ")
    said = [o["refused"].split("), ", 1)[1] for o in outs]     # the same but for the rank's own loss
    assert said[0] == said[1] and "optimizer state and learning-rate schedule are unchanged on every rank" in said[0]
    assert all(o["unchanged"] and o["cleared"] for o in outs), outs
    assert not any(o["refused warned"] for o in outs), outs


def test_a_nan_loss_without_clipping_is_warned_about_by_its_rank(runs):
    outs = [per_rank["nan losses"] for per_rank in runs]
    assert all(o["nan after"] for o in outs), "without max_grad_norm the step goes ahead: the warning is all there is"
    assert not outs[0]["warned"] and len(outs[1]["warned"]) == 1, outs   # rank 0's loss is finite
    assert outs[1]["warned"][0].startswith("train_step: rank 1's loss is inf at this step. Without max_grad_norm")


def test_a_micro_batch_without_label_tokens_is_named_as_the_nan_loss_cause(runs):
    outs = [per_rank["nan losses"] for per_rank in runs]
    assert math.isnan(outs[1]["no label loss"]) and math.isfinite(outs[0]["no label loss"]), outs
    assert all(o["no label finite after"] for o in outs), "its gradient is zero: the step trains on the other rows"
    assert not outs[0]["no label warned"] and len(outs[1]["no label warned"]) == 1, outs
    assert outs[1]["no label warned"][0].startswith("train_step: rank 1's loss is nan at this step because a "
                                                    "micro-batch of its batch has no label token")


def test_ddp_skips_the_gradient_sync_of_non_final_micro_steps(runs):
    for per_rank in runs:
        run = per_rank["ddp"]
        assert run["ddp"]
        buckets = max(run["ddp_reductions"]) + 1
        # One reduction per bucket and optimizer step (without no_sync: one per micro-step).
        assert len(run["ddp_reductions"]) == STEPS * buckets, run["ddp_reductions"]
        # ... unless asked to sync every micro-step.
        each = per_rank["ddp sync each"]["ddp_reductions"]
        assert len(each) == STEPS * buckets * ACCUMULATION, each


def test_fsdp2_accumulates_sharded_gradients_unless_told_to_sync_once(runs):
    """By default FSDP2 reduce-scatters every micro-step: the second micro-step starts with this rank's
    shards of the first one's gradients (1/WORLD of the elements). With sync_each_micro_step=False
    FSDP2 keeps the unsharded gradients inside its units until the last micro-step: no `.grad` yet."""
    for per_rank in runs:
        for name in ("fsdp", "zero2(fsdp2)"):
            seen = per_rank[name]["grads_at_forward"]
            assert len(seen) == STEPS * ACCUMULATION, seen
            for step in range(STEPS):
                first, second = seen[step * ACCUMULATION], seen[step * ACCUMULATION + 1]
                assert first[0] == 0, (name, seen)       # zero_grad(set_to_none=True) after each step
                held, total = second
                assert total / WORLD <= held < total / WORLD * 1.05, (name, seen)   # shards, padded
        once = per_rank["fsdp sync once"]["grads_at_forward"]
        assert len(once) == STEPS * ACCUMULATION and all(held == 0 for held, _ in once), once


@pytest.mark.parametrize("name", list(TOKEN_STRATEGIES) + [pytest.param(name, marks=pytest.mark.heavy)
                                                              for name in TOKEN_STRATEGIES_2D])
def test_weighting_by_tokens_trains_as_one_process_on_the_global_token_mean(name, request):
    """The 2-rank strategies, and (heavy) the 4-rank tensor x data and pipeline x data ones."""
    runs = request.getfixturevalue("runs_2d" if name in TOKEN_STRATEGIES_2D else "runs")
    losses, norms, _ = reference_tokens()
    for rank, per_rank in enumerate(runs):
        run = per_rank[name]
        assert run["losses"] == pytest.approx(list(losses), rel=REL), (name, rank, run["losses"], losses)
        assert run["norms"] == pytest.approx(list(norms), rel=REL), (name, rank, run["norms"], norms)
        assert run["update_error"] is None or run["update_error"] < REL, (name, rank, run["update_error"])


def test_weighting_by_rows_is_off_on_the_same_padded_batches(runs):
    """The default on the same data: each rank's and micro-batch's token mean counts alike, so the short
    rows' few tokens weigh as much as the long rows' many (what "tokens" fixes)."""
    losses, norms, _ = reference_tokens()
    for per_rank in runs:
        run = per_rank["rows ddp"]
        assert run["update_error"] > 0.1, run["update_error"]
        assert run["norms"][0] != pytest.approx(norms[0], rel=1e-2), (run["norms"], norms)
        assert run["losses"][1:] != pytest.approx(list(losses)[1:], rel=1e-3), (run["losses"], losses)
