r"""Where the strategy search's remaining misses come from: the noise, or the exploration? (issue 12)

    # 1. perfect exploration: how often the true top candidates, measured with the landscape's
    #    noise and re-measured R rounds, are declared right (seconds)
    OMP_NUM_THREADS=1 python benchmarks/search_ceiling.py bound --families additive-3% interact-3% spikes-3%
    #    ... the same landscapes with dry runs twice as precise
    OMP_NUM_THREADS=1 python benchmarks/search_ceiling.py bound --families additive-3% --noise 0.015
    # 2. the committed surrogate against two others on the same landscapes and noise streams
    #    (about 1 s per search for the committed one, 0.2 s for the others)
    OMP_NUM_THREADS=1 python benchmarks/search_ceiling.py planners --families interact-3% spikes-3% \
        --predictors none --planners committed oracle averaged --seed-offsets 0 90000 130000 170000
    #    ... expected improvement against the knowledge gradient on the same GP (about 0.5 s per search;
    #    committed-kg: the knowledge gradient on the committed planner's GP, about 1.5 s)
    OMP_NUM_THREADS=1 python benchmarks/search_ceiling.py planners --families additive-3% \
        --predictors none noisy anti --planners averaged kg committed committed-kg

The landscapes are `benchmarks/search.py`'s (64 candidates, 14 dry runs), seeded the same way.

`bound` gives the search what no search has: the true top-k candidates that fit and run, each
measured once, then R rounds in which the two with the highest pooled mean are measured once
more each; the one with the highest pooled mean is declared. What it misses is lost to the
measurement noise alone, with k + 2R dry runs spent where they help most.

`planners` runs `search_strategy` unchanged except for its surrogate (`planner_factory`):
- committed: HEBO's GP with the two-way ANOVA kernel, hyperparameters fitted by marginal
  likelihood (`atorch.auto.search.bo.CandidatePlanner`);
- oracle: the same two-way ANOVA model with the variances that generated the landscapes
  (each option's effect N(0, sigma_main^2); each pair of options' N(0, pair_p * sigma_int^2), the
  interaction's variance averaged over whether the pair interacts), nothing fitted: what the
  right prior alone gives;
- averaged: the same model with its variances (main effects, interactions, the predictor
  feature's weight, extra noise) averaged over a log-spaced grid, each point weighted by its
  marginal likelihood: the usual remedy for hyperparameters fitted on a dozen points.
- kg: the averaged model with the knowledge gradient instead of expected improvement: the
  expected rise of the best posterior mean among the measured candidates and the suggested one,
  once the suggested one is measured (x P(fit)), the acquisition for a search judged by what it
  declares at the end rather than by the best it happens to measure;
- committed-kg: the committed planner with the knowledge gradient in place of expected improvement.
The stand-ins are written here in numpy, exact GP regression over the candidate list, for
this comparison only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import search as bench  # noqa: E402  (benchmarks/search.py: the landscapes)

from atorch.auto.search import SearchSpace  # noqa: E402
from atorch.auto.search.bo import CandidatePlanner, Observation, Suggestion, log_expected_improvement  # noqa: E402

SPACE = 64

# (per-option variance, per-option-pair variance, predictor weight variance, extra noise variance)
Hyper = Tuple[float, float, float, float]


class AnovaGP:
    """Exact GP regression of log-throughput over a finite candidate list with a two-way ANOVA
    kernel (a constant, one effect per option, one per pair of options, optionally a weight on a
    standardized predictor column), the posterior averaged over `grid` by marginal likelihood;
    EI x P(fit) as the committed planner's acquisition. Implements the planner protocol of
    `search_strategy` (suggest, posterior, expected_seconds)."""

    def __init__(self, choices: Sequence[Sequence[int]], prior: Optional[Sequence[float]],
                 grid: Callable[[bool], List[Hyper]]) -> None:
        c = np.asarray(choices)
        varying = [d for d in range(c.shape[1]) if len(set(c[:, d])) > 1]
        same = [(c[:, d][:, None] == c[:, d][None, :]).astype(float) for d in varying]
        self.k_main = sum(same)                                                  # equal options
        self.k_pair = sum(a * b for a, b in itertools.combinations(same, 2))     # equal option pairs
        self.k_pred = None
        if prior is not None and np.ptp(prior) > 1e-12:
            p = (np.asarray(prior) - np.mean(prior)) / np.std(prior)
            self.k_pred = np.outer(p, p)
        self.grid = grid(self.k_pred is not None)
        self.expected_seconds = 0.0

    def _joint(self, observed: Sequence[Observation], idx: Sequence[int]
               ) -> Tuple[np.ndarray, List[Tuple[np.ndarray, np.ndarray, float]]]:
        """The grid's weights (marginal likelihood) and, per grid point, the posterior mean and
        covariance at `idx` with the noise variance of one more measurement."""
        rows = [o.index for o in observed]
        y = np.array([o.log_throughput for o in observed])
        noise = np.array([max(o.noise_var or 0.0, 1e-5) for o in observed])
        y0 = y - y.mean()
        lml, post = [], []
        for main, pair, pred, extra in self.grid:
            k = main * self.k_main + pair * self.k_pair + 1.0
            if self.k_pred is not None:
                k = k + pred * self.k_pred
            chol = np.linalg.cholesky(k[np.ix_(rows, rows)] + np.diag(noise + extra) + 1e-9 * np.eye(len(rows)))
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y0))
            lml.append(-0.5 * y0 @ alpha - np.log(np.diag(chol)).sum())
            cross = k[np.ix_(idx, rows)]
            v = np.linalg.solve(chol, cross.T)
            post.append((y.mean() + cross @ alpha, k[np.ix_(idx, idx)] - v.T @ v, float(np.median(noise) + extra)))
        w = np.exp(np.array(lml) - max(lml))
        return w / w.sum(), post

    def _posteriors(self, observed: Sequence[Observation], idx: Sequence[int]
                    ) -> Tuple[np.ndarray, List[Tuple[np.ndarray, np.ndarray]]]:
        """Per grid point: the posterior mean and variance at `idx`; and the grid's weights."""
        w, joint = self._joint(observed, idx)
        return w, [(mean, np.maximum(np.diag(cov), 1e-12)) for mean, cov, _ in joint]

    def posterior(self, observed: Sequence[Observation], indices: Sequence[int]) -> Dict[int, Tuple[float, float]]:
        if len(observed) < 2 or not indices:
            return {}
        idx = list(indices)
        w, post = self._posteriors(observed, idx)
        mean = sum(wi * m for wi, (m, _) in zip(w, post))
        var = sum(wi * (v + m * m) for wi, (m, v) in zip(w, post)) - mean * mean
        return {i: (float(m), float(v)) for i, m, v in zip(idx, mean, var)}

    def suggest(self, observed: Sequence[Observation], remaining: Sequence[int],
                log_fit: Optional[Mapping[int, float]] = None) -> Suggestion:
        start = time.perf_counter()
        remaining = list(remaining)
        fit = np.array([(log_fit or {}).get(i, 0.0) for i in remaining])
        if len(observed) < 2:
            return Suggestion(remaining[int(np.argmax(fit))], 0.0, "order")
        value = self._acquisition(observed, sorted({o.index for o in observed}), remaining)
        best = int(np.argmax(np.log(np.maximum(value, 1e-300)) + fit))
        self.expected_seconds = time.perf_counter() - start
        return Suggestion(remaining[best], self.expected_seconds, "acquisition", len(remaining))

    def _acquisition(self, observed: Sequence[Observation], seen: List[int], remaining: List[int]) -> np.ndarray:
        """Expected improvement over the best measured posterior mean, averaged over the grid (the
        integrated acquisition)."""
        w, post = self._posteriors(observed, seen + remaining)
        ei = np.zeros(len(remaining))
        for wi, (mean, var) in zip(w, post):
            incumbent = mean[:len(seen)].max()
            ei += wi * np.exp(log_expected_improvement(-incumbent, -mean[len(seen):], var[len(seen):]))
        return ei


