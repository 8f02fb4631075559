"""Shared pieces of the parity tests: fixed token batches and single-process reference training.

Every parallel feature is tested the same way: the same global batches, the same losses as
plain single-process training, within a stated tolerance.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

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


class VarLenDataset(Dataset):
    """Samples of unequal lengths, for batches whose sequence length changes from step to step.

    Samples [k*rows, (k+1)*rows) form batch k: its first is `longest[k]` tokens long, the others between 4 and
    that, so `pad_to_longest` pads batch k to exactly `longest[k]`. Deterministic in `seed`.
    """

    def __init__(self, longest: Sequence[int], rows: int, seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE):
        g = torch.Generator().manual_seed(seed)
        self.samples: List[torch.Tensor] = []
        for length in longest:
            for row in range(rows):
                n = length if row == 0 else int(torch.randint(4, length + 1, (1,), generator=g))
                self.samples.append(torch.randint(4, vocab_size, (n,), generator=g))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.samples[i], "labels": self.samples[i]}


PAD_ID = 3  # the tiny models' pad token (atorch.testing.models)


def pad_to_longest(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """A collate_fn padding on the right to the batch's longest sample: attention_mask 0 and labels -100 there."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        mask[row, :len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def global_batches(dataset: Dataset, global_batch: int, steps: int) -> List[Dict[str, torch.Tensor]]:
    """Batch k is samples [k*B, (k+1)*B): what a non-shuffling DistributedSampler spreads over ranks."""
    out = []
    for k in range(steps):
        items = [dataset[i] for i in range(k * global_batch, (k + 1) * global_batch)]
        out.append({key: torch.stack([it[key] for it in items]) for key in items[0]})
    return out


def reference_losses(model: torch.nn.Module, batches: Sequence[Union[Dict[str, torch.Tensor],
                                                                     Sequence[Dict[str, torch.Tensor]]]],
                     optim_func: Callable = torch.optim.AdamW, lr: float = 1e-3,
                     autocast_dtype: Optional[torch.dtype] = None, max_grad_norm: Optional[float] = None
                     ) -> List[float]:
    """Plain single-process training on whole global batches, clipped to `max_grad_norm` where given.

    A batch given as a list of micro-batches trains on the mean of their losses (as DeepSpeed's pipeline
    engine averages its micro-batches)."""
    optim = optim_func([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in batches:
        micros = [batch] if isinstance(batch, dict) else list(batch)
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = torch.stack([model(**micro).loss for micro in micros]).mean()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_close_losses(actual: List[float], expected: List[float], rel: float, what: str = "") -> None:
    assert len(actual) == len(expected), (actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{what} step {step}: loss {a} vs reference {e} (rel tol {rel})"
