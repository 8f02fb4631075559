"""The auto_accelerate contract around the optimizations, on 2 gloo ranks, one spawn:

- bad strategies (conflicts, unknown names and keys, malformed configs) raise the same
  ValueError on every rank before anything is applied (no parallel group exists after), and a
  bad strategy given to one rank only raises on both, naming the difference (the ranks vote);
- the three model_input_format values and a loss_func returning a sequence train exactly like
  the single-process reference (fp32, rel 1e-5), as does a call without a dataset where the
  user feeds each rank its share of the global batch;
- config variants of the sharding optimizations train exactly too: explicit `ddp` with its
  options, fsdp with cpu_offload and wrap_cls by name, and sync_module_states (fsdp, zero2)
  on ranks whose models were initialized with different seeds.
"""

import re
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from test_opt_parity import FP32_REL, GLOBAL_BATCH, LR, STEPS, WORLD, dataset, reference

from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import assert_close_losses, global_batches

VALID_FSDP_KEYS = r"\['wrap_cls', 'cpu_offload', 'sync_module_states', 'use_ds_zero', 'ds_config'\]"
BAD_STRATEGIES = {
    "zero1+zero2": (["zero1", "zero2"], r"optimizations 'zero1' and 'zero2' cannot be combined"),
    "zero2+fsdp": (["zero2", "fsdp"], r"optimizations 'fsdp' and 'zero2' cannot be combined"),
    "ddp+fsdp": (["ddp", "fsdp"], r"optimizations 'ddp' and 'fsdp' cannot be combined"),
    "half(fp16)+amp(bf16)": ([("half", {"dtype": torch.float16}), ("amp_native", {"dtype": torch.bfloat16})],
                             r"'half' \(dtype=float16\) and 'amp_native' \(dtype=bfloat16\) cannot be combined"),
    "ddp+zero1(ds)": (["ddp", ("zero1", {"use_ds_zero": True})],
                      r"'ddp' and 'zero1' cannot be combined: the DeepSpeed engine \(use_ds_zero=True\)"),
    "unknown name": (["fsdp", "zero3"], r"unknown optimization 'zero3'; valid names are \[.*'fsdp'.*'zero2'"),
    "unknown key": ([("fsdp", {"cpu_ofload": True})],
                    rf"fsdp: unknown config key\(s\) \['cpu_ofload'\]; valid keys are {VALID_FSDP_KEYS}"),
    "malformed bool": ([("fsdp", {"sync_module_states": "yes"})], r"sync_module_states='yes' must be True or False"),
    "malformed dtype": ([("amp_native", {"dtype": torch.float32})], r"dtype=torch.float32 is not supported"),
    "malformed config": ([("zero2", 2)], r"zero2: config 2 must be None, a dict with keys"),
}


class DictBatchLlama(nn.Module):
    """model_input_format=None: the model takes the batch dict as one argument."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.llama = tiny_llama(seed=seed)

    def forward(self, batch: Dict[str, torch.Tensor]) -> Any:
        return self.llama(**batch)


class SequenceBatchLlama(DictBatchLlama):
    """model_input_format="unpack_sequence": model(input_ids, labels); returns logits only."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=input_ids).logits


class TupleDataset(Dataset):
    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        item = self.base[i]
        return item["input_ids"], item["labels"]


def causal_lm_loss(batch, logits: torch.Tensor):
    """A user loss returning a sequence whose first item is the loss (Hugging Face's shift-by-one CE)."""
    _, labels = batch
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
    return loss, {"tokens": labels[:, 1:].numel()}


def _global_loss(loss: torch.Tensor) -> float:
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _train(model: nn.Module, strategy: List[Any], fmt, ds=None, loss_func=None) -> List[float]:
    status, result, _ = auto_accelerate(
        model, optim_func=torch.optim.AdamW, dataset=ds if ds is not None else dataset(), loss_func=loss_func,
        optim_args={"lr": LR}, model_input_format=fmt, dataloader_args={"batch_size": GLOBAL_BATCH},
        load_strategy=strategy)
    assert status, strategy
    losses = [_global_loss(train_step(result, batch)) for _, batch in zip(range(STEPS), result.dataloader)]
    del result
    dist.barrier()
    return losses


def _train_without_dataset() -> Dict[str, Any]:
    status, result, _ = auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                        model_input_format="unpack_dict", load_strategy=["fsdp"])
    assert status
    rank, share = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for batch in global_batches(dataset(), GLOBAL_BATCH, STEPS):
        local = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
        losses.append(_global_loss(train_step(result, local)))
    out = {"dataloader": result.dataloader, "losses": losses}
    del result
    dist.barrier()
    return out


