"""Stage planning: optimal contiguous splits, pieces per stage, balance of the tiny models (pure, on meta)."""

import itertools
import random

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from atorch.modules.pipeline import balanced_split, expand_patcher, get_custom_patcher, plan_stages, \
    stage_parameter_counts
from atorch.modules.pipeline.partition import embedding_paths, uniform_split
from atorch.testing import tiny_gpt2_config, tiny_llama_config


def _meta(kind, layers=4):
    with torch.device("meta"):
        if kind == "llama":
            return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
        return GPT2LMHeadModel(tiny_gpt2_config(n_layer=layers))


def _brute_force_best(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        cost = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(parts))
        best = cost if best is None else min(best, cost)
    return best


def test_balanced_split_is_optimal_and_contiguous():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        weights = [rng.randint(0, 20) for _ in range(n)]
        parts = rng.randint(1, n)
        bounds = balanced_split(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == parts + 1
        assert all(bounds[i] < bounds[i + 1] for i in range(parts)), (weights, parts, bounds)  # non-empty
        cost = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(parts))
        assert cost == _brute_force_best(weights, parts), (weights, parts, bounds)


def test_balanced_split_known_cases():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_split([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert uniform_split(5, 2) == [0, 3, 5]
    assert uniform_split(4, 4) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("split", [balanced_split, lambda w, p: uniform_split(len(w), p)])
def test_split_rejects_more_parts_than_items(split):
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4 non-empty stages"):
        split([1, 1, 1], 4)
    with pytest.raises(ValueError, match="cannot split 3 blocks into 0"):
        split([1, 1, 1], 0)


def test_llama_plan_puts_embedding_first_and_head_last():
    model = _meta("llama")
    pieces = expand_patcher(model, get_custom_patcher(model))
    assert [p.path for p in pieces] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                                        "model.layers.3", "model.norm", "lm_head"]
    plan = plan_stages(model, pieces, 2)
    assert [p.path for p in plan.stage_pieces(0)] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert [p.path for p in plan.stage_pieces(1)] == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    plan4 = plan_stages(model, pieces, 4)
    assert [len(plan4.stage_pieces(s)) for s in range(4)] == [2, 1, 1, 3]
    assert plan4.stage_of(0) == 0 and plan4.stage_of(6) == 3


def test_gpt2_pieces_split_token_and_position_embeddings():
    model = _meta("gpt2")
    pieces = expand_patcher(model, get_custom_patcher(model))
    assert [p.kind for p in pieces] == ["pre"] * 3 + ["block"] * 4 + ["post"] * 2
    plan = plan_stages(model, pieces, 4, method="uniform")
    assert [p.path for p in plan.stage_pieces(0)] == ["transformer.wte", "transformer.wpe", "transformer.drop",
                                                      "transformer.h.0"]
    assert embedding_paths(model, pieces) == ["transformer.wte", "transformer.wpe", "lm_head"]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_balanced_excluding_embeddings(kind, stages):
    model = _meta(kind)
    pieces = expand_patcher(model, get_custom_patcher(model))
    plan = plan_stages(model, pieces, stages)
    counts = stage_parameter_counts(model, plan, excluded_paths=embedding_paths(model, pieces))
    assert max(counts) / min(counts) <= 1.5, counts
    # Every parameter is counted once overall when embeddings are included (tied head included once per stage).
    with_emb = stage_parameter_counts(model, plan, include_embeddings=True)
    assert sum(with_emb) >= sum(p.numel() for p in model.parameters())


def test_plan_rejects_more_stages_than_blocks_and_unknown_method():
    model = _meta("llama", layers=2)
    pieces = expand_patcher(model, get_custom_patcher(model))
    with pytest.raises(ValueError, match="pipeline size 3 is larger than the number of transformer blocks 2"):
        plan_stages(model, pieces, 3)
    with pytest.raises(ValueError, match="partition_method='profile'; valid methods are"):
        plan_stages(model, pieces, 2, method="profile")


@pytest.mark.parametrize("frozen", [range(4), range(2), range(2, 4)])
def test_frozen_blocks_weigh_as_much_as_trainable_ones(frozen):
    """A frozen block still runs its forward and passes activation gradients back: the "parameters" split
    counts every parameter, so freezing blocks (before LoRA, or a fine-tuning recipe) does not move them."""
    model = _meta("llama")
    pieces = expand_patcher(model, get_custom_patcher(model))
    expected = [[p.path for p in plan_stages(model, pieces, s).pieces] for s in (2, 4)]
    bounds = [plan_stages(model, pieces, s).bounds for s in (2, 4)]
    for i in frozen:
        model.model.layers[i].requires_grad_(False)
    assert [plan_stages(model, pieces, s).bounds for s in (2, 4)] == bounds == [(0, 3, 7), (0, 2, 3, 4, 7)]
    assert [[p.path for p in plan_stages(model, pieces, s).pieces] for s in (2, 4)] == expected
    # The trainable counts per stage still see the freezing (validation refuses a stage with none).
    counts = stage_parameter_counts(model, plan_stages(model, pieces, 4), include_embeddings=True)
    assert [c == 0 for c in counts] == [False, 1 in frozen, 2 in frozen, False]


def test_balanced_split_gives_ties_to_the_later_parts():
    assert balanced_split([1, 1, 1], 2) == [0, 1, 3]
    assert balanced_split([0] * 8, 4) == [0, 1, 2, 3, 8]
