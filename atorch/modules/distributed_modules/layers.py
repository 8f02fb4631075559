"""ATorch's import path of the tensor-parallel layers, with ATorch's constructors.

`ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` and `ParallelEmbedding`
here are the ATorch-constructible classes of `atorch.utils.tp_compat` (`orig_module=`,
`process_group=` default "tensor", `ranks=`, `init_method=` on a master weight): subclasses of
atorch's layers in `atorch.tensor_parallel.layers`, whose own constructors (sizes with
`group=`, `from_full`) are used from that path. `_initialize_affine_weight` is ATorch's helper
that fills a weight with this rank's slice of a master weight. Every other name of
`atorch.tensor_parallel.layers` is the same object here (imported, or read through the module
`__getattr__`, private names included).
"""

from typing import Any

from atorch.tensor_parallel import layers as _moved
from atorch.tensor_parallel.layers import (  # noqa: F401
    ShardSpec,
    TensorParallelModule,
    pad_to_multiple,
    shard_tensor,
    unshard_tensors,
)
from atorch.utils.tp_compat import (  # noqa: F401
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _initialize_affine_weight,
)

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "ShardSpec", "TensorParallelModule",
           "VocabParallelEmbedding", "pad_to_multiple", "shard_tensor", "unshard_tensors"]


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
