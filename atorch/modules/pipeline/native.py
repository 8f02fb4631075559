"""Native pipeline parallelism: HF decoder stages driven by `torch.distributed.pipelining` schedules.

`build_stage_module` cuts this rank's stage out of a (meta or real) model. The stage keeps
its pieces under their original names, so its `state_dict()` keys are the model's own
(`model.layers.2.mlp.up_proj.weight`) and a stage checkpoint is a slice of the HF checkpoint.
`NativePipeline` owns the schedule (GPipe or 1F1B over atorch's "pipeline" group), the
gradient sum of a tied embedding/head pair that sits on two stages, and the training step.
Its loss is the per-rank batch's token mean, exactly as unsplit training computes it, whatever
the micro-batches' token counts (padded labels); data ranks are averaged with equal weights, as
DDP averages them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from atorch.modules.pipeline.batches import (
    IGNORE_INDEX,
    POSITION_IDS_KEY,
    causal_lm_loss,
    check_labels_fit_logits,
    check_pipeline_batch,
    hf_labels,
    pipeline_inputs,
)
from atorch.modules.pipeline.materialize import materialize_model
from atorch.modules.pipeline.partition import StagePlan, plan_stages
from atorch.modules.pipeline.patchers import (
    CustomPatcher,
    PieceSpec,
    expand_patcher,
    pieces_take_position_ids,
    resolve_patcher,
    tied_head_paths,
)
from atorch.utils.meta_model_utils import DEFAULT_BASE_SEED
from atorch.utils.module_utils import find_transformer_block_classes

if TYPE_CHECKING:  # atorch/modules never imports atorch/auto at run time (ARCHITECTURE.md)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from transformers import PretrainedConfig

    from atorch.auto.result import AutoAccelerateResult

SCHEDULES = ("gpipe", "1f1b")


def check_schedule_chunks(schedule: str, chunks: int, num_stages: int) -> None:
    """ValueError where torch's schedule would refuse `chunks` micro-batches over `num_stages` stages.

    torch.distributed.pipelining's `Schedule1F1B` needs at least one micro-batch per stage (its
    warm-up fills every stage); `ScheduleGPipe` takes any number.
    """
    if schedule == "1f1b" and chunks < num_stages:
        raise ValueError(f"pipeline_parallel: schedule='1f1b' needs at least one micro-batch per stage, but chunks="
                         f"{chunks} is fewer than the {num_stages} pipeline stages; set chunks >= {num_stages} (None "
                         "gives one per stage), or use schedule='gpipe'")


# Why a last stage's labels can disagree with its logits though its own batch is consistent (labels shaped like
# its input_ids, checked before the schedule runs): the logits were computed from another rank's input_ids.
PIPELINE_LABELS_HINT = ("; on a pipeline's last stage the logits come from the input_ids that the pipeline's first "
                        "stage (another rank) was given and the labels from this rank's batch, so the ranks of this "
                        "pipeline were given batches of different shapes at this step: give every rank of a pipeline "
                        "the same batch (the result's dataloader does)")

# How many (stage, schedule) pairs a NativePipeline keeps, one per recently seen batch shape (`_schedule_for`).
# Each holds receive buffers for every micro-batch of its shape (about one step's inter-stage activations and
# their gradients), so an unbounded cache grows with every new length a pad-to-longest collator produces; a few
# cover the usual repeats (an epoch's full batches and its smaller last one, a handful of bucketed lengths).
SCHEDULE_CACHE_SIZE = 4


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of `logits` summed over the predicted tokens (labels not `IGNORE_INDEX`);
    divided by the token count it is `causal_lm_loss`'s mean."""
    return causal_lm_loss(logits, labels, reduction="sum")


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens of `labels` a causal-LM loss predicts (the shifted labels that are not ignored)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at dotted `path` under `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class PipelineStageModule(nn.Module):
    """One pipeline stage: some pieces of a model, registered under their original paths.

    `forward(*inputs)` runs the pieces' patches in order on the tuple the previous stage sent
    (the first stage receives `(input_ids, attention_mask)`, and the batch's position_ids third where
    its first piece takes them; the last returns the logits).

    `block_classes` names the original model's transformer block classes: the stage states them
    as its `_no_split_modules`, as a Hugging Face model does, so what looks for the blocks
    (activation checkpointing, FSDP wrapping) finds them in the stage, whose blocks no longer
    sit in one `nn.ModuleList`.

    `hf_config` is the Hugging Face config the pieces' layers read at run time (e.g. their
    attention implementation) and `hf_supports_sdpa` whether the model's class offers sdpa: a
    stage is no `PreTrainedModel`, and module_replace switches attention through them.
    """

    def __init__(self, pieces: Sequence[Tuple[PieceSpec, nn.Module]], stage_index: int, num_stages: int,
                 block_classes: Sequence[str] = (), hf_config: Optional[PretrainedConfig] = None,
                 hf_supports_sdpa: bool = False):
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.hf_config = hf_config
        self.hf_supports_sdpa = hf_supports_sdpa
        self._no_split_modules: List[str] = list(block_classes)
        self._piece_specs: List[PieceSpec] = [spec for spec, _ in pieces]
        # (embedding weight, head weight) names of a tied pair split over two stages (build_stage_module sets
        # it on every stage): one logical weight kept as two copies whose gradients are summed every step, so
        # a checkpoint maps the copies' optimizer states onto the tied model's one parameter and back.
        self.tied_weight_names: Optional[Tuple[str, str]] = None
        for spec, module in pieces:
            _attach(self, spec.path, module)

    @property
    def piece_paths(self) -> List[str]:
        return [p.path for p in self._piece_specs]

    def forward(self, *inputs: torch.Tensor) -> Any:
        x: Any = tuple(inputs)
        for spec in self._piece_specs:
            x = spec.patch(self.get_submodule(spec.path), x if isinstance(x, tuple) else (x,))
        return x


@dataclass
class StageBuild:
    """What `build_stage_module` decided: the stage, the plan it follows and the tied pair, if split."""

    module: PipelineStageModule
    plan: StagePlan
    stage_index: int
    tied_paths: Optional[Tuple[str, str]]  # (embedding, head) living on two different stages
    takes_position_ids: bool = False  # the first piece takes the batch's position_ids (patchers.takes_position_ids)


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int,
                       custom_patcher: Optional[CustomPatcher] = None, partition_method: str = "parameters",
                       base_seed: int = DEFAULT_BASE_SEED, tie_first: bool = True) -> StageBuild:
    """Materialize `model` (if on meta) and keep the pieces of stage `stage_index` of `num_stages`.

    `tie_first`: when the model ties its LM head to its input embedding and they land on
    different stages, report the pair so their gradients are summed every step (one logical
    weight, as in the unsplit model); False lets the two copies train apart.
    """
    patcher = resolve_patcher(model, custom_patcher)
    pieces = expand_patcher(model, patcher)
    plan = plan_stages(model, pieces, num_stages, partition_method)
    tied = tied_head_paths(model, pieces) if tie_first else None
    if tied is not None:
        index = {p.path: i for i, p in enumerate(pieces)}
        if plan.stage_of(index[tied[0]]) == plan.stage_of(index[tied[1]]):
            tied = None  # same stage: already one Parameter
    blocks = [cls.__name__ for cls in find_transformer_block_classes(model)]
    real = materialize_model(model, base_seed)
    mine = [(spec, real.get_submodule(spec.path)) for spec in plan.stage_pieces(stage_index)]
    stage = PipelineStageModule(mine, stage_index, num_stages, blocks, hf_config=getattr(real, "config", None),
                                hf_supports_sdpa=bool(getattr(real, "_supports_sdpa", False)))
    if tied is not None:
        stage.tied_weight_names = (f"{tied[0]}.weight", f"{tied[1]}.weight")
    return StageBuild(stage, plan, stage_index, tied, pieces_take_position_ids(pieces))


class NativePipeline:
    """The schedule of one stage and everything a training step needs around it.

    Args:
        stage_module: this rank's stage.
        stage_index, num_stages: position in the pipeline.
        group: the pipeline process group (atorch's "pipeline" group).
        chunks: micro-batches per step; the per-rank batch must divide into them.
        schedule: "gpipe" (all forwards, then all backwards) or "1f1b" (bounded activations; needs
            chunks >= num_stages, `check_schedule_chunks`).
        loss_fn: None (default): the causal-LM loss as a token mean over the whole batch: each
            micro-batch's summed token losses divided by the batch's predicted tokens (labels not
            -100), so padded micro-batches with unequal token counts train exactly as the unsplit
            batch. Else `fn(logits, labels)`, a mean over one micro-batch; the micro-batch means
            are averaged (the batch mean only where the micro-batches weigh alike).
        data_group: the data-parallel group the gradients are averaged over (None: no data parallelism).
        tied_group, tied_param: the group of the first and last stage and this stage's side of a
            tied embedding/head weight, when the pair is split across them.
        takes_position_ids: the first stage takes the batch's position_ids; False: a batch with
            them is refused (`batches.check_pipeline_batch`), as is any key the stages never see.

    Gradients are synchronized here rather than by DDP: the micro-batches accumulate locally
    and one coalesced all-reduce per step averages them over the data group. (DDP around a
    stage fails in torch 2.13 when its reducer rebuilds buckets after a multi-micro-batch
    first step: "rebuilt parameter indices size is not same as original model parameters size".)
    """

    def __init__(self, stage_module: nn.Module, stage_index: int, num_stages: int, group: dist.ProcessGroup,
                 device: torch.device, chunks: int, schedule: str = "gpipe",
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 data_group: Optional[dist.ProcessGroup] = None, tied_group: Optional[dist.ProcessGroup] = None,
                 tied_param: Optional[nn.Parameter] = None, takes_position_ids: bool = False):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; valid schedules are {list(SCHEDULES)}")
        check_schedule_chunks(schedule, chunks, num_stages)
        self.stage_module = stage_module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.chunks = chunks
        self.data_group = data_group
        self.tied_group = tied_group
        self.tied_param = tied_param
        self.takes_position_ids = takes_position_ids
        self.device = device
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        # The last stage's count of the current batch's predicted tokens (set by forward_backward).
        self._batch_tokens = torch.ones(())
        # One stage and schedule per batch shape: torch.distributed.pipelining fixes the shapes it sends
        # between stages at a schedule's first step, so a batch of other rows (an epoch's smaller last batch)
        # or another sequence length (a pad-to-longest collator) gets its own. Every stage of a pipeline sees the
        # same batch, so all build (and evict) it together. Keyed by `_shape_key`, least recently used last.
        self._schedules: OrderedDict[Tuple[Any, ...], PipelineScheduleSingle] = OrderedDict()

    def _micro_batch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the batch loss: the micro-batch losses (and their gradients) add up to it."""
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels) / self.chunks
        check_labels_fit_logits(logits, labels, PIPELINE_LABELS_HINT)
        return summed_token_loss(logits, labels) / self._batch_tokens.to(logits.device)

    def _new_schedule(self) -> Tuple[PipelineStage, PipelineScheduleSingle]:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.stage_module, self.stage_index, self.num_stages, self.device, group=self.group)
        schedule_cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        # scale_grads=False: each micro-batch's loss is already its share of the batch loss
        # (`_micro_batch_loss`), so the accumulated gradients are the batch loss's, as in unsplit training.
        return stage, schedule_cls(stage, n_microbatches=self.chunks, loss_fn=self._micro_batch_loss,
                                   scale_grads=False)

    @staticmethod
    def _shape_key(batch: Mapping[str, torch.Tensor]) -> Tuple[Any, ...]:
        """What fixes the tensors a stage sends and receives: the shape and dtype of input_ids (the mask's and
        position_ids' follow them, `pipeline_inputs`) and whether position_ids are sent along."""
        input_ids = batch["input_ids"]
        return tuple(input_ids.shape), input_ids.dtype, POSITION_IDS_KEY in batch

    def _schedule_for(self, batch: Mapping[str, torch.Tensor]) -> PipelineScheduleSingle:
        """The schedule for `batch`'s shape, built on first use; at most `SCHEDULE_CACHE_SIZE` are kept.

        A new one infers its shapes in its first step (one extra forward and backward of a micro-batch, with a
        few small messages between the stages): pad batches to a few fixed lengths (e.g. pad_to_multiple_of)
        where that matters. Every rank of the pipeline sees the same sequence of shapes, so all evict alike.
        """
        key = self._shape_key(batch)
        schedule = self._schedules.get(key)
        if schedule is None:
            if len(self._schedules) >= SCHEDULE_CACHE_SIZE:
                self._schedules.popitem(last=False)
            schedule = self._new_schedule()[1]
            self._schedules[key] = schedule
        self._schedules.move_to_end(key)
        return schedule

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward_backward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run the schedule on one per-rank batch (HF dict); returns its loss on every stage.

        The loss is the sum of the micro-batch shares (`_micro_batch_loss`): the batch's token-mean
        loss, broadcast from the last stage so every rank of the pipeline returns the same value.
        """
        # Every rank checks its batch before the schedule's first send: a key the stages would never see
        # (or a batch that is no dict) is a ValueError everywhere, not silent training without it.
        check_pipeline_batch(batch, self.takes_position_ids)
        # The rows of input_ids (2-D, checked above), not of whichever key comes first: position_ids
        # of shape [1, tokens] stand for every row.
        rows = batch["input_ids"].shape[0]
        if rows % self.chunks != 0:
            raise ValueError(f"pipeline_parallel: the per-rank batch of {rows} rows does not split into chunks="
                             f"{self.chunks} equal micro-batches; make the global batch size a multiple of "
                             f"chunks x data-parallel size")
        args = pipeline_inputs(batch, self.takes_position_ids) if self.is_first else ()
        losses: List[torch.Tensor] = []
        target = hf_labels(batch) if self.is_last else None
        if target is not None:
            # clamp: a batch with no predicted token has loss 0 and no gradient (not 0 / 0).
            self._batch_tokens = predicted_tokens(target).clamp(min=1)
        schedule = self._schedule_for(batch)
        schedule.step(*args, target=target, losses=losses if self.is_last else None, return_outputs=False)
        self._average_data_parallel_grads()
        if self.tied_param is not None and self.tied_param.grad is not None:
            # Embedding (first stage) and head (last stage) are one weight: both apply the summed gradient.
            dist.all_reduce(self.tied_param.grad, group=self.tied_group)
        device = next(self.stage_module.parameters()).device
        loss = torch.stack([l.detach().float() for l in losses]).sum() if self.is_last else \
            torch.zeros((), device=device)
        if self.num_stages > 1:
            dist.broadcast(loss, src=dist.get_global_rank(self.group, self.num_stages - 1), group=self.group)
        return loss


    @torch.no_grad()
    def _average_data_parallel_grads(self) -> None:
        if self.data_group is None or dist.get_world_size(self.data_group) == 1:
            return
        params = [p for p in self.stage_module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # keep the flat buffer identical in layout on every data rank
                p.grad = torch.zeros_like(p)
        grads: List[torch.Tensor] = [p.grad for p in params if p.grad is not None]  # all set just above
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.data_group)
        flat.div_(dist.get_world_size(self.data_group))
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def pipeline_train_step(result: AutoAccelerateResult, batch: Any) -> torch.Tensor:
    """`atorch.auto.train_step` for `pipeline_parallel`: schedule forward/backward, then step and zero grads.

    Every rank calls it with its data rank's batch (the result's dataloader gives it); the
    return value is that batch's loss on every rank of the pipeline.
    """
    pipeline, optim = result.pipeline, result.optim
    if pipeline is None or optim is None:
        raise ValueError("pipeline_train_step needs the result of a pipeline_parallel strategy, with its optimizer")
    batch = result.prepare_input(batch)
    loss = pipeline.forward_backward(batch)
    optim.step()
    optim.zero_grad(set_to_none=True)
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    return loss


@torch.no_grad()
def gather_pipeline_state_dict(stage_module: nn.Module, group: dist.ProcessGroup) -> Dict[str, torch.Tensor]:
    """The whole model's state dict (original keys, on the CPU) on every rank of the pipeline `group`.

    Collective over `group`. A tied head/embedding pair appears under both keys, like the
    state dict of the unsplit model.
    """
    local = {k: v.detach().cpu() for k, v in stage_module.state_dict().items()}
    parts: List[Optional[Dict[str, torch.Tensor]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    full: Dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part or {})
    return full

