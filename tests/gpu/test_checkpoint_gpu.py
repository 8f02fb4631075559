"""GPU paths of atorch.checkpoint (skipped without CUDA by tests/conftest.py): CUDA tensors go through DCP
and come back on the device, the CUDA generators are restored, and a checkpoint saved from GPU tensors
merges on the CPU for `from_pretrained` with the same weights."""

import torch

from atorch.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.testing import tiny_llama

DEVICE = torch.device("cuda")


def _trained(seed):
    model = tiny_llama(seed=seed).to(DEVICE)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(4, 1000, (2, 16), device=DEVICE)
    for _ in range(2):
        model(x, labels=x).loss.backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def test_cuda_checkpoint_round_trip_with_cuda_rng(tmp_path):
    model, optim = _trained(0)
    torch.cuda.manual_seed_all(7)
    save_checkpoint(model, str(tmp_path / "c"), step=2, optimizer=optim)
    expected_draw = torch.rand(4, device=DEVICE)

    other = tiny_llama(seed=1).to(DEVICE)
    other_optim = torch.optim.AdamW(other.parameters(), lr=1e-3)
    torch.cuda.manual_seed_all(99)
    state = load_checkpoint(other, str(tmp_path / "c"), optimizer=other_optim)
    assert state.rng_restored and state.optimizer_restored
    assert torch.equal(torch.rand(4, device=DEVICE), expected_draw)  # the CUDA generator came back
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert b.device.type == "cuda" and torch.equal(a, b), name
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(optim.state[p]["exp_avg"], other_optim.state[q]["exp_avg"])


def test_cuda_checkpoint_merges_on_cpu(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = _trained(0)
    out = merge_checkpoint(save_checkpoint(model, str(tmp_path / "c")), str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.cpu()), name
