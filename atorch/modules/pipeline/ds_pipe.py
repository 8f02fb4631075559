"""`PipeModuleFromRecordedMeta`: a DeepSpeed `PipelineModule` built from an ordinary (meta) HF model.

Users do not rewrite their model into LayerSpecs: the custom patcher (a ready one for Llama
and GPT2) names the pieces in forward order, each piece becomes one pipeline layer, stages
are balanced by parameter count on the meta model, and only this rank's pieces are kept.
With `tie_first`, a head that shares the input embedding's weight stays one tied weight
across the first and last stage (DeepSpeed all-reduces its gradient between them).

This module imports DeepSpeed; `atorch.modules.pipeline` exposes the class lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import deepspeed
import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from atorch.modules.pipeline.batches import CausalLMLoss
from atorch.modules.pipeline.materialize import materialize_model
from atorch.modules.pipeline.partition import StagePlan, plan_stages
from atorch.modules.pipeline.patchers import (
    BLOCK,
    CustomPatcher,
    PatchedLayer,
    PieceSpec,
    expand_patcher,
    is_per_module_patcher,
    resolve_patcher,
    tied_piece_indices,
)
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED

if TYPE_CHECKING:
    from atorch.tensor_parallel.plan import TPInfo

TIED_KEY = "tied_embedding"


def ensure_deepspeed_comm() -> None:
    """Make DeepSpeed's communication layer wrap the process group atorch already created."""
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)


def build_topology(num_pipeline: int, num_tensor: int, num_data: int) -> PipeModelDataParallelTopology:
    """DeepSpeed's (pipe, data, model) topology; model varies fastest, like atorch's (tensor, data, pipeline)."""
    return PipeModelDataParallelTopology(num_pp=num_pipeline, num_mp=num_tensor, num_dp=num_data)


def check_topology_matches_atorch(topology: Any, layout: Any) -> None:
    """Raise unless DeepSpeed's coordinates of every rank equal atorch's tensor/data/pipeline coordinates.

    Tensor-parallel layers talk over atorch's "tensor" group while DeepSpeed reduces over its
    own model/data groups: both must hold the same ranks. Pure, and checks all ranks, so
    every rank reaches the same verdict.
    """
    names = {"model": "tensor", "data": "data", "pipe": "pipeline"}
    for rank in range(layout.world_size):
        coord = topology.get_coord(rank)
        coords = layout.coords(rank)
        theirs = {axis: getattr(coord, axis, 0) for axis in names}
        ours = {axis: coords.get(name, 0) for axis, name in names.items()}
        if ours != theirs:
            raise ValueError(f"rank {rank}: DeepSpeed topology coordinates {theirs} differ from atorch's parallel "
                             f"groups {ours}; create the groups as [('tensor', t), ('data', d), ('pipeline', p)] "
                             "with rank_order None")


class PieceSource:
    """Hands out the pieces of one materialized model to the layers DeepSpeed builds on this rank.

    `build()` runs on the first request (materialization, tensor-parallel sharding) and
    `release()` drops the model, after which only the pieces of this stage stay alive.
    """

    def __init__(self, build: Callable[[], nn.Module], pieces: Sequence[PieceSpec]):
        self._build: Optional[Callable[[], nn.Module]] = build
        self._model: Optional[nn.Module] = None
        self.pieces = list(pieces)

    def module(self, index: int) -> nn.Module:
        if self._model is None:
            if self._build is None:
                raise RuntimeError("PieceSource was released; pieces can no longer be built")
            self._model = self._build()
        return self._model.get_submodule(self.pieces[index].path)

    def release(self) -> None:
        self._build = None
        self._model = None

    def __repr__(self) -> str:  # DeepSpeed logs LayerSpecs with their arguments
        return f"PieceSource({len(self.pieces)} pieces)"


class SourcedLayer(PatchedLayer):
    """The pipeline layer of piece `index`, taken from a `PieceSource` when DeepSpeed builds it."""

    def __init__(self, source: PieceSource, index: int):
        piece = source.pieces[index]
        super().__init__(source.module(index), piece.patch, piece.path)
        self.kind = piece.kind


