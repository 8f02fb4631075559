"""Tensor parallelism for unmodified Hugging Face (and plain PyTorch) models.

- `plan`: `TPInfo` (which modules to split, by name suffix) and `resolve_tp_plan` (pure checks);
- `presets` / `hf_plan`: a TPInfo for a model, hand-written or translated from transformers' plan;
- `shard`: `shard_model`, `materialize_tp_module`, full state dicts (`gather_tp_state_dict`);
- `layers`, `experts`, `mappings`: column/row-parallel linears, vocabulary-parallel embedding,
  split mixture-of-experts, and the autograd collectives they use;
- `cross_entropy`: the vocabulary-parallel loss; `logits`: full logits and generation;
- `randomizer`: dropout streams per parallel dimension; `lora`: LoRA adapters on sharded linears;
- `apply`: the one function the `tensor_parallel` optimization calls.
"""

from atorch.tensor_parallel.apply import TensorParallelModel, apply_tensor_parallel, validate_tensor_parallel
from atorch.tensor_parallel.cross_entropy import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from atorch.tensor_parallel.hf_plan import tpinfo_from_transformers_plan
from atorch.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallelModule,
    VocabParallelEmbedding,
    shard_tensor,
    unshard_tensors,
)
from atorch.tensor_parallel.logits import gather_tp_logits
from atorch.tensor_parallel.plan import TPInfo, TPPlan, resolve_tp_plan
from atorch.tensor_parallel.presets import TP_PRESETS, tpinfo_for_model
from atorch.tensor_parallel.randomizer import MultiDimParallelRandomizer, fork_module_rng, get_randomizer, \
    init_randomizer
from atorch.tensor_parallel.shard import (
    gather_tp_state_dict,
    load_tp_state_dict,
    materialize_tp_module,
    shard_model,
    tp_manual_shard_custom_fn,
    tp_param_bytes,
    tp_plan_of,
)

__all__ = [
    "ColumnParallelLinear", "MultiDimParallelRandomizer", "RowParallelLinear", "ShardSpec", "TPInfo", "TPPlan",
    "TP_PRESETS", "TensorParallelModel", "TensorParallelModule", "VocabParallelCausalLMLoss", "VocabParallelEmbedding",
    "apply_tensor_parallel", "fork_module_rng", "gather_tp_logits", "gather_tp_state_dict", "get_randomizer",
    "init_randomizer", "load_tp_state_dict", "materialize_tp_module", "resolve_tp_plan", "shard_model",
    "shard_tensor", "tp_manual_shard_custom_fn", "tp_param_bytes", "tp_plan_of", "tpinfo_for_model",
    "tpinfo_from_transformers_plan", "unshard_tensors", "validate_tensor_parallel", "vocab_parallel_cross_entropy",
]
