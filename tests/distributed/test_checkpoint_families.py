"""Tensor-parallel checkpoints of every architecture family merge back to the unsharded weights.

2 gloo ranks, one spawn: each family of `atorch/testing/tp_families.py` (fused qkv with
interleaved heads in Falcon, Bloom and GPT-NeoX, fused experts in Mixtral and Qwen3-MoE, a
vocabulary padded to the tensor size in Gemma and Bloom, tied heads) goes through
`auto_accelerate` with tensor=2, `save_checkpoint`, and `merge_checkpoint` on rank 0. The merged
safetensors hold exactly the weights the model had before it was sharded (bit-equal: a merge only
moves bytes), every key of the model's state dict (a tied head once), and load in transformers
with no missing or unexpected keys.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

from atorch.testing import run_distributed
from atorch.testing.tp_families import FAMILIES


def _save_and_merge(root: str, names: List[str]) -> Dict[str, Dict[str, object]]:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from atorch.auto import auto_accelerate
    from atorch.checkpoint import merge_checkpoint, save_checkpoint
    from atorch.testing.tp_families import build_family

    out: Dict[str, Dict[str, object]] = {}
    for name in names:
        model, _ = build_family(name)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ok, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                                        load_strategy=[("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"])
        assert ok, name
        path = save_checkpoint(result, os.path.join(root, name))
        del result, model
        dist.barrier()
        if dist.get_rank() == 0:
            hf = merge_checkpoint(path, os.path.join(root, name + "_hf"))
            merged: Dict[str, torch.Tensor] = {}
            for f in sorted(os.listdir(hf)):
                if f.endswith(".safetensors"):
                    merged.update(load_file(os.path.join(hf, f)))
            _, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True, attn_implementation="eager")
            out[name] = {"differ": sorted(k for k, v in merged.items() if not torch.equal(v, before.get(k, v * 0 + 1))),
                         "absent": sorted(k for k in before if k not in merged and k != "lm_head.weight"),
                         "loading": {k: v for k, v in info.items() if v}}
        dist.barrier()
    return out


def test_tensor_parallel_checkpoints_of_every_family_merge_to_the_unsharded_weights(tmp_path):
    results = run_distributed(_save_and_merge, 2, str(tmp_path), sorted(FAMILIES), timeout=600)[0]
    assert sorted(results) == sorted(FAMILIES)
    for name, r in results.items():
        assert r == {"differ": [], "absent": [], "loading": {}}, (name, r)
