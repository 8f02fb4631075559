"""No-repeat-n-gram blocking as a handful of tensor operations over the whole batch.

The system atorch follows blocks repeated n-grams with a custom CUDA kernel (fairseq's
`ngram_repeat_block`). This is the same computation written with device-agnostic tensor ops,
so one code path serves CPU and GPU, with no Python loop over rows, beams or n-grams:

1. every window of `n` consecutive tokens of every row: `input_ids.unfold(1, n, 1)`, a view;
2. a window bans its last token when its first `n - 1` tokens equal the row's last `n - 1`
   tokens (the n-gram that the next token would complete);
3. the banned tokens are written as `-inf` with one `scatter_reduce_` ("amin") of only the
   `rows x windows` candidate positions, instead of building a `(rows, vocab)` mask and
   `masked_fill`-ing the whole score matrix the way transformers' processor does. Windows that
   do not match scatter `+inf`, which `amin` leaves without effect, so no spare vocabulary
   column and no data-dependent `nonzero` (a host sync on GPU) is needed.

The banned set is exactly transformers' `NoRepeatNGramLogitsProcessor`'s: padding tokens are
ordinary tokens there too, and token ids outside the score matrix (an embedding larger than
the LM head) are never banned. One documented difference: a NaN score at a banned position
stays NaN (transformers overwrites it with `-inf`); a model that produces NaN logits is broken
either way.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.generation.logits_process import LogitsProcessor


class FusedNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans every token that would complete an n-gram already present in its row.

    Same `__call__(input_ids, scores) -> scores` contract and the same banned tokens as
    transformers' `NoRepeatNGramLogitsProcessor(ngram_size)`; works for any batch of rows
    (batch x beams flattened, as `generate` passes them) on any device.

    Args:
        ngram_size: n; every n-gram may occur at most once.
        inplace: write the `-inf`s into `scores` itself and return it. Skips a copy of the
            whole `(rows, vocab)` score matrix, which is most of the cost at large batch;
            only safe when the caller does not keep the scores it passed in (inside
            `generate` that is whenever `output_logits` is off; `atorch.generation`'s
            generate switch decides this for you). Default False: `scores` is left untouched,
            like transformers' processor.
    """

    def __init__(self, ngram_size: int, inplace: bool = False) -> None:
        if not isinstance(ngram_size, int) or isinstance(ngram_size, bool) or ngram_size <= 0:
            raise ValueError(f"FusedNoRepeatNGramLogitsProcessor: ngram_size must be a positive int, got "
                             f"{ngram_size!r}")
        self.ngram_size = ngram_size
        self.inplace = bool(inplace)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.dim() != 2 or scores.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
            raise ValueError(f"FusedNoRepeatNGramLogitsProcessor: expected input_ids (rows, length) and scores "
                             f"(rows, vocab) with the same rows, got {tuple(input_ids.shape)} and "
                             f"{tuple(scores.shape)}")
        n = self.ngram_size
        length = input_ids.shape[1]
        if length < n:  # no complete n-gram yet
            return scores
        vocab = scores.shape[1]
        windows = input_ids.unfold(1, n, 1)                      # (rows, length - n + 1, n), a view
        suffix = input_ids[:, length - n + 1:].unsqueeze(1)      # (rows, 1, n - 1): the last n - 1 tokens
        matches = (windows[..., :-1] == suffix).all(dim=-1)      # (rows, windows)
        banned = windows[..., -1]
        banned_ok = matches & (banned >= 0) & (banned < vocab)
        fill = torch.full((), float("inf"), dtype=scores.dtype, device=scores.device)
        src = torch.where(banned_ok, -fill, fill)
        out = scores if self.inplace else scores.clone()
        # transformers annotates processors with FloatTensor; the scores keep their float dtype.
        return cast(torch.FloatTensor, out.scatter_reduce_(1, banned.clamp(0, vocab - 1).long(), src, reduce="amin"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ngram_size={self.ngram_size}, inplace={self.inplace})"
