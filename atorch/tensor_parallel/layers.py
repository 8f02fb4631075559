"""Tensor-parallel layers: column- and row-parallel linears and the vocabulary-parallel embedding.

Each layer holds only this rank's slice of the full weight, as an ordinary `nn.Parameter`
(so optimizers, DDP and state dicts see plain tensors), and knows how that slice was cut
(`ShardSpec`) so the full tensor can be rebuilt (`unshard_tensors`). Weights keep the layout
of the module they replace: `weight_layout="conv1d"` stores GPT-2's `Conv1D` weight as
[in, out], so gathered state dicts have the Hugging Face keys and shapes.

Layers built with `from_full(module, group)` slice an existing full module; layers built
with the constructor initialize the full weight (as `nn.Linear` / `nn.Embedding` would) and
keep their slice, so every rank must construct them under the same RNG state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from atorch.tensor_parallel.mappings import (
    Group,
    copy_to_group,
    gather_from_group,
    group_rank,
    group_size,
    reduce_from_group,
    scatter_to_group,
)

_LAYOUTS = ("linear", "conv1d")


@dataclass(frozen=True)
class ShardSpec:
    """How a full tensor of `full_size` along `dim` is cut into `world` slices.

    The tensor is zero-padded to `padded_size` (vocabulary padding), split into `stride`
    equal logical blocks (e.g. q, k, v of a fused projection) and each block into `world`
    chunks; rank r keeps chunk r of every block, concatenated.
    """

    dim: int
    full_size: int
    world: int
    stride: int = 1
    padded_size: Optional[int] = None

    @property
    def padded(self) -> int:
        return self.padded_size if self.padded_size is not None else self.full_size

    @property
    def local_size(self) -> int:
        return self.padded // self.world

    def check(self) -> None:
        """Raise ValueError when the sizes cannot be cut this way."""
        if self.padded < self.full_size:
            raise ValueError(f"padded size {self.padded} is smaller than the full size {self.full_size}")
        if self.stride > 1 and self.padded != self.full_size:
            raise ValueError(f"padding ({self.full_size} -> {self.padded}) cannot be combined with stride "
                             f"{self.stride}")
        if self.padded % (self.world * self.stride) != 0:
            raise ValueError(f"size {self.padded} is not divisible by tensor-parallel size {self.world} x stride "
                             f"{self.stride} = {self.world * self.stride}")


def pad_to_multiple(size: int, multiple: int) -> int:
    return int(math.ceil(size / multiple) * multiple)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full`, as a new contiguous tensor (the full one can be freed)."""
    spec.check()
    if full.shape[spec.dim] != spec.full_size:
        raise ValueError(f"tensor of shape {tuple(full.shape)} has size {full.shape[spec.dim]} along dim "
                         f"{spec.dim}; the shard spec expects {spec.full_size}")
    if spec.padded != spec.full_size:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded - spec.full_size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    blocks = full.chunk(spec.stride, dim=spec.dim)
    parts = [b.chunk(spec.world, dim=spec.dim)[rank] for b in blocks]
    return torch.cat(parts, dim=spec.dim).contiguous().clone()


def unshard_tensors(shards: List[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `shard_tensor` over all ranks' slices (in rank order): the full, unpadded tensor."""
    if len(shards) != spec.world:
        raise ValueError(f"got {len(shards)} shards for a tensor-parallel size of {spec.world}")
    per_rank_blocks = [s.chunk(spec.stride, dim=spec.dim) for s in shards]
    blocks = [torch.cat([blocks[b] for blocks in per_rank_blocks], dim=spec.dim) for b in range(spec.stride)]
    full = torch.cat(blocks, dim=spec.dim)
    return full.narrow(spec.dim, 0, spec.full_size)


class _GroupRef:
    """Holds a process group; copies share it, because process groups cannot be copied or pickled."""

    def __init__(self, group: Group):
        self.group = group

    def __deepcopy__(self, memo: dict) -> "_GroupRef":
        return self


class TensorParallelModule(nn.Module):
    """Base of the layers here: the group, this rank's place in it, and the shard spec of each parameter."""

    def __init__(self, group: Group):
        super().__init__()
        self._group_ref = _GroupRef(group)
        self.tp_size = group_size(group)
        self.tp_rank = group_rank(group)

    @property
    def group(self) -> Group:
        return self._group_ref.group

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """{parameter name: spec} for the parameters that are slices; the others are replicated."""
        raise NotImplementedError


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"weight_layout={layout!r}; valid values are {list(_LAYOUTS)}")


def _reset_like_linear(weight_full: torch.Tensor, bias_full: Optional[torch.Tensor], fan_in: int) -> None:
    # nn.Linear.reset_parameters, applied to the full tensors before slicing.
    nn.init.kaiming_uniform_(weight_full, a=math.sqrt(5))
    if bias_full is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias_full, -bound, bound)


