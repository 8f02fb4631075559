"""ATorch's import path of the tensor-parallel building blocks, which live in `atorch.tensor_parallel`.

`cross_entropy` and `mappings` are the moved modules themselves; `layers` and `randomizer` are
shims that add ATorch's constructors and randomizer calls (see each module's docstring).
"""

from atorch.modules.distributed_modules.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    ShardSpec,
    TensorParallelModule,
    VocabParallelEmbedding,
    shard_tensor,
    unshard_tensors,
)
from atorch.modules.distributed_modules.randomizer import get_MDPRInstance, get_randomizer, init_randomizer
from atorch.tensor_parallel.cross_entropy import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from atorch.tensor_parallel.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, fork_module_rng

__all__ = [
    "ColumnParallelLinear", "MultiDimParallelRandomizer", "ParallelEmbedding", "RowParallelLinear", "ShardSpec",
    "TensorParallelModule", "VocabParallelCausalLMLoss", "VocabParallelEmbedding", "copy_to_group",
    "fork_module_rng", "gather_from_group", "get_MDPRInstance", "get_randomizer", "init_randomizer",
    "reduce_from_group", "scatter_to_group", "shard_tensor", "unshard_tensors", "vocab_parallel_cross_entropy",
]
