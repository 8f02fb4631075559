"""`lora` with `modules_to_save`: a sequence-classification head trained whole beside the adapters, 2 gloo ranks.

A head new for the task (what `from_pretrained` adds to fine-tune a classifier: random) must train, and LoRA
freezes the base model. peft trains a copy of each module named in `modules_to_save`. Checked: under DDP and
FSDP2 the losses are those of plain single-process training of the same peft model (3 AdamW steps, fp32, rel
1e-5 as test_opt_parity.py), the copy moves and the loaded head does not, and a checkpoint merged back to a
Hugging Face model loads with `from_pretrained` holding the trained head and the folded adapters.
"""

import copy
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import assert_close_losses, global_batches, reference_losses

pytestmark = pytest.mark.distributed

STEPS, BATCH, LR, REL, WORLD, LABELS = 3, 4, 1e-2, 1e-5, 2, 3
LORA = ("lora", {"modules_to_save": ["score"]})
STRATEGIES = {"ddp": ["parallel_mode", LORA], "fsdp": ["parallel_mode", LORA, "fsdp"]}
COPY, LOADED = "base_model.model.score.modules_to_save.default.weight", "base_model.model.score.original_module.weight"


class LabelDataset(Dataset):
    """Token sequences with a class label each (deterministic)."""

    def __init__(self, n: int, seq_len: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(4, 128, (n, seq_len), generator=g)
        self.labels = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.labels[i]}


def classifier() -> torch.nn.Module:
    from transformers import LlamaForSequenceClassification

    config = copy.deepcopy(tiny_llama().config)
    config.num_labels, config.pad_token_id = LABELS, 0
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _job(root: str) -> Dict[str, Any]:
    from atorch.auto import auto_accelerate, train_step
    from atorch.checkpoint import merge_checkpoint, save_checkpoint

    out: Dict[str, Any] = {}
    for name, strategy in STRATEGIES.items():
        status, result, _ = auto_accelerate(classifier(), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                            dataset=LabelDataset(STEPS * BATCH), dataloader_args={"batch_size": BATCH},
                                            load_strategy=strategy, ignore_dryrun_on_load_strategy=True)
        assert status, name
        losses: List[float] = []
        for _, batch in zip(range(STEPS), result.dataloader):
            loss = train_step(result, batch).detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / WORLD)
        params = dict(result.model.named_parameters())
        prefix = next(k for k in params if k.endswith(COPY))[:-len(COPY)]   # DDP's "module."
        out[name] = {"losses": losses, "copy": _full(params[prefix + COPY]), "loaded": _full(params[prefix + LOADED]),
                     "summary": result.summaries["lora"]}
        if name == "fsdp":
            path = save_checkpoint(result, os.path.join(root, name))
            if dist.get_rank() == 0:
                merge_checkpoint(path, os.path.join(root, "merged"))
        del result
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_saved"))
    return root, run_distributed(_job, WORLD, root, timeout=300)


def _reference() -> tuple:
    from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters

    model = add_lora_adapters(classifier(), LoraConfig(modules_to_save=("score",)))
    losses = reference_losses(model, global_batches(LabelDataset(STEPS * BATCH), BATCH, STEPS), lr=LR)
    return losses, model


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_saved_head_trains_like_one_process(runs, name):
    expected, reference = _reference()
    plain = reference_losses(classifier(), global_batches(LabelDataset(STEPS * BATCH), BATCH, STEPS), lr=LR)
    assert expected != plain, "the LoRA reference must differ from training the whole model"
    untouched = classifier().score.weight
    trained = dict(reference.named_parameters())[COPY]
    for rank_out in runs[1]:
        got = rank_out[name]
        assert got["summary"]["modules_to_save"] == ["score"]
        assert_close_losses(got["losses"], expected, rel=REL, what=name)
        assert torch.equal(got["loaded"], untouched), "the loaded head must stay as it was"
        assert not torch.allclose(got["copy"], untouched), "the head's trainable copy did not move"
        torch.testing.assert_close(got["copy"], trained.detach(), rtol=1e-4, atol=1e-6)


def test_the_merged_checkpoint_holds_the_trained_head(runs):
    from transformers import LlamaForSequenceClassification

    root, outs = runs
    merged, info = LlamaForSequenceClassification.from_pretrained(os.path.join(root, "merged"),
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(merged.score.weight, outs[0]["fsdp"]["copy"])
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
