"""Shared pieces of the parity tests: fixed token batches and single-process reference training.

Every parallel feature is tested the same way: the same global batches, the same losses as
plain single-process training, within a stated tolerance.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch.utils.data import Dataset

from atorch.testing.models import TINY_VOCAB_SIZE


class TokenDataset(Dataset):
    """`n` samples of `seq_len` tokens, deterministic in `seed`; labels = input_ids (HF shifts them)."""

    def __init__(self, n: int = 64, seq_len: int = 16, seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(4, vocab_size, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def global_batches(dataset: Dataset, global_batch: int, steps: int) -> List[Dict[str, torch.Tensor]]:
    """Batch k is samples [k*B, (k+1)*B): what a non-shuffling DistributedSampler spreads over ranks."""
    out = []
    for k in range(steps):
        items = [dataset[i] for i in range(k * global_batch, (k + 1) * global_batch)]
        out.append({key: torch.stack([it[key] for it in items]) for key in items[0]})
    return out


def reference_losses(model: torch.nn.Module, batches: List[Dict[str, torch.Tensor]],
                     optim_func: Callable = torch.optim.AdamW, lr: float = 1e-3,
                     autocast_dtype: Optional[torch.dtype] = None) -> List[float]:
    """Plain single-process training on whole global batches."""
    optim = optim_func([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_close_losses(actual: List[float], expected: List[float], rel: float, what: str = "") -> None:
    assert len(actual) == len(expected), (actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{what} step {step}: loss {a} vs reference {e} (rel tol {rel})"
