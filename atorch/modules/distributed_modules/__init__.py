"""Tensor-parallel building blocks: layers, the autograd functions they communicate with,
the vocabulary-parallel cross entropy and the per-group random streams."""

from atorch.modules.distributed_modules.cross_entropy import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from atorch.modules.distributed_modules.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallelModule,
    VocabParallelEmbedding,
    shard_tensor,
    unshard_tensors,
)
from atorch.modules.distributed_modules.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from atorch.modules.distributed_modules.randomizer import (
    MultiDimParallelRandomizer,
    fork_module_rng,
    get_randomizer,
    init_randomizer,
)

__all__ = [
    "ColumnParallelLinear", "MultiDimParallelRandomizer", "RowParallelLinear", "ShardSpec", "TensorParallelModule",
    "VocabParallelCausalLMLoss", "VocabParallelEmbedding", "copy_to_group", "fork_module_rng", "gather_from_group",
    "get_randomizer", "init_randomizer", "reduce_from_group", "scatter_to_group", "shard_tensor", "unshard_tensors",
    "vocab_parallel_cross_entropy",
]
