"""`ModelSource`: dry-run candidates built from a scratch file while the user's model holds no weights."""

import os

import pytest
import torch

from atorch.auto.model_source import ModelSource
from atorch.testing import tiny_gpt2


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_offload_build_restore_round_trip(tmp_path):
    model = tiny_gpt2(seed=0)          # GPT-2 ties lm_head.weight to wte.weight
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    before = _snapshot(model)
    params_before = dict(model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())

    with ModelSource(model, str(tmp_path)) as source:
        # The user's model holds no weight storage: meta stand-ins of the same shapes.
        assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
        assert source.resident_bytes(torch.device("cpu")) == 0
        assert source.offloaded_bytes == model_bytes
        assert os.path.getsize(source.path) == model_bytes
        assert model.lm_head.weight is model.transformer.wte.weight
        candidates = [source.build(), source.build()]
        for candidate in candidates:
            state = candidate.state_dict()
            assert all(torch.equal(state[k], v) for k, v in before.items())
            assert candidate.lm_head.weight is candidate.transformer.wte.weight       # ties survive
            assert not candidate.transformer.h[0].attn.c_attn.weight.requires_grad
        # Candidates are independent: training one changes neither the other nor the file.
        with torch.no_grad():
            for p in candidates[0].parameters():
                p.add_(1.0)
        assert torch.equal(candidates[1].lm_head.weight, before["lm_head.weight"])
        assert candidates[0].lm_head.weight.data_ptr() != candidates[1].lm_head.weight.data_ptr()
        path = source.path

    # Restored into the user's own objects, bit for bit, and the scratch file is gone.
    assert not os.path.exists(path)
    assert all(model.get_parameter(k) is p for k, p in params_before.items())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.transformer.h[0].attn.c_attn.weight.requires_grad


def test_build_needs_offload_and_meta_models_stay_meta(tmp_path):
    source = ModelSource(tiny_gpt2(seed=0), str(tmp_path))
    with pytest.raises(RuntimeError, match="offload"):
        source.build()
    with torch.device("meta"):
        meta = tiny_gpt2(seed=0)
    with ModelSource(meta, str(tmp_path)) as source:
        assert source.offloaded_bytes == 0
        assert all(p.is_meta for p in source.build().parameters())
    assert all(p.is_meta for p in meta.parameters())


def test_restore_failure_names_the_file(tmp_path):
    model = tiny_gpt2(seed=0)
    source = ModelSource(model, str(tmp_path))
    source.offload()
    os.unlink(source.path)
    with pytest.raises(RuntimeError, match="atorch-dryrun-weights"):
        source.restore()
