"""A model the user already wrapped for distributed training is refused before anything runs.

auto_accelerate wraps the model for its strategy: DDP inside DDP reduced every gradient twice, and a model
sharded by FSDP2's `fully_shard` failed later, either inside DDP ("mixed torch.Tensor and DTensor") or with a
wrong diagnosis ("the model's weights differ across ranks ... set the same seed").
"""

import pytest
import torch
import torch.distributed as dist

from atorch.auto.arguments import validate_arguments
from atorch.testing import tiny_llama


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_ddp_model_is_refused_naming_its_module(world_of_one):
    wrapped = torch.nn.parallel.DistributedDataParallel(tiny_llama())
    with pytest.raises(TypeError, match=r"model is already a DistributedDataParallel \(around LlamaForCausalLM\); "
                                        r"pass model.module"):
        validate_arguments(model=wrapped)
    holder = torch.nn.Module()
    holder.inner = wrapped
    with pytest.raises(TypeError, match=r"model holds 'inner', already wrapped in DistributedDataParallel"):
        validate_arguments(model=holder)


def test_a_model_sharded_by_fully_shard_is_refused(world_of_one):
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama()
    fully_shard(model.model.layers[0])
    with pytest.raises(TypeError, match=r"model is already sharded by torch's fully_shard \(model.layers.0: "
                                        r"FSDPLlamaDecoderLayer\); pass the model before fully_shard"):
        validate_arguments(model=model)
    validate_arguments(model=tiny_llama())       # a plain model passes
