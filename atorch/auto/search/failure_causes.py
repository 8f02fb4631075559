"""Which options (or pairs of options) make dry runs raise: the posterior over sets of causes.

A cause is an option (d, v) or a pair of options of two dimensions (d, v, e, w): every candidate that
has it raises (compile on a model it cannot trace, an optimization with a tensor split). A candidate
can also raise for a reason of its own, at a rate `rate`. Each possible cause is one a priori with
probability `prior`, independently (about one cause in the space). Given the failures (and the runs
that ruled causes out), the hypotheses are the sets of at most two causes among the suspects (options
and pairs seen in a failure and in no run), the empty set included: a set S has prior weight
prod over S of prior / (1 - prior), and each failure is explained (likelihood 1) when it has a cause
of S, else it is the candidate's own (likelihood `rate`). A candidate runs when it has no cause of S.

Why sets instead of a posterior per suspect taken as independent (the rule before): two failures that
share an option are explained by that option, or by any pair of options they share, or by two separate
causes; those explanations compete for the same evidence. Counted independently, each of them was as
likely as the one explanation alone, and a candidate with two of them was blocked twice: after two
failures of amp off with module_replace off (the cause: the pair), every candidate with amp off ran with
P 0.11, and the search never tried the best candidate of the space, amp off with module_replace on
(benchmarks/search.py failing-3% #10 at offset 250000: 0.55 of the best). Here it is about 0.6 (that
search now tries amp off, with other partners, and still misses; over 180 such searches at 64/14, 149 -> 155
at >= 0.98 of the best: benchmarks/RESULTS.md, "Session 31").

Sets of more than two causes are left out (their prior is prior^3: a third cause explains failures at
least as well as the own-reason rate only after several failures, which the rate absorbs meanwhile).
Pure numpy: hundreds of suspects are thousands of pairs, milliseconds.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

Key = Tuple[int, ...]
"""A possible cause: an option (d, v) or a pair of options of two dimensions (d, v, e, w)."""

# Beyond this many suspects only single causes are weighed (the pairs' table grows as its square).
MAX_PAIRED_SUSPECTS = 400


class CauseSets:
    """The posterior over sets of at most two causes, for one state of the evidence.

    `suspects`: the possible causes seen in a failure and ruled out by no run; `failed_keys`: for each
    failed dry run (a candidate that failed twice counts twice), the possible causes it has;
    `prior`: a possible cause's prior probability; `rate`: the rate of failures of a candidate's own.
    """

    def __init__(self, suspects: Sequence[Key], failed_keys: Sequence[Sequence[Key]],
                 prior: float, rate: float) -> None:
        self.index: Dict[Key, int] = {k: s for s, k in enumerate(suspects)}
        n = len(self.index)
        hit = np.zeros((len(failed_keys), n), dtype=bool)
        for j, keys in enumerate(failed_keys):
            for k in keys:
                s = self.index.get(k)
                if s is not None:
                    hit[j, s] = True
        miss = (~hit).astype(float)                  # failure j not explained by suspect s
        log_rate = math.log(min(max(rate, 1e-12), 1.0))
        log_odds = math.log(prior / (1.0 - prior)) if 0.0 < prior < 1.0 else 0.0
        none = len(failed_keys) * log_rate
        single = log_odds + miss.sum(axis=0) * log_rate
        paired = n <= MAX_PAIRED_SUSPECTS and n > 1
        # A pair explains a failure when either of its causes does: unexplained = both miss it.
        pair = 2.0 * log_odds + (miss.T @ miss) * log_rate if paired else np.zeros((0, 0))
        top = max([none, float(single.max(initial=-np.inf)), float(pair.max(initial=-np.inf))])
        self.w_none = math.exp(none - top)
        self.w_single = np.exp(single - top)
        self.w_pair = np.triu(np.exp(pair - top), k=1) if paired else np.zeros((0, 0))
        self.total = self.w_none + float(self.w_single.sum()) + float(self.w_pair.sum())

    def _has(self, keys: Sequence[Key]) -> np.ndarray:
        x = np.zeros(len(self.index), dtype=float)
        for k in keys:
            s = self.index.get(k)
            if s is not None:
                x[s] = 1.0
        return x

    def p_clear(self, keys: Sequence[Key]) -> float:
        """P(none of `keys` is a cause): a candidate with these options and pairs runs (of failures
        shared with others; a failed candidate's: its failure was its own)."""
        return float(self.p_clear_many([keys])[0])

    def p_clear_many(self, keys_of: Sequence[Sequence[Key]]) -> np.ndarray:
        """`p_clear` of many candidates at once (one matrix product)."""
        if not self.index:
            return np.ones(len(keys_of))
        x = np.stack([self._has(keys) for keys in keys_of]) if keys_of else np.zeros((0, len(self.index)))
        clear = self.w_none + (1.0 - x) @ self.w_single
        if self.w_pair.size:
            y = 1.0 - x
            clear = clear + ((y @ self.w_pair) * y).sum(axis=1)
        # A candidate with no suspect is clear in every set: exactly 1, not a rounding of total / total.
        return np.where(x.any(axis=1), np.clip(clear / self.total, 0.0, 1.0), 1.0)

    def marginal(self, key: Key) -> float:
        """P(`key` is a cause)."""
        s = self.index.get(key)
        if s is None:
            return 0.0
        mass = float(self.w_single[s])
        if self.w_pair.size:
            mass += float(self.w_pair[s, :].sum() + self.w_pair[:, s].sum())
        return mass / self.total


def suspects_of(seen_failing: Iterable[Key], ruled_out: set) -> List[Key]:
    """The possible causes seen in a failure and in no run, in a stable order."""
    return sorted(k for k in seen_failing if k not in ruled_out)

