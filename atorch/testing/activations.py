"""Ground truth for the activation memory checks: the bytes every block of a model saves for backward.

The cost model's block formula and the activation probe (`atorch.auto.activation_probe`, which
measures the first block only) are compared with this count of a whole forward, in the unit tests
and in `benchmarks/activation_probe.py`.
"""

from __future__ import annotations

from typing import List, Set

import torch
from torch import nn

from atorch.auto.activation_probe import find_blocks, never_unpacked


def saved_by_every_block(model: nn.Module, batch: int, seq_len: int, use_cache: bool = False) -> int:
    """Bytes all blocks of `model` save in one forward of `batch` x `seq_len` token ids 0 (each storage
    counted once, parameters excluded), with Hugging Face's key/value cache off (or filled: `use_cache`)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    inside, total = [False], [0]
    seen: Set[int] = set()
    kept: List[torch.Tensor] = []   # alive until the count is done (no address reuse), not held by the graph

    def pack(t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if inside[0] and key not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
            kept.append(t)

    hooks = []
    for block in find_blocks(model) or []:
        hooks.append(block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        hooks.append(block.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, never_unpacked):
            model(input_ids=torch.zeros(batch, seq_len, dtype=torch.long), use_cache=use_cache)
    finally:
        for hook in hooks:
            hook.remove()
    return total[0]
