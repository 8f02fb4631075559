"""Initial LoRA adapter weights that depend on the layer's path only, not on what else this process holds.

peft draws every adapter's A from one random stream in module order, so an adapter's values
depend on which layers come before it in *this process's* module: a pipeline stage holding
layers 2-3, or a tensor-parallel model whose adapters are added by atorch rather than peft,
would start from different adapters than the same LoRA on the whole model in one process, and
their losses would differ from step 2 on. Seeded by (seed, path), every layout starts from the
same full adapters; each process keeps its slice. The distribution is peft's (A: Kaiming uniform
with a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B: zero, so training starts from the base model).
"""

from __future__ import annotations

import math
import zlib

import torch


def lora_a_init(seed: int, path: str, r: int, in_features: int) -> torch.Tensor:
    """The full fp32 A [r, in_features] of the adapter on the layer named `path` (its name in the
    user's model, without peft's `base_model.model.` prefix)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{path}".encode()))
    bound = 1.0 / math.sqrt(in_features)    # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
    return torch.empty(r, in_features, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
