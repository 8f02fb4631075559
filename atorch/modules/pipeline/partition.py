"""Balanced pipeline stages: which layers each stage owns.

Pure and cheap: it counts parameters on the (meta) model, never allocates. The embedding
("pre" pieces) always opens the first stage and the final norm and head ("post" pieces)
always close the last; the transformer blocks are split into contiguous runs that balance
the per-stage parameter count, frozen parameters included (a frozen block still runs its
forward and passes activation gradients back). Embeddings and head are left out of the
balance (as in the issue's criterion); their cost lands on the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from torch import nn

from atorch.modules.pipeline.patchers import BLOCK, POST, PRE, PieceSpec

PARTITION_METHODS = ("parameters", "uniform")


def balanced_split(weights: Sequence[int], num_parts: int) -> List[int]:
    """Boundaries `b` (len num_parts + 1) of contiguous, non-empty parts minimizing the largest part sum.

    Deterministic, so every rank computes the same split. Ties go to the later parts: the last
    boundary is the earliest one that keeps the optimum, and the items before it are split the
    same way, so the last part takes as much as the optimum allows (weights [1, 1, 1] in 2 parts:
    [1], [1, 1]; zero weights: one item in each part but the last, which takes the rest).
    Exact dynamic programming: O(parts * n^2) on a few hundred blocks at most.
    """
    n = len(weights)
    if num_parts < 1 or num_parts > n:
        raise ValueError(f"cannot split {n} blocks into {num_parts} non-empty stages (need 1 <= stages <= {n})")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max-part-sum splitting the first i items into k parts; cut[k][i]: last boundary.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    i = n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def uniform_split(n: int, num_parts: int) -> List[int]:
    """Boundaries giving each part n // num_parts items, the first n % num_parts parts one more."""
    if num_parts < 1 or num_parts > n:
        raise ValueError(f"cannot split {n} blocks into {num_parts} non-empty stages (need 1 <= stages <= {n})")
    base, extra = divmod(n, num_parts)
    bounds = [0]
    for s in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def parameter_count(module: nn.Module) -> int:
    """Elements of all parameters of `module`, frozen ones included (a frozen block costs its forward
    and the backward of its activations all the same); works on the meta device (numel needs no storage)."""
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class StagePlan:
    """`bounds[s]:bounds[s+1]` are the piece indices of stage s (pre pieces in stage 0, post in the last)."""

    bounds: Tuple[int, ...]
    pieces: Tuple[PieceSpec, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_pieces(self, stage: int) -> Tuple[PieceSpec, ...]:
        return self.pieces[self.bounds[stage]:self.bounds[stage + 1]]

    def stage_of(self, piece_index: int) -> int:
        for s in range(self.num_stages):
            if self.bounds[s] <= piece_index < self.bounds[s + 1]:
                return s
        raise ValueError(f"piece {piece_index} is outside the plan of {len(self.pieces)} pieces")


def plan_stages(model: nn.Module, pieces: Sequence[PieceSpec], num_stages: int,
                method: str = "parameters") -> StagePlan:
    """Assign pieces to `num_stages` stages; raises ValueError when there are fewer blocks than stages."""
    if method not in PARTITION_METHODS:
        raise ValueError(f"partition_method={method!r}; valid methods are {list(PARTITION_METHODS)}")
    block_idx = [i for i, p in enumerate(pieces) if p.kind == BLOCK]
    if num_stages > len(block_idx):
        raise ValueError(f"pipeline size {num_stages} is larger than the number of transformer blocks "
                         f"{len(block_idx)}: every stage needs at least one block")
    if method == "uniform":
        block_bounds = uniform_split(len(block_idx), num_stages)
    else:
        weights = [parameter_count(model.get_submodule(pieces[i].path)) for i in block_idx]
        block_bounds = balanced_split(weights, num_stages)
    first_block = block_idx[0]
    # Piece index boundaries: stage 0 starts at 0 (with the pre pieces), the last ends after the post pieces.
    bounds = [0] + [first_block + b for b in block_bounds[1:-1]] + [len(pieces)]
    assert all(p.kind == PRE for p in pieces[:first_block]) and all(p.kind == POST for p in pieces[block_idx[-1] + 1:])
    return StagePlan(tuple(bounds), tuple(pieces))


def stage_parameter_counts(model: nn.Module, plan: StagePlan, include_embeddings: bool = False,
                           excluded_paths: Sequence[str] = ()) -> List[int]:
    """Per-stage trainable parameter counts; the pieces in `excluded_paths` (e.g. `embedding_paths(...)`)
    are left out unless `include_embeddings`.

    A weight shared by two pieces (a tied head) is counted once per stage that holds it.
    """
    counts = []
    for s in range(plan.num_stages):
        seen = set()
        total = 0
        for piece in plan.stage_pieces(s):
            if not include_embeddings and piece.path in excluded_paths:
                continue
            for p in model.get_submodule(piece.path).parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        counts.append(total)
    return counts


def embedding_paths(model: nn.Module, pieces: Sequence[PieceSpec]) -> List[str]:
    """Paths of pieces that are (or wrap) vocabulary/position embedding tables or the output head."""
    emb_types = (nn.Embedding,)
    out = []
    # A transformers PreTrainedModel method, unseen through nn.Module's type.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    for p in pieces:
        if p.kind == BLOCK:
            continue
        module = model.get_submodule(p.path)
        if isinstance(module, emb_types) or module is head or "Embedding" in type(module).__name__:
            out.append(p.path)
    return out