class PipeModuleFromRecordedMeta(PipelineModule):
    """A DeepSpeed `PipelineModule` holding this rank's stage of a Hugging Face causal LM.

    Args:
        meta_model: the model, built under `record_module_init` (or on the meta device, or with
            real weights, which are then used as they are).
        custom_patcher: `{module path: patch_fn}` in forward order (see `patchers`); None picks
            the preset for the model type (Llama, GPT2). ATorch's per-module form
            (`{"wpe": fn, "h.0": fn, ...}`) is accepted too.
        tie_first: keep an LM head that shares the input embedding's weight tied to it when
            they sit on different stages: one weight, its gradient summed over the first and
            last stage. With False the last stage trains its own copy of the weight.
        logit_helper: `fn(logits) -> logits` run on the last stage before the loss (gathering
            or post-processing logits); None runs nothing. With ATorch's per-module patcher
            form it is ATorch's `logit_helper(embedding, outputs)` of the tied logit piece.
        partition_method: "parameters" (blocks balanced by parameter count, default) or
            "uniform" (equal block counts). Embeddings and head never count.
        tpinfo: the tensor-parallel plan inside each stage when `tensor_group` has more than one
            rank (None: the preset of the model type).
        tensor_group: the tensor-parallel group, or None for none; by default ("atorch") the "tensor" group of
            atorch's default layout when one exists.
        randomizer_coords: this rank's coordinate per parallel dimension, which seeds the
            tensor-parallel dropout streams (None: from atorch's default layout).
        **pipeline_module_kwargs: for `PipelineModule`: `num_stages` or `topology`, `loss_fn`
            (default: the HF causal-LM loss, vocabulary-parallel under tensor parallelism),
            `base_seed` (also the seed the weights are materialized with; default
            `meta_model_utils.DEFAULT_BASE_SEED`),
            `activation_checkpoint_interval`, ...
    """

    def __init__(self, meta_model: nn.Module, custom_patcher: Optional[CustomPatcher] = None,
                 tie_first: bool = True, logit_helper: Optional[Callable] = None,
                 partition_method: str = "parameters", tpinfo: Optional[TPInfo] = None,
                 tensor_group: Union[torch.distributed.ProcessGroup, None, Literal["atorch"]] = "atorch",
                 randomizer_coords: Optional[Mapping[str, int]] = None,
                 **pipeline_module_kwargs: Any):
        ensure_deepspeed_comm()
        if logit_helper is not None and not callable(logit_helper):
            raise ValueError(f"logit_helper={logit_helper!r} must be a callable fn(logits) -> logits")
        kwargs = dict(pipeline_module_kwargs)
        topology = kwargs.get("topology")
        num_stages = topology.get_dim("pipe") if topology is not None else kwargs.get("num_stages")
        if num_stages is None:
            raise ValueError("PipeModuleFromRecordedMeta needs num_stages or topology")
        group: Optional[torch.distributed.ProcessGroup]
        if isinstance(tensor_group, str):
            if tensor_group != "atorch":
                raise ValueError(f"tensor_group={tensor_group!r}: pass a process group, None, or \"atorch\"")
            # Not given: the "tensor" group of atorch's default layout, for direct users of this
            # class; None (as deepspeed_3d_parallel passes without tensor parallelism) means none.
            group = _atorch_tensor_group()
        else:
            group = tensor_group
        patcher = resolve_patcher(meta_model, custom_patcher)
        # ATorch's per-module patcher form consumes tie_first and logit_helper(embedding, outputs) itself.
        per_module = is_per_module_patcher(meta_model, patcher)
        pieces = expand_patcher(meta_model, patcher, tie_first=tie_first, logit_helper=logit_helper)
        plan = plan_stages(meta_model, pieces, num_stages, partition_method)
        base_seed = kwargs.get("base_seed", DEFAULT_BASE_SEED)
        source = PieceSource(lambda: materialize_model(meta_model, base_seed, group, tpinfo, randomizer_coords), pieces)
        tied = tied_piece_indices(meta_model, pieces) if tie_first else None
        if tied is not None and plan.stage_of(tied[0]) == plan.stage_of(tied[1]):
            tied = None  # one stage holds both: they share one Parameter already, nothing to synchronize
        layers: List[Any] = []
        for i, piece in enumerate(pieces):
            if tied is not None and i in tied:
                # Each side builds its own piece; DeepSpeed keeps `module.weight` equal on both
                # stages (broadcast at start, gradients all-reduced between them).
                layers.append(TiedLayerSpec(TIED_KEY, SourcedLayer, source, i, tied_weight_attr="module.weight"))
            else:
                layers.append(LayerSpec(SourcedLayer, source, i))
        if logit_helper is not None and not per_module:
            layers.append(logit_helper)  # a function layer: DeepSpeed calls it last on the last stage
        # DeepSpeed's engine otherwise sizes its activation and gradient buffers at the first micro-batch and
        # reuses them: a later micro-batch of another sequence length (a pad-to-longest collator) then fails or
        # trains on garbage. Dynamic shapes send each activation's shape along (a small message per micro-batch).
        kwargs.setdefault("dynamic_shape", True)
        if "loss_fn" not in kwargs:
            vocab_size = getattr(getattr(meta_model, "config", None), "vocab_size", None)
            kwargs["loss_fn"] = CausalLMLoss(group, vocab_size)
        # Plain attributes read by _partition_layers inside PipelineModule.__init__.
        self._atorch_plan = plan
        self._atorch_tail = 1 if logit_helper is not None and not per_module else 0
        super().__init__(layers=layers, **kwargs)
        source.release()  # the pieces of other stages become garbage here
        self.stage_plan: StagePlan = plan
        self.tied_paths: Optional[Tuple[str, str]] = \
            (pieces[tied[0]].path, pieces[tied[1]].path) if tied is not None else None

    def _partition_layers(self, method: str = "parameters") -> None:
        # DeepSpeed's own "parameters" method builds every layer on every rank just to count
        # parameters; the plan was computed on the meta model instead.
        bounds = list(self._atorch_plan.bounds)
        bounds[-1] += self._atorch_tail
        self.parts = bounds
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=bounds[stage_id], stop=bounds[stage_id + 1])

    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        # Activation checkpointing (ds_config pipeline.activation_checkpoint_interval) applies to
        # transformer blocks only: DeepSpeed's reentrant checkpoint of an embedding, whose inputs
        # are integer ids, returns outputs with no gradient path and the backward pass fails.
        return all(getattr(f, "kind", None) == BLOCK for f in funcs)

    def local_layers(self) -> List[PatchedLayer]:
        """The model pieces of this stage, in forward order."""
        return [f for f in self.forward_funcs if isinstance(f, PatchedLayer)]


