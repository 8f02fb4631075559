"""A pipeline stage whose optimizer has fewer parameter groups than another stage's.

A common `optim_param_func` gives the embedding its own learning rate and leaves out a group with no
parameter (DeepSpeed refuses empty groups): on a 2-stage pipeline, stage 0 then has three groups
(embedding, decay, no-decay) and stage 1 two (decay, no-decay). The checkpoint records which parameters
were grouped together; merged by group index, stage 1's decay group joined stage 0's embedding group, and
loading the checkpoint into one process grouped exactly like the pipeline was refused as "grouped
differently". Here the one process loads it with the pipeline's hyperparameters per group and continues
like the pipeline, the pipeline resumes from it exactly, and an optimizer grouped otherwise is still refused.
"""

import os

import pytest
import torch
import torch.distributed as dist

from atorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from atorch.testing import run_distributed, tiny_llama, tiny_llama_config
from atorch.testing.parity import TokenDataset, global_batches

pytestmark = pytest.mark.heavy

LAYERS, LR, EMBED_LR, BATCH, STEPS, SAVE_AT = 4, 1e-3, 5e-3, 8, 4, 2


def stage_groups(model: torch.nn.Module) -> list:
    """Embedding (its own lr), decay, no-decay (norms): empty groups left out."""
    embed, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        (embed if "embed_tokens" in name else no_decay if "norm" in name else decay).append(p)
    groups = [{"params": embed, "lr": EMBED_LR}, {"params": decay, "weight_decay": 0.1},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _pipeline_saves(root: str) -> dict:
    from atorch.auto import auto_accelerate, train_step
    from atorch.utils.meta_model_utils import record_module_init
    from transformers import LlamaForCausalLM

    def build():
        with record_module_init():
            model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=LAYERS))
        status, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                            optim_param_func=stage_groups, dataset=TokenDataset(),
                                            dataloader_args={"batch_size": BATCH},
                                            load_strategy=[("parallel_mode", ([("pipeline", 2)], None)),
                                                           ("pipeline_parallel", {"chunks": 2})])
        assert status
        return result

    result = build()
    groups = len(result.optim.param_groups)
    loader, losses = iter(result.dataloader), []
    for step in range(STEPS):
        if step == SAVE_AT:
            path = save_checkpoint(result, os.path.join(root, f"step_{SAVE_AT}"), step=SAVE_AT)
        losses.append(float(train_step(result, next(loader))))
    del result
    dist.barrier()
    # The same layout resumes from it (each stage's groups against the recorded ones).
    result = build()
    state = load_checkpoint(result, path)
    loader = iter(state.dataloader)
    resumed = [float(train_step(result, next(loader))) for _ in range(STEPS - SAVE_AT)]
    del result, state
    dist.barrier()
    return {"groups": groups, "losses": losses, "resumed": resumed, "path": path}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_pipeline_saves, 2, str(tmp_path_factory.mktemp("stage_groups")), timeout=300)


def test_stages_with_different_group_counts_load_into_one_process_grouped_the_same(runs):
    assert [r["groups"] for r in runs] == [3, 2]        # the embedding's group exists on stage 0 only
    for r in runs:
        assert r["resumed"] == r["losses"][SAVE_AT:], r   # the pipeline itself resumes exactly
    path = runs[0]["path"]
    model = tiny_llama(seed=5, num_hidden_layers=LAYERS)
    optim = torch.optim.AdamW(stage_groups(model), lr=LR)
    state = load_checkpoint(model, path, optimizer=optim)
    assert state.optimizer_restored
    assert [g["lr"] for g in optim.param_groups] == [EMBED_LR, LR, LR]
    # The pipeline's next steps in one process (the same global batches; the last stage's losses), within the
    # pipeline parity bound (micro-batch sums, Adam's normalization of near-zero gradients).
    losses = []
    for batch in global_batches(TokenDataset(), BATCH, STEPS)[SAVE_AT:]:
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    expected = runs[-1]["losses"][SAVE_AT:]
    for a, e in zip(losses, expected):
        assert abs(a - e) <= 1e-4 * abs(e), (losses, expected)


def test_an_optimizer_grouped_otherwise_is_still_refused(runs):
    model = tiny_llama(seed=5, num_hidden_layers=LAYERS)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)       # one group where the pipeline had three
    with pytest.raises(CheckpointError, match="is in param group 0 of this optimizer but was saved in group"):
        load_checkpoint(model, runs[0]["path"], optimizer=optim)
