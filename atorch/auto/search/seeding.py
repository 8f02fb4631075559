"""The search's first trials, before its surrogate has data."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from atorch.auto.search.space import Candidate

# Candidates the predictor ranks first are tried before any random sample: when the cost model
# is right the search is over after one confirming trial, and when it is wrong it costs two.
PREDICTED_SEEDS = 2


class Seeding:
    """The first trials, before the surrogate has data: the predictor's fastest candidates
    (weighted by their probability of fitting), then spread-out ones.

    The spread-out part has at least as many points as the largest dimension has options, and
    each is drawn among the candidates showing the most options not yet covered (weighted by
    the probability of fitting), then the farthest, in changed dimensions, from those already
    tried: after it every option of every dimension has been measured once where memory allows,
    so the surrogate's main effects all start from data rather than from its prior. Picks are
    made one at a time, so each sees what the trials so far taught about memory.
    """

    def __init__(self, candidates: List[Candidate], random_samples: int, rng: np.random.Generator) -> None:
        self.candidates, self.rng = candidates, rng
        dims = len(candidates[0].choices) if candidates else 0
        widest = max((len({c.choices[d] for c in candidates}) for d in range(dims)), default=1)
        self.cover = 0 if random_samples == 0 else max(random_samples, widest)
        self.predicted_left = PREDICTED_SEEDS

    def planned(self, predictions: List[Any]) -> int:
        return self.cover + (PREDICTED_SEEDS if any(p is not None for p in predictions) else 0)

    def next(self, remaining: Dict[int, float], predictions: List[Any], tried: Set[int],
             measured: Sequence[int]) -> Optional[Tuple[int, str]]:
        """The next seed (index, source), or None once seeding is over."""
        if self.predicted_left > 0:
            pool = [i for i in remaining if predictions[i] is not None]
            if pool:
                self.predicted_left -= 1
                best = max(pool, key=lambda i: (math.log(remaining[i]) - math.log(
                    max(float(predictions[i].step_time_s), 1e-12)), -i))
                return best, "predicted-top"
            self.predicted_left = 0
        if self.cover <= 0:
            return None
        self.cover -= 1
        choices = [c.choices for c in self.candidates]
        # Only a run that measured a throughput covers its options (an out-of-memory one did not).
        covered = {(d, v) for j in measured for d, v in enumerate(choices[j])}
        pool = sorted(remaining)
        key = [(round(remaining[i] * sum((d, v) not in covered for d, v in enumerate(choices[i])), 1),
                min((hamming(choices[i], choices[j]) for j in tried), default=0)) for i in pool]
        top = max(key)
        tied = [i for i, k in zip(pool, key) if k == top]
        return int(tied[int(self.rng.integers(len(tied)))]), "random"


def hamming(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x != y for x, y in zip(a, b))
