"""The posterior over sets of failure causes (`atorch.auto.search.failure_causes`) against brute force."""

import itertools
import math

import numpy as np
import pytest

from atorch.auto.search import failure_causes
from atorch.auto.search.failure_causes import CauseSets


def _brute_force(suspects, failed, prior, rate, max_causes):
    """P(none of `keys` is a cause) and P(key is a cause) by listing every set of at most `max_causes` suspects."""
    odds = prior / (1 - prior)
    sets = [frozenset(c) for n in range(max_causes + 1) for c in itertools.combinations(suspects, n)]
    weights = []
    for s in sets:
        w = odds ** len(s)
        for keys in failed:
            w *= 1.0 if s & set(keys) else rate
        weights.append(w)
    total = sum(weights)

    def clear(keys):
        return sum(w for s, w in zip(sets, weights) if not s & set(keys)) / total

    def marginal(key):
        return sum(w for s, w in zip(sets, weights) if key in s) / total

    return clear, marginal


@pytest.mark.parametrize("seed", range(4))
def test_cause_sets_match_listing_every_set_of_two(seed):
    rng = np.random.default_rng(seed)
    suspects = [(d, int(v)) for d in range(3) for v in range(3)] + [(0, 0, 1, int(v)) for v in range(3)]
    failed = [[suspects[int(i)] for i in rng.choice(len(suspects), size=4, replace=False)] for _ in range(5)]
    sets = CauseSets(suspects, failed, prior=0.05, rate=0.15)
    clear, marginal = _brute_force(suspects, failed, 0.05, 0.15, 2)
    for keys in failed + [[suspects[0]], [(9, 9)], suspects[:6]]:
        assert sets.p_clear(keys) == pytest.approx(clear(keys), rel=1e-9)
    assert list(sets.p_clear_many(failed)) == pytest.approx([clear(k) for k in failed], rel=1e-9)
    for key in suspects:
        assert sets.marginal(key) == pytest.approx(marginal(key), rel=1e-9)


def test_beyond_the_paired_limit_single_causes_are_weighed(monkeypatch):
    suspects = [(d, v) for d in range(4) for v in range(2)]
    failed = [[(0, 0), (1, 1)], [(0, 0), (2, 0)], [(3, 1)]]
    monkeypatch.setattr(failure_causes, "MAX_PAIRED_SUSPECTS", 4)
    sets = CauseSets(suspects, failed, prior=0.1, rate=0.2)
    clear, marginal = _brute_force(suspects, failed, 0.1, 0.2, 1)
    assert sets.p_clear([(0, 0)]) == pytest.approx(clear([(0, 0)]), rel=1e-9)
    assert sets.marginal((0, 0)) == pytest.approx(marginal((0, 0)), rel=1e-9)


def test_no_failure_no_suspect():
    sets = CauseSets([], [], prior=0.1, rate=0.1)
    assert sets.p_clear([(0, 1)]) == 1.0 and sets.marginal((0, 1)) == 0.0
    # Failures whose every option ran elsewhere: their own, and nothing else is blocked.
    sets = CauseSets([], [[(0, 1)], [(0, 1)]], prior=0.1, rate=0.1)
    assert sets.p_clear([(0, 1)]) == 1.0
    assert math.isfinite(sets.total)
