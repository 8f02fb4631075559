"""Real (optionally tensor-parallel) weights for the pipeline builders, from a meta or real model.

The weights equal an ordinary seeded construction, `torch.manual_seed(seed); Model(config)`
(sliced for this rank under tensor parallelism), so pipeline training can be compared with,
and resumed from, plain training. A model recorded under
`atorch.utils.meta_model_utils.record_module_init` is replayed; a model that was only put on
the meta device (`with torch.device("meta")`) is rebuilt from its Hugging Face config.

Memory: the whole model is built on the CPU once per rank and each stage keeps only its own
pieces; the rest is freed when the builder releases it. Peak memory during construction is
therefore one full model per rank (the exact mode of `materialize_module`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.utils.meta_model_utils import is_meta_module, is_recorded, replay_recorded_module

if TYPE_CHECKING:
    from atorch.tensor_parallel.plan import TPInfo


def rebuild_seeded(model: nn.Module, base_seed: int) -> nn.Module:
    """A real twin of meta `model`, equal to `torch.manual_seed(base_seed); type(model)(config)`.

    The caller's random state is left untouched.
    """
    if is_recorded(model):
        return replay_recorded_module(model, seed=base_seed)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} is on the meta device but was not built under record_module_init() "
                         "and has no `config` to rebuild it from; build it inside `with record_module_init():`")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(base_seed)
        return type(model)(config)


def materialize_model(model: nn.Module, base_seed: int, tensor_group: Optional[dist.ProcessGroup] = None,
                      tpinfo: Optional[TPInfo] = None, coords: Optional[Mapping[str, int]] = None) -> nn.Module:
    """This rank's real model: `model` itself when it has real weights, else built from `base_seed`.

    With a `tensor_group` of more than one rank, the model is sharded with `tpinfo` (None: the
    tensor-parallel preset of its model type) and its dropout streams are seeded from
    `base_seed` and this rank's parallel `coords` (None: from atorch's default layout), exactly
    as the `tensor_parallel` optimization does.
    """
    from atorch.tensor_parallel.mappings import group_size

    meta = is_meta_module(model)
    if tensor_group is None or group_size(tensor_group) == 1:
        return rebuild_seeded(model, base_seed) if meta else model

    from atorch.tensor_parallel import init_randomizer, materialize_tp_module, shard_model, tpinfo_for_model

    randomizer = init_randomizer(base_seed, coords)
    if tpinfo is None:
        tpinfo = tpinfo_for_model(model)
    if meta and is_recorded(model):
        # gather_logits=False: the last stage's loss takes the vocabulary slices (pipeline/batches.py).
        marked = shard_model(model, tpinfo, tensor_group, randomizer=randomizer, gather_logits=False)
        return materialize_tp_module(marked, base_seed, group=tensor_group, randomizer=randomizer)
    real = rebuild_seeded(model, base_seed) if meta else model
    return shard_model(real, tpinfo, tensor_group, randomizer=randomizer, gather_logits=False)
