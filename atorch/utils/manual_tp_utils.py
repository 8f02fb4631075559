"""Old import path of atorch's tensor parallelism (`atorch.utils.manual_tp_utils.TPInfo`, as ATorch documents it).

Everything lives in `atorch.tensor_parallel` now: `plan` (TPInfo, resolve_tp_plan), `shard`
(sharding, materializing, full state dicts) and `logits`. The names are re-exported here.
"""

from atorch.tensor_parallel.logits import gather_tp_logits
from atorch.tensor_parallel.plan import (
    COL,
    EXPERTS,
    GRAD_REDUCE,
    PARALLEL_DROP,
    REPLIC_DROP,
    ROW,
    VOCAB,
    TPAction,
    TPInfo,
    TPPlan,
    resolve_tp_plan,
)
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
    "COL", "EXPERTS", "GRAD_REDUCE", "PARALLEL_DROP", "REPLIC_DROP", "ROW", "TPAction", "TPInfo", "TPPlan", "VOCAB",
    "gather_tp_logits", "gather_tp_state_dict", "load_tp_state_dict", "materialize_tp_module", "resolve_tp_plan",
    "shard_model", "tp_manual_shard_custom_fn", "tp_param_bytes", "tp_plan_of",
]