# Standard normal quadrature for the knowledge gradient's expectation (13 points, weights ~ the density).
_KG_Z = np.array([-2.5, -1.8, -1.3, -0.9, -0.55, -0.25, 0.0, 0.25, 0.55, 0.9, 1.3, 1.8, 2.5])
_KG_W = np.exp(-0.5 * _KG_Z ** 2) / np.exp(-0.5 * _KG_Z ** 2).sum()


class KnowledgeGradientGP(AnovaGP):
    """`AnovaGP` (averaged grid) suggesting by the knowledge gradient: for a candidate x, E[max over the
    measured candidates and x of the posterior mean after measuring x] - the best posterior mean now,
    averaged over the grid, times P(fit)."""

    def _acquisition(self, observed: Sequence[Observation], seen: List[int], remaining: List[int]) -> np.ndarray:
        w, post = self._joint(observed, seen + remaining)
        kg = np.zeros(len(remaining))
        for wi, (mean, cov, noise) in zip(w, post):
            if wi >= 1e-4:
                kg += wi * knowledge_gradient(mean, cov, noise, len(seen))
        return kg


def knowledge_gradient(mean: np.ndarray, cov: np.ndarray, noise: float, num_measured: int) -> np.ndarray:
    """For each candidate after the first `num_measured` (the measured ones): the expected rise of the
    best posterior mean among the measured candidates and it, once it is measured (maximization)."""
    m = num_measured
    sd = np.sqrt(np.maximum(np.diag(cov)[m:] + noise, 1e-18))
    spread_seen = cov[:m, m:] / sd                      # how each measured mean moves with the new y
    spread_new = np.diag(cov)[m:] / sd
    best_seen = (mean[:m, None][None] + _KG_Z[:, None, None] * spread_seen[None]).max(axis=1)
    best = np.maximum(best_seen, mean[m:][None] + _KG_Z[:, None] * spread_new[None])
    return np.maximum(_KG_W @ best - mean[:m].max(), 0.0)