# DeepSpeed's PipelineEngine caches the metadata of a tensor-parallel partitioned activation (or gradient) at the
# first micro-batch and never refreshes it, even with dynamic_shape; the metadata itself travels with every
# micro-batch. Under tensor parallelism a micro-batch of another sequence length then rebuilt the activation at the
# first one's shape ("ProcessGroupGloo::allgather: invalid tensor size").
_PARTITION_META_CACHES = ("pipe_partition_input_meta_cache", "pipe_partition_output_meta_cache",
                          "pipe_partition_grad_meta_cache", "grad_partition_grad_layer_meta_cache")


def refresh_partition_meta_per_instruction(engine: Any) -> None:
    """Make a dynamic-shape DeepSpeed `PipelineEngine` read the partition metadata of each micro-batch afresh.

    Each instruction of its schedule (forward, backward, receive) fills a cache it finds empty from the
    micro-batch's own metadata and uses it at once; emptying them before every instruction costs a copy of a few
    integers to the CPU. Only engines that partition activations or gradients (tensor parallel, DeepSpeed's
    default pipe_partitioned / grad_partitioned) with dynamic_shape are changed.
    """
    if not getattr(engine, "dynamic_shape", False) or not (getattr(engine, "is_pipe_partitioned", False)
                                                           or getattr(engine, "is_grad_partitioned", False)):
        return
    missing = [name for name in _PARTITION_META_CACHES if not hasattr(engine, name)]
    if missing or not isinstance(getattr(engine, "_INSTRUCTION_MAP", None), dict):
        raise RuntimeError(f"this DeepSpeed's PipelineEngine lacks {missing or ['_INSTRUCTION_MAP']}: atorch cannot "
                           "make it take varying sequence lengths under tensor parallelism; set ds_config "
                           "pipeline.pipe_partitioned and pipeline.grad_partitioned to false")

    def fresh(run: Callable[..., Any]) -> Callable[..., Any]:
        def instruction(self: Any, **kwargs: Any) -> Any:
            for name in _PARTITION_META_CACHES:
                setattr(self, name, None)
            return run(self, **kwargs)
        return instruction

    # The engine binds `_INSTRUCTION_MAP[type(cmd)]` to itself per instruction: an instance attribute wins.
    engine._INSTRUCTION_MAP = {cmd: fresh(run) for cmd, run in type(engine)._INSTRUCTION_MAP.items()}


def _atorch_tensor_group() -> Optional[torch.distributed.ProcessGroup]:
    from atorch import distributed as adist

    if adist.parallel_size_or_one("tensor") > 1:
        return adist.parallel_group("tensor")
    return None
