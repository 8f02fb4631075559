"""The search's first trials, before its surrogate has data."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from atorch.auto.search.space import Candidate

# Candidates the predictor ranks first are tried before any random sample: when the cost model
# is right the search is over after one confirming trial, and when it is wrong it costs two.
PREDICTED_SEEDS = 2
# The spread-out seeds take at most 1 / SEED_SHARE_DIVISOR of the search's dry runs. Covering every option of
# the widest dimension once is what they are for, but a default space's layout dimension has 16
# options at 64 ranks: 16 seeds of a 20-run budget left the surrogate 2-4 picks, a random search in
# effect. Past the share the surrogate's prior (an unmeasured option's effect is unknown, so its
# expected improvement is high) goes on exploring, but guided.
SEED_SHARE_DIVISOR = 3


class Seeding:
    """The first trials, before the surrogate has data: the predictor's fastest candidates
    (weighted by their probability of fitting), then spread-out ones.

    The spread-out part has as many points as the largest dimension has options (at least
    `random_samples`; beyond that at most a third of `max_trials`), and each is drawn among the
    candidates showing the most options not yet covered (weighted by the probability of fitting),
    then the farthest, in changed dimensions, from those already tried: after it every option of
    every dimension (up to the cap) has been measured once where memory allows, so the
    surrogate's main effects start from data rather than from its prior. Picks are made one at a
    time, so each sees what the trials so far taught about memory.
    """

    def __init__(self, candidates: List[Candidate], random_samples: int, rng: np.random.Generator,
                 max_trials: Optional[int] = None) -> None:
        self.candidates, self.rng = candidates, rng
        dims = len(candidates[0].choices) if candidates else 0
        self._choices = np.asarray([list(c.choices) for c in candidates], dtype=int).reshape(len(candidates), dims)
        widest = max((len(set(column.tolist())) for column in self._choices.T), default=1)
        if max_trials is not None:
            widest = min(widest, max_trials // SEED_SHARE_DIVISOR)
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
        # Only a run that measured a throughput covers its options (an out-of-memory one did not).
        # Arrays: a default space has thousands of candidates, and this runs before every seed.
        choices = self._choices
        rows = np.asarray(sorted(remaining), dtype=int)
        dims = np.arange(choices.shape[1])
        covered = np.zeros((choices.shape[1], int(choices.max(initial=0)) + 1), dtype=bool)
        for j in measured:
            covered[dims, choices[j]] = True
        uncovered = (~covered[dims, choices[rows]]).sum(axis=1)
        weighted = [round(remaining[int(i)] * int(u), 1) for i, u in zip(rows, uncovered)]
        tried_rows = choices[sorted(tried)]
        spread = (choices[rows][:, None, :] != tried_rows[None, :, :]).sum(axis=2).min(axis=1) \
            if len(tried_rows) else np.zeros(len(rows), dtype=int)
        top = max(zip(weighted, spread.tolist()))
        tied = [int(i) for i, w, h in zip(rows, weighted, spread.tolist()) if (w, h) == top]
        return tied[int(self.rng.integers(len(tied)))], "random"