class HeboKnowledgeGradient(CandidatePlanner):
    """The committed planner (HEBO's GP, the ANOVA kernel, ML-II) suggesting by the knowledge gradient
    x P(fit) instead of expected improvement x P(fit); the joint posterior from HEBO's gpytorch model
    (its `predict` gives marginal variances only)."""

    def suggest(self, observed: Sequence[Observation], remaining: Sequence[int],
                log_fit: Optional[Mapping[int, float]] = None) -> Suggestion:
        import gpytorch
        import torch

        from atorch.auto.search.bo import _quiet_hebo

        if not self._can_model(observed):
            return super().suggest(observed, remaining, log_fit)
        start = time.perf_counter()
        remaining = list(remaining)
        measured = sorted({o.index for o in observed})
        rows = measured + remaining
        model = self._fitted(observed)
        with _quiet_hebo(self.seed), torch.no_grad(), gpytorch.settings.fast_pred_var(False):
            xc, xe = model.xtrans(self.pred[rows], self.codes[rows])
            pred = model.gp(xc, xe)
            scale = float(model.yscaler.std.reshape(-1)[0]) ** 2
            mean = -model.yscaler.inverse_transform(pred.mean.reshape(-1, 1)).reshape(-1).double().numpy()
            cov = pred.covariance_matrix.double().numpy() * scale
            noise = float(model.lik.noise.reshape(-1)[0]) * scale
        fit = np.array([(log_fit or {}).get(i, 0.0) for i in remaining])
        score = np.log(np.maximum(knowledge_gradient(mean, cov, noise, len(measured)), 1e-300)) + fit
        best = int(np.lexsort((-self.prior[remaining], -score))[0])     # ties: the predictor's favourite
        return Suggestion(remaining[best], time.perf_counter() - start, "acquisition", len(remaining))


def oracle_grid(family: bench.Family) -> Callable[[bool], List[Hyper]]:
    return lambda has_pred: [(family.sigma_main ** 2, family.pair_p * family.sigma_int ** 2, 0.1 if has_pred else 0.0,
                              0.0)]


def averaged_grid(has_pred: bool) -> List[Hyper]:
    mains = np.geomspace(1e-3, 3.0, 8)
    preds = (0.0, 0.01, 0.04, 0.16, 0.64) if has_pred else (0.0,)
    return [(m, m * r, q, e) for m in mains for r in (0.0, 0.1, 0.3, 1.0) for q in preds for e in (0.0, 0.0025)]


def run_search(space: SearchSpace, land: bench.Landscape, predictor: str, planner: str) -> float:
    """The declared winner's true throughput over the best, searching with `planner`'s surrogate
    (benchmarks/search.py's own run, the same noise stream)."""
    factory = None
    if planner == "committed-kg":
        factory = lambda labels, choices, prior, seed: HeboKnowledgeGradient(  # noqa: E731
            labels, choices, prior=prior, seed=seed)
    elif planner == "kg":
        factory = lambda labels, choices, prior, seed: KnowledgeGradientGP(choices, prior, averaged_grid)  # noqa: E731
    elif planner != "committed":
        grid = oracle_grid(land.family) if planner == "oracle" else averaged_grid
        factory = lambda labels, choices, prior, seed: AnovaGP(choices, prior, grid)  # noqa: E731
    return bench.run_ours(space, land, predictor, bench.BUDGET[SPACE], land.seed, factory)[0]