class _ParallelLinear(TensorParallelModule):
    """What the column- and row-parallel linears share: sizes, layout, parameters, initialization."""

    def __init__(self, in_features: int, out_features: int, local_shape: Tuple[int, int], bias_size: Optional[int],
                 *, group: Group, weight_layout: str, device: Union[torch.device, str, None],
                 dtype: Optional[torch.dtype]):
        super().__init__(group)
        _check_layout(weight_layout)
        self.in_features = in_features
        self.out_features = out_features
        self.weight_layout = weight_layout
        rows, cols = local_shape   # (out, in) as nn.Linear stores it; Conv1D stores the transpose
        shape = (rows, cols) if weight_layout == "linear" else (cols, rows)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype)) if bias_size is not None
                     else None)

    def _linear_weight(self) -> torch.Tensor:
        """The local weight as `F.linear` wants it ([out, in])."""
        return self.weight if self.weight_layout == "linear" else self.weight.t()

    def _random_full_weight_and_bias(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Full-size tensors initialized as `nn.Linear` would, in this layer's layout, to be sliced."""
        full_shape = ((self.out_features, self.in_features) if self.weight_layout == "linear"
                      else (self.in_features, self.out_features))
        w = torch.empty(full_shape, device=self.weight.device, dtype=self.weight.dtype)
        b = torch.empty(self.out_features, device=w.device, dtype=w.dtype) if self.bias is not None else None
        _reset_like_linear(w, b, self.in_features)
        return w, b


def _module_layout(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    raise ValueError(f"{type(module).__name__} is neither nn.Linear nor transformers' Conv1D")


def _linear_sizes(module: nn.Module, layout: str) -> tuple:
    if layout == "linear":
        return module.in_features, module.out_features
    return module.nx, module.nf


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split by output rows: each rank computes its slice of the outputs.

    `gather_output=True` concatenates the slices (and drops vocabulary padding) so the caller
    sees the full output; otherwise the output stays split, which is what a following
    `RowParallelLinear` or the vocabulary-parallel cross entropy wants. `stride` > 1 splits
    each of `stride` fused blocks (GPT-2's q|k|v in `c_attn`) separately, so each rank holds
    whole heads of q, k and v. `in_features` / `out_features` are the full sizes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Group = None,
                 gather_output: bool = False, stride: int = 1, padded_out_features: Optional[int] = None,
                 weight_layout: str = "linear", device: Union[torch.device, str, None] = None,
                 dtype: Optional[torch.dtype] = None):
        tp_size = group_size(group)
        self.out_spec = ShardSpec(0, out_features, tp_size, stride, padded_out_features)
        self.out_spec.check()
        local_out = self.out_spec.local_size
        super().__init__(in_features, out_features, (local_out, in_features), local_out if bias else None,
                         group=group, weight_layout=weight_layout, device=device, dtype=dtype)
        self.gather_output = gather_output
        self.stride = stride
        if self.weight.device.type != "meta":
            self._init_from_full_random()

    def _weight_dim(self) -> int:
        return 0 if self.weight_layout == "linear" else 1

    def shard_specs(self) -> Dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(self._weight_dim(), self.out_features, self.tp_size, self.stride,
                                     self.out_spec.padded_size)}
        if self.bias is not None:
            specs["bias"] = self.out_spec
        return specs

    @torch.no_grad()
    def _init_from_full_random(self) -> None:
        w, b = self._random_full_weight_and_bias()
        specs = self.shard_specs()
        self.weight.copy_(shard_tensor(w, specs["weight"], self.tp_rank))
        if b is not None and self.bias is not None:
            self.bias.copy_(shard_tensor(b, specs["bias"], self.tp_rank))

    @classmethod
    def from_full(cls, module: nn.Module, group: Group, *, gather_output: bool = False, stride: int = 1,
                  padded_out_features: Optional[int] = None) -> "ColumnParallelLinear":
        """This rank's slice of an `nn.Linear` or `Conv1D` (whose weights stay in their layout)."""
        layout = _module_layout(module)
        in_f, out_f = _linear_sizes(module, layout)
        layer = cls(in_f, out_f, bias=module.bias is not None, group=group, gather_output=gather_output,
                    stride=stride, padded_out_features=padded_out_features, weight_layout=layout, device="meta")
        specs = layer.shard_specs()
        layer.weight = _sliced_parameter(cast(torch.Tensor, module.weight), specs["weight"], layer.tp_rank)
        if module.bias is not None:
            layer.bias = _sliced_parameter(cast(torch.Tensor, module.bias), specs["bias"], layer.tp_rank)
        return layer

    def local_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output, padding included, before any gather (`x` is the replicated input)."""
        return F.linear(x, self._linear_weight(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_output(copy_to_group(x, self.group))
        if self.tp_size > 1:
            if not self.gather_output:
                return y  # this rank's slice, vocabulary padding included
            y = gather_from_group(y, self.group)
            if self.stride > 1:
                # [rank][block][chunk] -> [block][rank][chunk]: back to the module's q|k|v order.
                lead = y.shape[:-1]
                chunk = self.out_spec.local_size // self.stride
                y = y.reshape(*lead, self.tp_size, self.stride, chunk).transpose(-3, -2).reshape(*lead, -1)
        if self.out_spec.padded != self.out_features:
            y = y[..., :self.out_features]
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.out_spec.local_size}), tp={self.tp_rank}/{self.tp_size}, stride={self.stride}, "
                f"gather_output={self.gather_output}, layout={self.weight_layout}, bias={self.bias is not None}")


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split by input columns: partial products are summed over the group.

    The input is expected already split along its last dimension (the output of a
    `ColumnParallelLinear` without gather) unless `input_is_parallel=False`. The bias is
    replicated and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Group = None,
                 input_is_parallel: bool = True, weight_layout: str = "linear",
                 device: Union[torch.device, str, None] = None, dtype: Optional[torch.dtype] = None):
        self.in_spec = ShardSpec(1 if weight_layout == "linear" else 0, in_features, group_size(group))
        self.in_spec.check()
        super().__init__(in_features, out_features, (out_features, self.in_spec.local_size),
                         out_features if bias else None, group=group, weight_layout=weight_layout, device=device,
                         dtype=dtype)
        self.input_is_parallel = input_is_parallel
        if self.weight.device.type != "meta":
            self._init_from_full_random()

    def shard_specs(self) -> Dict[str, ShardSpec]:
        return {"weight": self.in_spec}

    @torch.no_grad()
    def _init_from_full_random(self) -> None:
        w, b = self._random_full_weight_and_bias()
        self.weight.copy_(shard_tensor(w, self.in_spec, self.tp_rank))
        if b is not None and self.bias is not None:
            self.bias.copy_(b)

    @classmethod
    def from_full(cls, module: nn.Module, group: Group, *, input_is_parallel: bool = True) -> "RowParallelLinear":
        layout = _module_layout(module)
        in_f, out_f = _linear_sizes(module, layout)
        layer = cls(in_f, out_f, bias=module.bias is not None, group=group, input_is_parallel=input_is_parallel,
                    weight_layout=layout, device="meta")
        layer.weight = _sliced_parameter(cast(torch.Tensor, module.weight), layer.in_spec, layer.tp_rank)
        if module.bias is not None:
            layer.bias = _replicated_parameter(cast(torch.Tensor, module.bias))
        return layer

    def reduced_output(self, x: torch.Tensor) -> torch.Tensor:
        """The output without bias, summed over the group (`x` is this rank's slice of the input)."""
        return reduce_from_group(F.linear(x, self._linear_weight()), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.group)
        y = self.reduced_output(x)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_spec.local_size}), out_features={self.out_features}, "
                f"tp={self.tp_rank}/{self.tp_size}, layout={self.weight_layout}, bias={self.bias is not None}")


