"""DeepSpeed ZeRO over one data rank without amp_native changes nothing (as torch ZeRO there): the search
space keeps only the candidate without it; with amp_native (a half module with fp32 master weights), a
user's ds_config, or more than one data rank, it stays.

Measured (world 1, tiny Llama, batch 8): zero1/zero2/fsdp with use_ds_zero=True and no amp gave the
plain strategy's losses to the last digit, and 16 to 37 ms per step against its 13 ms.
"""

from __future__ import annotations

from typing import Any, List, Optional

import pytest

from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib._sharding import deepspeed_installed
from atorch.auto.search import SearchSpace
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama

STAGES = {"zero1": 1, "zero2": 2, "fsdp": 3}


def _why(items: List[Any], world_size: int = 1) -> Optional[str]:
    """What `changes_nothing` says of the sharding optimization of the strategy `items`."""
    context = ValidationContext(world_size=world_size, model=tiny_llama(), global_batch_size=8)
    resolved = resolve_strategy(Strategy(items), context)
    (sharding,) = [r for r in resolved if r.name in STAGES]
    return type(sharding.optimization).changes_nothing(sharding.config, context)


@pytest.mark.parametrize("name", list(STAGES))
def test_deepspeed_over_one_data_rank_without_amp_changes_nothing(name):
    why = _why([(name, {"use_ds_zero": True})])
    assert why == f"DeepSpeed ZeRO stage {STAGES[name]} over a data-parallel group of 1 rank, without mixed " \
                  "precision or a ds_config, trains as without it"
    # Other numerics (bf16 module, fp32 master weights): a candidate of its own.
    assert _why(["amp_native", (name, {"use_ds_zero": True})]) is None
    # A user's ds_config may offload or change training.
    assert _why([(name, {"use_ds_zero": True, "ds_config": {"zero_optimization": {"stage": STAGES[name]}}})]) is None
    # Over two data ranks it shards.
    assert _why([(name, {"use_ds_zero": True})], world_size=2) is None


@pytest.mark.skipif(not deepspeed_installed(), reason="the space offers DeepSpeed only where it is installed")
def test_space_over_one_rank_keeps_deepspeed_only_with_amp():
    space = SearchSpace.default_for(tiny_llama(), world_size=1, device_type="cpu", global_batch_size=8)
    labels = [c.label() for c in space.candidates()]
    deepspeed = [label for label in labels if "deepspeed" in label]
    assert deepspeed and all("amp_native" in label for label in deepspeed), deepspeed
    why = [v for k, v in space.rejected.items() if "deepspeed" in k and "amp_native" not in k]
    assert why and all(v.startswith("the same as without it: ") and "DeepSpeed ZeRO stage" in v for v in why), why
    # Over two data ranks DeepSpeed without amp stays a candidate.
    two = SearchSpace.default_for(tiny_llama(), world_size=2, device_type="cpu", global_batch_size=8)
    assert any("deepspeed" in c.label() and "amp_native" not in c.label() for c in two.candidates())
