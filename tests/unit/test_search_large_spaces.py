"""What the search does on the default spaces of real jobs (thousands of candidates, a layout
dimension of 16 options at 64 ranks): seeds capped by the budget, P(fit) as array operations that
give the per-candidate answers, tensor splits kept inside a node. Milliseconds each."""

import itertools
import re
from typing import List, Optional, Sequence

import numpy as np
import pytest
from scipy.stats import norm

from atorch.auto.search.auto_search import ranks_per_node
from atorch.auto.search.feasibility import Feasibility
from atorch.auto.search.seeding import Seeding
from atorch.auto.search.space import Candidate, SearchSpace
from atorch.auto.strategy import Strategy
from atorch.testing.models import tiny_llama


def _candidates(sizes: Sequence[int]) -> List[Candidate]:
    return [Candidate(Strategy([]), tuple(c)) for c in itertools.product(*(range(s) for s in sizes))]


@pytest.mark.parametrize("max_trials, random_samples, cover", [
    (None, 3, 16),     # no budget given: every option of the widest dimension
    (20, 3, 6),        # a third of 20 dry runs
    (30, 3, 10),
    (14, 8, 8),        # random_samples asked for more: honoured
    (60, 3, 16),       # the cap is above the widest dimension
    (20, 0, 0),        # no seeds asked for
])
def test_seeds_take_at_most_a_third_of_the_budget(max_trials: Optional[int], random_samples: int, cover: int):
    seeding = Seeding(_candidates([16, 2, 3]), random_samples, np.random.default_rng(0), max_trials=max_trials)
    assert seeding.cover == cover
    tried: set = set()
    picks = []
    remaining = {i: 1.0 for i in range(96)}
    while (pick := seeding.next(remaining, [None] * 96, tried, sorted(tried))) is not None:
        picks.append(pick[0])
        tried.add(pick[0])
        del remaining[pick[0]]
    assert len(picks) == cover


def _reference(feas: Feasibility, i: int):
    """The per-candidate rule the array version must reproduce, written with `needs_at_least`."""
    if i in feas.ok:
        return 1.0, "ran", None
    if i in feas.oom:
        return 0.0, "ran out of memory", None
    blocker = next((j for j in feas.oom if feas.ruled_out_by(i, j)), None)
    if blocker is not None:
        return 0.0, "dominated", blocker
    saver = next((j for j in feas.ok if feas.needs_at_least(j, i)), None)
    if saver is not None:
        return 1.0, "dominates", saver
    return None


@pytest.mark.parametrize("seed", range(8))
def test_fit_probabilities_over_arrays_match_the_per_candidate_rule(seed: int):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(1, 5, size=4)]
    choices = [c.choices for c in _candidates(sizes)]
    # Ordered dimensions with one or two kinds of saving, and an unordered one.
    ranks = [None if d == 0 else [tuple(float(x) for x in rng.integers(0, 3, size=1 + d % 2)) for _ in range(s)]
             for d, s in enumerate(sizes)]
    predicted = list(rng.uniform(0.5e9, 2e9, size=len(choices))) if seed % 2 else None
    feas = Feasibility(choices, ranks, 1e9, predicted)
    for _ in range(6):
        i = int(rng.integers(len(choices)))
        feas.observe(i, str(rng.choice(["ok", "oom"])), float(rng.uniform(0.3e9, 3e9)))
    order = [int(i) for i in rng.permutation(len(choices))]
    got = feas.probabilities(order)
    assert list(got) == order
    mu, sd = feas.model()
    for i in order:
        want = _reference(feas, i)
        if want is None:     # the log-memory model decides
            assert got[i].why == "model"
            assert got[i].p == pytest.approx(float(norm.cdf((np.log(1e9) - mu[i]) / sd[i])))
        else:
            assert (got[i].p, got[i].why, got[i].other) == want
        assert feas.probability(i) == got[i]


def test_tensor_splits_stay_inside_a_node_when_the_world_spans_several():
    model = tiny_llama(num_attention_heads=8, num_key_value_heads=8, hidden_size=64)

    def tensor_degrees(per_node: Optional[int]) -> set:
        space = SearchSpace.default_for(model, 16, "cpu", global_batch_size=16, ranks_per_node=per_node)
        return {int(m) for c in space.candidates() for m in re.findall(r"tensor=(\d+)", c.label())}

    assert tensor_degrees(None) >= {2, 4, 8}
    assert tensor_degrees(4) == {2, 4}
    # 3 nodes of 8 ranks, a model of 24 heads: splits of 3 and 6 divide the world and fit in a node's
    # 8 ranks, but their runs of consecutive ranks cross nodes (ranks 6-8, 6-11).
    wide = tiny_llama(num_attention_heads=24, num_key_value_heads=24, hidden_size=96, intermediate_size=192,
                      vocab_size=240)
    space = SearchSpace.default_for(wide, 24, "cpu", global_batch_size=24, ranks_per_node=8)
    assert {int(m) for c in space.candidates() for m in re.findall(r"tensor=(\d+)", c.label())} == {2, 4, 8}
    # A restricted copy (the user's excluded/included) keeps the node size.
    space = SearchSpace.default_for(model, 16, "cpu", global_batch_size=16, ranks_per_node=4)
    assert space.restricted(excluded=["compile"]).ranks_per_node == 4


@pytest.mark.parametrize("local, world, expected", [
    ("8", 64, 8), ("8", 8, None), ("", 64, None), ("x", 64, None), ("0", 64, None), ("16", 8, None)])
def test_ranks_per_node_from_the_launcher(monkeypatch, local: str, world: int, expected: Optional[int]):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert ranks_per_node(world) == expected


def test_the_remeasurement_weighs_at_most_as_many_untried_candidates_as_a_suggestion():
    from atorch.auto.search.bo import MAX_SCORED
    from atorch.auto.search.search import _scored

    few = {i: 0.5 for i in range(0, 2 * MAX_SCORED, 4)}
    assert _scored(few, 0) == sorted(few)
    many = {i: 0.5 for i in range(3 * MAX_SCORED)}
    picked = _scored(many, 7)
    assert len(picked) == len(set(picked)) == MAX_SCORED and picked == sorted(picked) and set(picked) <= set(many)
    assert _scored(many, 7) == picked and _scored(many, 8) != picked    # seeded