class VocabParallelEmbedding(TensorParallelModule):
    """An embedding table split by rows (token ids) over the group.

    The vocabulary is zero-padded to a multiple of the group size; rank r owns ids
    [r * V_pad / T, (r + 1) * V_pad / T). Each rank looks up the ids it owns (zeros for the
    others) and the partial results are summed over the group.
    """

    embed_scale: Optional[torch.Tensor]  # a non-persistent buffer (Gemma-style scaled embeddings), or None

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 group: Group = None, padded_num_embeddings: Optional[int] = None,
                 device: Union[torch.device, str, None] = None, dtype: Optional[torch.dtype] = None):
        super().__init__(group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        if padded_num_embeddings is None:
            padded_num_embeddings = pad_to_multiple(num_embeddings, self.tp_size)
        self.spec = ShardSpec(0, num_embeddings, self.tp_size, 1, padded_num_embeddings)
        self.spec.check()
        self.vocab_start = self.tp_rank * self.spec.local_size
        self.vocab_end = self.vocab_start + self.spec.local_size
        self.weight = nn.Parameter(torch.empty(self.spec.local_size, embedding_dim, device=device, dtype=dtype))
        # A scalar multiplying the looked-up rows (Gemma's scaled word embedding), copied by `from_full`.
        self.register_buffer("embed_scale", None, persistent=False)
        if self.weight.device.type != "meta":
            with torch.no_grad():
                full = torch.empty(num_embeddings, embedding_dim, device=self.weight.device, dtype=dtype)
                nn.init.normal_(full)
                if padding_idx is not None:
                    full[padding_idx].zero_()
                self.weight.copy_(shard_tensor(full, self.spec, self.tp_rank))

    @property
    def local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_end:
            return None
        return self.padding_idx - self.vocab_start

    def shard_specs(self) -> Dict[str, ShardSpec]:
        return {"weight": self.spec}

    @classmethod
    def from_full(cls, module: nn.Embedding, group: Group,
                  padded_num_embeddings: Optional[int] = None) -> "VocabParallelEmbedding":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{type(module).__name__} is not an nn.Embedding")
        unsupported = {k: getattr(module, k) for k in ("max_norm", "sparse")
                       if getattr(module, k) not in (None, False)}
        if module.scale_grad_by_freq:
            unsupported["scale_grad_by_freq"] = True
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding does not support nn.Embedding options {unsupported}")
        layer = cls(module.num_embeddings, module.embedding_dim, module.padding_idx, group=group,
                    padded_num_embeddings=padded_num_embeddings, device="meta")
        layer.weight = _sliced_parameter(cast(torch.Tensor, module.weight), layer.spec, layer.tp_rank)
        scale = getattr(module, "embed_scale", None)
        if scale is not None:
            layer.embed_scale = torch.as_tensor(scale).detach().clone()
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight, self.local_padding_idx)
        else:
            # nn.Embedding refuses an id outside the vocabulary; the masked lookup below would give
            # it a zero row without a word (a model other than the unsharded one). A device-side
            # assert on CUDA (no host sync, as nn.Embedding's own), raised at once on CPU; every
            # rank of the group holds the same ids, so every rank raises before the all-reduce.
            torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                                "VocabParallelEmbedding: a token id is outside the vocabulary "
                                f"[0, {self.num_embeddings})")
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight, self.local_padding_idx)
            out = reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) of "
                f"{self.spec.padded}, tp={self.tp_rank}/{self.tp_size}, padding_idx={self.padding_idx}")


def _sliced_parameter(full: torch.Tensor, spec: ShardSpec, rank: int) -> nn.Parameter:
    requires_grad = full.requires_grad
    with torch.no_grad():
        return nn.Parameter(shard_tensor(full.detach(), spec, rank), requires_grad=requires_grad)


def _replicated_parameter(full: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)
