"""ATorch's auto_accelerate keywords and positional order, translated by `atorch.auto.compat` (pure).

From ATorch (dlrover bfd04ef1, `atorch/auto/accelerate.py` and `model_context.py`): the
positional order; `sample_batch` with `batch_size`/`expand_sample_batch` stands in for a dataset;
`distributed_sampler_cls(dataset, shuffle=, num_replicas=, rank=, seed=)`; `finetune_strategy`
resets the tunable configs of a loaded strategy.
"""

import pytest
import torch
from torch.utils.data import DistributedSampler

from atorch.auto.compat import (
    ATORCH_POSITIONAL_ORDER,
    bind_atorch_positional,
    build_distributed_sampler,
    finetune_strategy_items,
    translate_atorch_kwargs,
)
from atorch.auto.strategy import Strategy


def test_positional_order_is_atorchs():
    assert ATORCH_POSITIONAL_ORDER[:10] == ("model", "optim_func", "dataset", "loss_func", "prepare_input",
                                            "model_input_format", "optim_args", "optim_param_func",
                                            "dataloader_args", "distributed_sampler_cls")
    assert ATORCH_POSITIONAL_ORDER[10:] == ("excluded", "included", "load_strategy", "lr_scheduler_cls",
                                            "lr_scheduler_args", "finetune_strategy", "save_strategy_to_file")
    bound = bind_atorch_positional("m", torch.optim.SGD, None, None, None, "unpack_dict", {"lr": 1}, None,
                                   {"batch_size": 8}, None, None, None, ["fsdp"], load_strategy_extra=1)
    assert bound["load_strategy"] == ["fsdp"] and bound["model_input_format"] == "unpack_dict"
    assert bound["dataloader_args"] == {"batch_size": 8} and bound["load_strategy_extra"] == 1
    with pytest.raises(TypeError, match="multiple values for argument"):
        bind_atorch_positional("m", None, dataset=None, optim_func=None)
    with pytest.raises(TypeError, match="at most 17 positional arguments"):
        bind_atorch_positional(*range(18))


def test_sample_batch_is_expanded_to_batch_size():
    out = translate_atorch_kwargs(sample_batch={"x": torch.ones(3)}, batch_size=4)
    assert out.sample_batch["x"].shape == (4, 3)
    kept = translate_atorch_kwargs(sample_batch={"x": torch.ones(2, 3)}, batch_size=2, expand_sample_batch=False)
    assert kept.sample_batch["x"].shape == (2, 3)
    with pytest.raises(ValueError, match="dataset and sample_batch exclude each other"):
        translate_atorch_kwargs(dataset=[1], sample_batch=torch.ones(1))
    with pytest.raises(ValueError, match=r"batch_size=8 sizes sample_batch, which is not given; .*dataloader_args"):
        translate_atorch_kwargs(batch_size=8)
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['sample_btach'\]"):
        translate_atorch_kwargs(sample_btach=1)
    assert translate_atorch_kwargs(meta_init_offload_name="x").ignored == {"meta_init_offload_name": "x"}


def test_distributed_sampler_cls():
    data = list(range(10))
    sampler = build_distributed_sampler(DistributedSampler, data, num_replicas=2, rank=1, shuffle=False, seed=3)
    assert list(sampler) == [1, 3, 5, 7, 9]

    class NoSeed:
        def __init__(self, dataset, num_replicas, rank, shuffle=True):
            self.args = (num_replicas, rank, shuffle)

    assert build_distributed_sampler(NoSeed, data, 4, 2, shuffle=False).args == (4, 2, False)

    class Wrong:
        def __init__(self, dataset):
            pass

    with pytest.raises(ValueError, match=r"takes no \['num_replicas', 'rank'\]"):
        build_distributed_sampler(Wrong, data, 2, 0)
    assert translate_atorch_kwargs(distributed_sampler_cls=NoSeed, sampler_seed=5).sampler_cls is NoSeed
    with pytest.raises(ValueError, match="distributed_sampler_cls=3 must be a sampler class"):
        translate_atorch_kwargs(distributed_sampler_cls=3)


def test_finetune_strategy_resets_tunable_configs():
    loaded = Strategy([("parallel_mode", ([("data", 2)], None), False), ("checkpoint", ("Block",), True)])
    assert finetune_strategy_items(loaded).to_list() == [("parallel_mode", ([("data", 2)], None), False),
                                                         ("checkpoint", None, True)]
    assert translate_atorch_kwargs(load_strategy=loaded, finetune_strategy=True).finetune_strategy is True
    with pytest.raises(ValueError, match="finetune_strategy=True tunes a loaded strategy; pass load_strategy"):
        translate_atorch_kwargs(finetune_strategy=True)