def landscapes(space: SearchSpace, family: str, offsets: Sequence[int], count: int
               ) -> Iterator[Tuple[int, int, bench.Landscape]]:
    """(seed offset, index, landscape), seeded as benchmarks/search.py seeds them."""
    for offset in offsets:
        for k in range(count):
            yield offset, k, bench.Landscape(space, bench.FAMILIES[family], bench.landscape_seed(SPACE, family, k, offset))


def row(ratios: Sequence[float]) -> str:
    """benchmarks/search.py's P(>= 0.98) | mean | worst, and the count below 0.9."""
    return f"{bench.summarize(list(ratios))} | {int((np.asarray(ratios) < 0.9).sum())}"


def bound(args: argparse.Namespace) -> None:
    """The perfect-exploration table (see the module docstring)."""
    space = bench.make_space(SPACE)
    print("| family | true top k measured | rounds | dry runs | P(declared >= 0.98) |")
    print("|---|---|---|---|---|")
    for family in args.families:
        for rounds in args.rounds:
            hits = total = 0
            for _, _, land in landscapes(space, family, args.seed_offsets, args.landscapes):
                if args.noise is not None:     # the same landscape, measured more or less precisely
                    land.family = dataclasses.replace(land.family, noise=args.noise)
                top = sorted(land.runnable(), key=lambda s: -land.log_tp[s])[:args.top]
                land.reset_noise("bound")
                for _ in range(args.repeats):
                    runs = {s: [math.log(land.evaluate(s).throughput)] for s in top}
                    for _ in range(rounds):
                        for s in sorted(top, key=lambda s: -np.mean(runs[s]))[:2]:
                            runs[s].append(math.log(land.evaluate(s).throughput))
                    declared = max(top, key=lambda s: np.mean(runs[s]))
                    hits += land.ratio(declared) >= bench.TARGET
                    total += 1
            print(f"| {family} | {args.top} | {rounds} | {args.top + 2 * rounds} | {hits / total * 100:.1f}% |",
                  flush=True)


def planners(args: argparse.Namespace) -> None:
    """The committed surrogate against the oracle and averaged ones, paired."""
    logging.disable(logging.WARNING)      # the raising candidate's warning, once per search
    space = bench.make_space(SPACE)
    ratios: Dict[Tuple[str, str, str], List[float]] = {}
    for family in args.families:
        for offset, k, land in landscapes(space, family, args.seed_offsets, args.landscapes):
            for predictor in args.predictors:
                got = [run_search(space, land, predictor, p) for p in args.planners]
                for p, r in zip(args.planners, got):
                    ratios.setdefault((family, predictor, p), []).append(r)
                print(f"{family} {offset} #{k} {predictor}: " + " ".join(f"{p}={r:.4f}" for p, r in
                                                                            zip(args.planners, got)), flush=True)
    print("\n| family | predictor | surrogate | landscapes | P(>= 0.98) | mean | worst | below 0.9 |")
    print("|---|---|---|---|---|---|---|---|")
    for (family, predictor, p), values in ratios.items():
        print(f"| {family} | {predictor} | {p} | {len(values)} | {row(values)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("bound", "planners"):
        p = sub.add_parser(name)
        p.add_argument("--families", nargs="+", default=["additive-3%", "interact-3%", "spikes-3%"])
        p.add_argument("--seed-offsets", nargs="+", type=int, default=[0, 90000, 130000, 170000])
        p.add_argument("--landscapes", type=int, default=20, help="per family and seed offset")
    b = sub.choices["bound"]
    b.add_argument("--top", type=int, default=5)
    b.add_argument("--rounds", nargs="+", type=int, default=[0, 1, 2, 3, 5])
    b.add_argument("--repeats", type=int, default=20, help="noise draws per landscape")
    b.add_argument("--noise", type=float, help="each dry run's relative error instead of the family's (e.g. 0.015)")
    p = sub.choices["planners"]
    p.add_argument("--predictors", nargs="+", default=["none"], choices=bench.PREDICTORS)
    p.add_argument("--planners", nargs="+", default=["committed", "oracle", "averaged"],
                   choices=["committed", "oracle", "averaged", "kg", "committed-kg"])
    p.add_argument("--spikes", type=float, help="every family's load-spike probability per timed step instead of "
                   "its own (0: spikes-3%%'s landscapes timed without spikes)")
    args = parser.parse_args()
    if getattr(args, "spikes", None) is not None:
        # The same landscapes (seeds come from the family's name), timed otherwise.
        for name in args.families:
            bench.FAMILIES[name] = dataclasses.replace(bench.FAMILIES[name], spikes=args.spikes)
    bound(args) if args.command == "bound" else planners(args)


if __name__ == "__main__":
    main()
