"""`auto_accelerate` without a strategy on models that are not decoder-only transformers, 2 gloo ranks.

- Mamba (a config without attention heads): the cost model has no formula for it, and the automatic mode
  failed before any dry run ("MambaConfig has none of ['num_attention_heads', 'n_head']"). It now searches
  on dry runs alone (no predicted column in the trial table).
- ViT (pixels in, a class out; no vocabulary): the cost model reads it without a token embedding.
- BERT with its tied masked-LM head: its embedding is no longer taken for a block, so the zero2 / fsdp
  candidates run (they raised inside torch's `fully_shard`).
Each: the same strategy on both ranks, every candidate of the search either ran or failed for a reason of
its own (none for a block / tie mix-up), and the chosen strategy trains 2 steps.
"""

from typing import Any, Dict

import pytest
import torch

from atorch.testing import run_distributed, tiny_bert_mlm

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

SEARCH_ENV = {"BO_SG_MAX_IETR": "6", "MAX_PATIENCE": "6", "RANDOM_SAMPLE": "2", "ATORCH_DRYRUN_WARMUP_STEP": "1",
              "ATORCH_DRYRUN_PROFILE_STEP": "2", "ATORCH_DRYRUN_MAX_STEPS": "4", "ATORCH_DRYRUN_TIMEOUT": "60",
              "ATORCH_SEARCH_CACHE": "off"}
# BERT's search must reach its sharded candidates: every candidate has zero2 (torch FSDP2 or DeepSpeed).
INCLUDED = {"bert": ["zero2"]}


class Samples(torch.utils.data.Dataset):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        if self.kind == "vit":
            return {"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": torch.randint(0, 4, (), generator=g)}
        ids = torch.randint(4, 100, (16,), generator=g)
        return {"input_ids": ids, "labels": ids}


def _model(kind: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification

    torch.manual_seed(0)
    if kind == "mamba":
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "mamba", vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2))
    if kind == "vit":
        return AutoModelForImageClassification.from_config(AutoConfig.for_model(
            "vit", image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=4))
    return tiny_bert_mlm()


def _search(kinds) -> Dict[str, Any]:
    import os

    import torch.distributed as dist

    from atorch.auto import auto_accelerate, train_step

    os.environ.update(SEARCH_ENV)
    out: Dict[str, Any] = {}
    for kind in kinds:
        status, result, strategy = auto_accelerate(_model(kind), optim_func=torch.optim.AdamW, dataset=Samples(kind),
                                                   optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8},
                                                   included=INCLUDED.get(kind))
        assert status, kind
        batches = iter(result.dataloader)
        losses = [float(train_step(result, next(batches))) for _ in range(2)]
        search = result.args.get("search_result")
        trials = search.trials if search is not None else None
        out[kind] = {"strategy": strategy.to_json(), "losses": losses,
                     "trials": None if trials is None else trials[["strategy", "status", "reason",
                                                                   "predicted_throughput"]].to_dict("records")}
        del result
        dist.barrier()
    return out


KINDS = ("mamba", "vit", "bert")


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_search, 2, KINDS, timeout=400)


@pytest.mark.parametrize("kind", KINDS)
def test_the_automatic_mode_searches_and_trains(runs, kind):
    assert runs[0][kind]["strategy"] == runs[1][kind]["strategy"]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in runs[0][kind]["losses"])
    trials = runs[0][kind]["trials"]
    assert trials, "rank 0 has the search's trial table"
    assert any(t["status"] == "ok" for t in trials)
    for t in trials:
        assert "shared with a parameter already managed" not in str(t["reason"]), t
    predicted = [t["predicted_throughput"] for t in trials]
    if kind == "mamba":
        assert all(p is None or p != p for p in predicted), predicted      # no cost model: nothing predicted
    else:
        assert all(p is not None and p == p for p in predicted), predicted


def test_bert_s_sharded_candidates_run(runs):
    ran = [t["strategy"] for t in runs[0]["bert"]["trials"] if t["status"] == "ok"]
    assert any("zero2" in s and "deepspeed" not in s for s in ran), runs[0]["bert"]["trials"]   # torch FSDP2