def _error_messages() -> Dict[str, Any]:
    def message(strategy) -> str:
        try:
            auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=dataset(),
                            model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
                            load_strategy=strategy)
        except ValueError as e:
            return str(e)
        return "no error"

    out: Dict[str, Any] = {"all_ranks": {}}
    for name, (strategy, _) in BAD_STRATEGIES.items():
        out["all_ranks"][name] = message(strategy)
    # A bad strategy on rank 1 only, a valid one on rank 0: both raise the same error (rank 0 would
    # otherwise apply its strategy and wait in its first collective until the timeout).
    out["one_rank"] = message(["zero1"] if dist.get_rank() == 0 else ["zero1", "zero2"])
    out["groups_created"] = adist.is_parallel_group_created()
    return out


def _api_checks() -> Dict[str, Any]:
    out: Dict[str, Any] = {"errors": _error_messages()}  # first, before any parallel group exists
    rank = dist.get_rank()
    losses = {
        "format None": _train(DictBatchLlama(), ["fsdp"], None),
        "format unpack_sequence + sequence loss": _train(SequenceBatchLlama(), ["parallel_mode"], "unpack_sequence",
                                                         ds=TupleDataset(dataset()), loss_func=causal_lm_loss),
        "format unpack_dict + list loss": _train(tiny_llama(seed=0), ["zero1"], "unpack_dict",
                                                 loss_func=lambda batch, output: [output.loss, output.logits]),
        "ddp explicit": _train(tiny_llama(seed=0), ["ddp"], "unpack_dict"),
        "ddp with options": _train(tiny_llama(seed=0), [("ddp", {"bucket_cap_mb": 1, "find_unused_parameters": True})],
                                   "unpack_dict"),
        "fsdp cpu_offload": _train(tiny_llama(seed=0), [("fsdp", {"cpu_offload": True})], "unpack_dict"),
        "fsdp wrap_cls by name": _train(tiny_llama(seed=0), [("fsdp", {"wrap_cls": ["LlamaDecoderLayer", "LlamaMLP"]})],
                                        "unpack_dict"),
        # Rank 1's model starts from other weights: sync_module_states must replace them by rank 0's.
        "fsdp sync_module_states": _train(tiny_llama(seed=rank), [("fsdp", {"sync_module_states": True})],
                                          "unpack_dict"),
        "zero2 sync_module_states": _train(tiny_llama(seed=rank), [("zero2", {"sync_module_states": True})],
                                           "unpack_dict"),
    }
    out["losses"] = losses
    out["no_dataset"] = _train_without_dataset()
    return out


@pytest.fixture(scope="module")
def api_runs():
    return run_distributed(_api_checks, WORLD, timeout=600)


@pytest.mark.parametrize("name", list(BAD_STRATEGIES))
def test_bad_strategies_raise_on_every_rank_before_anything_is_applied(name, api_runs):
    pattern = BAD_STRATEGIES[name][1]
    messages = [runs["errors"]["all_ranks"][name] for runs in api_runs]
    for m in messages:
        assert re.search(pattern, m), f"{name}: {m!r} does not match {pattern!r}"
    assert len(set(messages)) == 1, messages
    assert not any(runs["errors"]["groups_created"] for runs in api_runs)


def test_a_bad_strategy_on_one_rank_only_raises_on_both(api_runs):
    messages = [runs["errors"]["one_rank"] for runs in api_runs]
    assert len(set(messages)) == 1, messages
    assert "given different load_strategy" in messages[0] and "zero1+zero2 on rank [1]" in messages[0]


@pytest.mark.parametrize("name", ["format None", "format unpack_sequence + sequence loss",
                                  "format unpack_dict + list loss", "ddp explicit", "ddp with options",
                                  "fsdp cpu_offload", "fsdp wrap_cls by name", "fsdp sync_module_states",
                                  "zero2 sync_module_states"])
def test_formats_and_config_variants_train_exactly(name, api_runs):
    expected = reference()
    for rank, runs in enumerate(api_runs):
        assert_close_losses(runs["losses"][name], expected, rel=FP32_REL, what=f"{name} (rank {rank})")


def test_without_a_dataset_the_user_feeds_batches(api_runs):
    for rank, runs in enumerate(api_runs):
        assert runs["no_dataset"]["dataloader"] is None
        assert_close_losses(runs["no_dataset"]["losses"], reference(), rel=FP32_REL, what=f"no dataset (rank {rank})")
