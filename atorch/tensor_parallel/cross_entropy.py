"""Cross entropy over logits whose vocabulary dimension is split over a tensor-parallel group.

With a column-parallel LM head that does not gather its output, each rank holds logits for
its slice of the vocabulary. The loss needs only three reductions of one number per token
(max, sum of exponentials, target logit), so the full [tokens, vocab] logits never exist on
any rank. `VocabParallelCausalLMLoss` plugs this into a Hugging Face model's
`loss_function`, with the semantics of its `ForCausalLMLoss` (label shift, ignore index,
`num_items_in_batch`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from atorch.tensor_parallel.mappings import Group, group_rank, group_size


def _all_reduce_(t: torch.Tensor, op: "dist.ReduceOp.RedOpType", group: Group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_start: int,
                vocab_size: int, ignore_index: int, label_smoothing: float) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        # A target that no rank's slice holds (-1 as padding, an id past the vocabulary) would score a target
        # logit of 0 on every rank: a finite, silently wrong loss where torch's cross entropy raises. Every rank
        # of the group holds the same targets, so each raises alike before the first all-reduce (on the host: a
        # check of device tensors would wait for the device every step; there the loss is NaN instead).
        outside = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
        if target.device.type == "cpu" and bool(outside.any()):
            raise ValueError(f"vocab_parallel_cross_entropy: target holds {int(target[outside][0])}, outside the "
                             f"vocabulary of {vocab_size} (ignored positions must be {ignore_index})")
        logits = logits.float()
        # Columns past the real vocabulary are padding: they must not take probability mass.
        valid = max(0, min(local_vocab, vocab_size - vocab_start))
        if valid < local_vocab:
            logits = logits.clone()
            logits[..., valid:] = float("-inf")
        # Subtracting the global max keeps exp() finite; any constant would give the same loss.
        logits_max = logits.max(dim=-1).values
        _all_reduce_(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce_(exp.sum(dim=-1), dist.ReduceOp.SUM, group)

        owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        _all_reduce_(target_logit, dist.ReduceOp.SUM, group)

        ignored = target == ignore_index
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            # torch's convention: the target distribution is (1 - eps) one-hot + eps uniform over
            # the real vocabulary, so the loss adds eps * mean over the vocabulary of -log p.
            sum_shifted = _all_reduce_(shifted[..., :valid].sum(dim=-1), dist.ReduceOp.SUM, group)
            uniform = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * uniform
        loss = loss.masked_fill(ignored, 0.0).masked_fill(outside, float("nan"))
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.label_smoothing, ctx.vocab_size, ctx.valid = label_smoothing, vocab_size, valid
        ctx.save_for_backward(exp, local_target, owned, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor
                 ) -> Tuple[Optional[torch.Tensor], None, None, None, None, None, None]:
        softmax, local_target, owned, ignored = ctx.saved_tensors
        # d loss / d logits = softmax - (1 - eps) one_hot(target) - eps / V on the real vocabulary.
        # The saved buffer is reused (as Megatron does) to avoid a second [tokens, V_local]
        # allocation, so a retained graph cannot be backpropagated through twice.
        grad = softmax
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.view(-1)] -= (1.0 - ctx.label_smoothing) * owned.view(-1).to(flat.dtype)
        if ctx.label_smoothing > 0:
            flat[:, :ctx.valid] -= ctx.label_smoothing / ctx.vocab_size
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad, None, None, None, None, None, None


GroupSpec = Union[str, Group]
_NO_GROUP = object()   # "the tensor group" default, told apart from an explicit None (the whole world)


def _resolve_group(group: Any) -> Group:
    if group is _NO_GROUP:
        group = "tensor"
    if not isinstance(group, str):
        return group
    if not dist.is_available() or not dist.is_initialized():
        return None   # a plain single process: a group of one
    from atorch.distributed.distributed import parallel_group

    found = parallel_group(group)
    if found is None and dist.get_world_size() == 1:
        return None   # one process: the world is the group of one
    if found is None:
        raise ValueError(f"vocab_parallel_cross_entropy: there is no {group!r} parallel group; create it with "
                         f"atorch.distributed.create_parallel_group(([({group!r}, n), ...], None)) (one argument: "
                         "the (dims, rank_order) pair), or pass group= (a ProcessGroup, or None for the whole world)")
    return found


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0, *,
                                 group: Any = _NO_GROUP, vocab_size: Optional[int] = None,
                                 ignore_index: int = -100, reduction: str = "none") -> torch.Tensor:
    """Cross entropy of `target` (global ids) given this rank's vocabulary slice of `logits`.

    ATorch's (and Megatron's) call: `vocab_parallel_cross_entropy(logits, target, label_smoothing)`
    over the "tensor" parallel group, one loss per token. `logits` is [..., V_local] where rank
    r of `group` holds ids [r * V_local, (r + 1) * V_local); `group` is a parallel group name
    (default "tensor"; a single process needs none), a ProcessGroup, or None for the whole
    world; `vocab_size` is the real vocabulary (ids at or past it are padding). The result
    equals `F.cross_entropy(gathered_logits, target, ignore_index=, label_smoothing=,
    reduction=)` in float32: `label_smoothing` follows torch's convention (eps spread
    uniformly over the whole real vocabulary, the target included); reduction "none" (default,
    as ATorch: 0 at `ignore_index`), "mean" (over targets that are not `ignore_index`) or "sum".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; valid values are 'mean', 'sum', 'none'")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 1.0:
        hint = (" (the third argument is label_smoothing, as in ATorch; pass the group as group=)"
                if not isinstance(label_smoothing, (int, float)) else "")
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r} must be a float in "
                         f"[0, 1){hint}")
    group = _resolve_group(group)
    local_vocab = logits.shape[-1]
    world = group_size(group)
    if vocab_size is None:
        vocab_size = local_vocab * world
    if not local_vocab * (world - 1) < vocab_size <= local_vocab * world:
        raise ValueError(f"vocab_size={vocab_size} does not fit {world} slices of {local_vocab} logits: expected "
                         f"{local_vocab * (world - 1) + 1} to {local_vocab * world} (the last slice may hold "
                         "padding columns, no other)")
    vocab_start = group_rank(group) * local_vocab
    if world == 1 and vocab_size == local_vocab:
        # reshape, not view: shifted logits (logits[:, :-1]) are not contiguous.
        return F.cross_entropy(logits.float().reshape(-1, local_vocab), target.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction, label_smoothing=float(label_smoothing)
                               ).view(target.shape if reduction == "none" else ())
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, ignore_index,
                                            float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


class VocabParallelCausalLMLoss:
    """A Hugging Face `loss_function` for a causal LM whose logits are split over the vocabulary.

    Same contract as `transformers.loss.loss_utils.ForCausalLMLoss`: labels are shifted left
    (unless `shift_labels` is given), `ignore_index` tokens are skipped, and the sum is
    divided by `num_items_in_batch` when given (else the mean over counted tokens).
    """

    def __init__(self, group: Group, vocab_size: int):
        from atorch.tensor_parallel.layers import _GroupRef

        self._group_ref = _GroupRef(group)
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                 num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        shift_labels = shift_labels.to(logits.device)
        losses = vocab_parallel_cross_entropy(logits, shift_labels, group=self._group_ref.group,
                                              vocab_size=self.vocab_size, ignore_index=ignore_index,
                                              reduction="none")
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(losses.device)
            return losses.sum() / num_items_in_batch
        return losses.sum() / (shift_labels != ignore_index).sum()
