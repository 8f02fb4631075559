"""Strategies that cannot work are refused while validating, before anything is applied; and error messages
whose suggested fix is code run as written.

- torch `fsdp`/`zero1`/`zero2` shard over the "data" group: a layout without a "data" dimension (e.g.
  `[("tensor", 2)]` on 2 ranks) is a ValueError naming the optimization and the missing dimension, raised by
  validation (it used to surface while applying, after tensor_parallel, as "unknown parallel group 'data'");
  `("data", 1)` is accepted (the README: ZeRO over one data rank is applied with a warning).
- `lora` with `tensor_parallel` on GPT-2 (Conv1D weights) is refused by `LoraOptimization.validate`, not by
  `atorch.tensor_parallel.lora.add_lora` after tensor_parallel was applied.
- `vocab_parallel_cross_entropy` without a "tensor" group suggests a `create_parallel_group` call that works.

The validation checks run in this process (milliseconds); one 2-rank run checks `auto_accelerate` itself.
"""

from __future__ import annotations

import re
from typing import Any, Dict

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.testing import run_distributed
from atorch.testing.models import tiny_gpt2, tiny_llama

TENSOR_ONLY = ("parallel_mode", ([("tensor", 2)], None))
TENSOR_AND_DATA_1 = ("parallel_mode", ([("tensor", 2), ("data", 1)], None))
SHARDINGS = ["fsdp", "zero1", "zero2"]


def _resolve(items, model=None):
    config = getattr(model, "config", None)
    return [r.name for r in resolve_strategy(Strategy(items), ValidationContext(world_size=2, model=model,
                                                                                  model_config=config))]


# -- torch ZeRO without a "data" dimension -----------------------------------------------------------------------

@pytest.mark.parametrize("sharding", SHARDINGS)
def test_sharding_without_a_data_dim_is_refused_at_validation(sharding):
    with pytest.raises(ValueError) as info:
        _resolve([TENSOR_ONLY, "tensor_parallel", sharding], model=tiny_llama())
    message = str(info.value)
    assert message.startswith(f"{sharding}: shards ")
    assert "over the 'data' parallel dimension, but parallel_mode's layout [('tensor', 2)] has no 'data'" in message
    assert "[('tensor', 2), ('data', 1)]" in message and f"drop {sharding}" in message


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_sharding_over_one_data_rank_is_accepted(sharding):
    assert _resolve([TENSOR_AND_DATA_1, "tensor_parallel", sharding], model=tiny_llama()) == [
        "parallel_mode", "tensor_parallel", sharding]
    assert _resolve([sharding])[-1] in ("ddp", sharding)   # no parallel_mode: every rank data-parallel


def test_deepspeed_zero_keeps_its_own_refusal_of_other_dims():
    with pytest.raises(ValueError, match=r"zero2 with use_ds_zero=True needs every rank data-parallel"):
        _resolve([TENSOR_ONLY, "tensor_parallel", ("zero2", {"use_ds_zero": True})], model=tiny_llama())


# -- lora + tensor_parallel on Conv1D layers -----------------------------------------------------------------------

def test_tensor_parallel_lora_on_gpt2_is_refused_at_validation():
    with pytest.raises(ValueError, match=r"lora with tensor_parallel supports nn.Linear layouts; targets \['c_attn'\] "
                                         r"match 2 layers that store a Conv1D weight \(GPT-2\), e.g. "
                                         r"'transformer.h.0.attn.c_attn'.*drop tensor_parallel"):
        _resolve([TENSOR_ONLY, "tensor_parallel", ("lora", {"r": 4})], model=tiny_gpt2())
    # Explicit targets are checked the same way (GPT-2's MLP is Conv1D too).
    with pytest.raises(ValueError, match="Conv1D"):
        _resolve([TENSOR_ONLY, "tensor_parallel", ("lora", {"r": 4, "target_modules": ["c_fc"]})], model=tiny_gpt2())


def test_lora_on_gpt2_without_tensor_parallel_and_tensor_parallel_lora_on_llama_are_accepted():
    assert "lora" in _resolve([("lora", {"r": 4})], model=tiny_gpt2())   # peft adapts Conv1D
    assert _resolve([TENSOR_ONLY, "tensor_parallel", ("lora", {"r": 4})], model=tiny_llama()) == [
        "parallel_mode", "tensor_parallel", "lora"]


# -- on 2 ranks: auto_accelerate refuses before applying; the cross-entropy hint runs as written -------------------

def _refusal(model: torch.nn.Module, strategy) -> str:
    from atorch.auto import auto_accelerate
    from atorch.testing.parity import TokenDataset

    try:
        auto_accelerate(model, torch.optim.AdamW, TokenDataset(n=8, seq_len=8), model_input_format="unpack_dict",
                        dataloader_args={"batch_size": 4}, load_strategy=strategy)
    except ValueError as e:
        return str(e)
    return "accepted"


def _two_ranks() -> Dict[str, Any]:
    import atorch.distributed as adist
    from atorch.tensor_parallel import TensorParallelModule, vocab_parallel_cross_entropy

    out: Dict[str, Any] = {}
    for sharding in SHARDINGS:
        model = tiny_llama()
        out[sharding] = _refusal(model, [TENSOR_ONLY, "tensor_parallel", sharding])
        out[f"{sharding}_untouched"] = not any(isinstance(m, TensorParallelModule) for m in model.modules())
    gpt2 = tiny_gpt2()
    out["lora"] = _refusal(gpt2, [TENSOR_ONLY, "tensor_parallel", ("lora", {"r": 4})])
    out["lora_untouched"] = not any(isinstance(m, TensorParallelModule) for m in gpt2.modules())

    adist.destroy_parallel_group()
    logits, target = torch.randn(2, 3, 4), torch.randint(0, 8, (2, 3))
    try:
        vocab_parallel_cross_entropy(logits, target, 0.0)
        out["hint"] = "no error"
    except ValueError as e:
        out["hint"] = str(e)
    suggested = re.search(r"with (atorch\.distributed\.create_parallel_group\(.*\)) \(one argument", out["hint"])
    out["suggested"] = suggested.group(1) if suggested else None
    if suggested:
        import atorch

        n = 2
        eval(suggested.group(1).replace(", ...", ""), {"atorch": atorch, "n": n})   # the hint, typed as written
        out["loss_shape"] = tuple(vocab_parallel_cross_entropy(logits, target, 0.0).shape)
    return out


# One spawn of 2 ranks: about 10 s on the shared 2-core machine.
def test_two_ranks_refuse_before_applying_and_the_cross_entropy_hint_works():
    for out in run_distributed(_two_ranks, 2, timeout=240):
        for sharding in SHARDINGS:
            assert f"validating the strategy failed on ranks [0, 1]: {sharding}: shards " in out[sharding]
            assert "has no 'data' dimension" in out[sharding]
            assert "applying" not in out[sharding] and out[f"{sharding}_untouched"]
        assert "validating the strategy failed on ranks [0, 1]: lora with tensor_parallel supports nn.Linear " \
               "layouts" in out["lora"]
        assert "applying" not in out["lora"] and out["lora_untouched"]
        assert "there is no 'tensor' parallel group" in out["hint"]
        assert out["suggested"] == "atorch.distributed.create_parallel_group(([('tensor', n), ...], None))"
        assert out["loss_shape"] == (2, 3)
