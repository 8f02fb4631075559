"""ATorch's tensor-parallel constructors and randomizer API, over atorch's tensor-parallel layers.

ATorch's scripts build layers as `ColumnParallelLinear(orig_module=linear, process_group="tensor")`
or from sizes, initialized Megatron-style: a full "master" weight drawn with `init_method`
(default `xavier_normal_`) from the current random state, identical on every rank of the
group, then split (biases start at zero). The classes here take those arguments and are
subclasses of atorch's layers (`atorch.modules.distributed_modules`), so everything that
handles atorch's layers (checkpoints, DeepSpeed 3D, gathering) handles them too.
`ParallelEmbedding` splits the embedding dimension and all-gathers the output.

Randomizer: `init_randomizer(base_seed=1234)`, `get_MDPRInstance()` and
`get_randomizer(*same_groups).fork()` (a context manager that is also a decorator). A stream
is either the same on every rank of one named group and different elsewhere
(`get_randomizer("tensor")`), or different on every rank (`get_randomizer()`), both kept by
atorch's randomizer; a stream shared over several groups at once (`get_randomizer("tensor",
"data")`) is kept here, seeded the same way; `get_MDPRInstance().get_states()` covers both.

Differences from ATorch, on purpose: `defer_init=True` is refused (use `record_module_init`
and `tp_manual_shard_custom_fn`, which build only this rank's slices); a meta `orig_module`
is refused (materialize it first).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atorch.tensor_parallel import layers as _layers
from atorch.tensor_parallel import randomizer as _randomizer
from atorch.tensor_parallel.layers import ShardSpec, TensorParallelModule, shard_tensor
from atorch.tensor_parallel.mappings import gather_from_group

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "VocabParallelEmbedding",
           "get_MDPRInstance", "get_randomizer", "init_randomizer"]  # and _initialize_affine_weight

InitMethod = Optional[Callable[[torch.Tensor], Any]]
GroupSpec = Union[str, dist.ProcessGroup, None]


# -- groups and master weights -------------------------------------------------------------------

def resolve_group(process_group: GroupSpec, ranks: Optional[Sequence[int]] = None) -> Optional[dist.ProcessGroup]:
    """ATorch's `process_group` (a parallel group name, default "tensor", or a group) as a process group."""
    from atorch import distributed as adist

    if process_group is None:
        process_group = "tensor"
    if isinstance(process_group, str):
        if not dist.is_initialized():
            return None  # one plain process: a group of one
        group = adist.parallel_group(process_group)   # ValueError naming the groups that exist
        if ranks is not None and list(ranks) != adist.parallel_group_ranks(process_group):
            raise ValueError(f"ranks={list(ranks)} differ from this rank's {process_group!r} group "
                             f"{adist.parallel_group_ranks(process_group)}")
        return group
    return process_group


def _check_common(orig_module: Optional[nn.Module], defer_init: bool, what: str) -> None:
    if defer_init:
        raise ValueError(f"{what}(defer_init=True) is not supported: build the model under "
                         "atorch.utils.meta_model_utils.record_module_init() and shard it with "
                         "tp_manual_shard_custom_fn, which materializes only this rank's slices")
    if orig_module is not None and any(p.is_meta for p in orig_module.parameters()):
        raise ValueError(f"{what}(orig_module=...) has parameters on the meta device; materialize it first (e.g. "
                         "reload_meta_module or build_recorded_module)")


def master_weight(shape: Sequence[int], init_method: InitMethod, dtype: torch.dtype) -> torch.Tensor:
    """The full weight, drawn with `init_method` from the current random state (the same on every rank)."""
    w = torch.empty(*shape, dtype=dtype)
    if init_method is not None:
        init_method(w)
    return w


def _set_slices(layer: TensorParallelModule, full: nn.Module, requires_grad: bool) -> None:
    specs = layer.shard_specs()
    for name, value in full.named_parameters(recurse=False):
        data = value.detach()
        if name in specs:
            data = shard_tensor(data, specs[name], layer.tp_rank)
        setattr(layer, name, nn.Parameter(data.clone(), requires_grad=requires_grad and value.requires_grad))


def _full_linear(input_size: Optional[int], output_size: Optional[int], bias: bool, init_method: InitMethod,
                 dtype: torch.dtype, what: str) -> nn.Linear:
    if not isinstance(input_size, int) or not isinstance(output_size, int):
        raise ValueError(f"{what}: give orig_module or both input_size and output_size (got {input_size!r}, "
                         f"{output_size!r})")
    full = nn.Linear(input_size, output_size, bias=bias, device="meta", dtype=dtype)
    full.weight = nn.Parameter(master_weight((output_size, input_size), init_method, dtype))
    if bias:
        full.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype))
    return full


# -- layers -------------------------------------------------------------------------------------

class ColumnParallelLinear(_layers.ColumnParallelLinear):
    """ATorch's constructor: outputs split over the group (gather_output=False, as in ATorch)."""

    def __init__(self, input_size: Optional[int] = None, output_size: Optional[int] = None, bias: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 orig_module: Optional[nn.Module] = None, process_group: GroupSpec = "tensor",
                 ranks: Optional[Sequence[int]] = None, async_grad_allreduce: bool = False,
                 requires_grad: bool = True, params_dtype: torch.dtype = torch.float32, defer_init: bool = False,
                 gather_output: bool = False):
        _check_common(orig_module, defer_init, "ColumnParallelLinear")
        full = orig_module or _full_linear(input_size, output_size, bias, init_method, params_dtype,
                                           "ColumnParallelLinear")
        layout = _layers._module_layout(full)
        in_f, out_f = _layers._linear_sizes(full, layout)
        super().__init__(in_f, out_f, bias=full.bias is not None, group=resolve_group(process_group, ranks),
                         gather_output=gather_output, stride=stride, weight_layout=layout, device="meta",
                         dtype=cast(torch.Tensor, full.weight).dtype)
        _set_slices(self, full, requires_grad)


class RowParallelLinear(_layers.RowParallelLinear):
    """ATorch's constructor: inputs split over the group (input_is_parallel=True, as in ATorch)."""

    def __init__(self, input_size: Optional[int] = None, output_size: Optional[int] = None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 params_dtype: torch.dtype = torch.float32, orig_module: Optional[nn.Module] = None,
                 requires_grad: bool = True, process_group: GroupSpec = "tensor",
                 ranks: Optional[Sequence[int]] = None, defer_init: bool = False):
        _check_common(orig_module, defer_init, "RowParallelLinear")
        if stride != 1:
            raise ValueError(f"RowParallelLinear: stride={stride} is not supported (the input split has no blocks)")
        full = orig_module or _full_linear(input_size, output_size, bias, init_method, params_dtype,
                                           "RowParallelLinear")
        layout = _layers._module_layout(full)
        in_f, out_f = _layers._linear_sizes(full, layout)
        super().__init__(in_f, out_f, bias=full.bias is not None, group=resolve_group(process_group, ranks),
                         input_is_parallel=input_is_parallel, weight_layout=layout, device="meta",
                         dtype=cast(torch.Tensor, full.weight).dtype)
        _set_slices(self, full, requires_grad)


def _full_embedding(num_embeddings: Optional[int], embedding_dim: Optional[int], padding_idx: Optional[int],
                    init_method: InitMethod, dtype: torch.dtype, what: str) -> nn.Embedding:
    if not isinstance(num_embeddings, int) or not isinstance(embedding_dim, int):
        raise ValueError(f"{what}: give orig_module or both num_embeddings and embedding_dim (got "
                         f"{num_embeddings!r}, {embedding_dim!r})")
    full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device="meta", dtype=dtype)
    full.weight = nn.Parameter(master_weight((num_embeddings, embedding_dim), init_method, dtype))
    return full


def _check_embedding_options(max_norm: Any, scale_grad_by_freq: bool, sparse: bool, what: str) -> None:
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise ValueError(f"{what}: max_norm, scale_grad_by_freq and sparse are not supported by the parallel "
                         "embeddings; leave them at their defaults")


class VocabParallelEmbedding(_layers.VocabParallelEmbedding):
    """ATorch's constructor: the vocabulary (rows) split over the group, padded to a multiple of its size."""

    def __init__(self, num_embeddings: Optional[int] = None, embedding_dim: Optional[int] = None,
                 padding_idx: Optional[int] = None, max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, orig_module: Optional[nn.Embedding] = None,
                 process_group: GroupSpec = "tensor", ranks: Optional[Sequence[int]] = None,
                 params_dtype: torch.dtype = torch.float32, requires_grad: bool = True, defer_init: bool = False):
        _check_common(orig_module, defer_init, "VocabParallelEmbedding")
        _check_embedding_options(max_norm, scale_grad_by_freq, sparse, "VocabParallelEmbedding")
        full = orig_module or _full_embedding(num_embeddings, embedding_dim, padding_idx, init_method, params_dtype,
                                              "VocabParallelEmbedding")
        super().__init__(full.num_embeddings, full.embedding_dim, full.padding_idx,
                         group=resolve_group(process_group, ranks), device="meta", dtype=full.weight.dtype)
        _set_slices(self, full, requires_grad)


class ParallelEmbedding(TensorParallelModule):
    """An embedding split along the embedding dimension; each rank looks up its columns, outputs are all-gathered.

    Forward returns the full embedding on every rank; backward keeps this rank's columns of
    the gradient (`gather_from_group`).
    """

    def __init__(self, num_embeddings: Optional[int] = None, embedding_dim: Optional[int] = None,
                 padding_idx: Optional[int] = None, max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, orig_module: Optional[nn.Embedding] = None,
                 process_group: GroupSpec = "tensor", ranks: Optional[Sequence[int]] = None,
                 params_dtype: torch.dtype = torch.float32, requires_grad: bool = True, defer_init: bool = False):
        _check_common(orig_module, defer_init, "ParallelEmbedding")
        _check_embedding_options(max_norm, scale_grad_by_freq, sparse, "ParallelEmbedding")
        full = orig_module or _full_embedding(num_embeddings, embedding_dim, padding_idx, init_method, params_dtype,
                                              "ParallelEmbedding")
        super().__init__(resolve_group(process_group, ranks))
        self.num_embeddings, self.embedding_dim, self.padding_idx = \
            full.num_embeddings, full.embedding_dim, full.padding_idx
        self.spec = ShardSpec(1, full.embedding_dim, self.tp_size)
        self.spec.check()
        self.weight = nn.Parameter(shard_tensor(full.weight.detach(), self.spec, self.tp_rank).clone(),
                                   requires_grad=requires_grad)

    def shard_specs(self) -> dict:
        return {"weight": self.spec}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_from_group(F.embedding(ids, self.weight, self.padding_idx), self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local {self.spec.local_size}), "
                f"tp={self.tp_rank}/{self.tp_size}")


# -- randomizer ---------------------------------------------------------------------------------

def init_randomizer(base_seed: int = 1234, coords: Optional[Mapping[str, int]] = None
                    ) -> _randomizer.MultiDimParallelRandomizer:
    """ATorch's `init_randomizer`: the process randomizer, seeded from `base_seed` and this rank's coordinates.

    `coords` (atorch's argument) overrides the coordinates read from the parallel groups.
    """
    return _randomizer.init_randomizer(base_seed, coords)


class _RandomizerWithSharedStreams:
    """The process randomizer, whose `get_states`/`set_states` also cover the several-group streams here."""

    _PREFIX = "shared:"

    def __init__(self, randomizer: _randomizer.MultiDimParallelRandomizer):
        self.randomizer = randomizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.randomizer, name)

    def get_states(self) -> dict:
        states = dict(self.randomizer.get_states())
        for (owner, groups), stream in _SHARED.items():
            if owner == id(self.randomizer):
                states[self._PREFIX + ",".join(groups)] = {
                    "cpu": stream.cpu_state.clone(),
                    "cuda": stream.cuda_state.clone() if stream.cuda_state is not None else None}
        return states

    def set_states(self, states: dict) -> None:
        own = {k: v for k, v in states.items() if not k.startswith(self._PREFIX)}
        self.randomizer.set_states(own)
        for name, state in states.items():
            if name.startswith(self._PREFIX):
                groups = tuple(name[len(self._PREFIX):].split(","))
                # Only streams shared over several groups are saved under the prefix.
                stream = cast(_SharedStream, get_randomizer(*groups))
                stream.cpu_state = state["cpu"].clone()
                stream.cuda_state = state["cuda"].clone() if state.get("cuda") is not None else None


def get_MDPRInstance() -> _RandomizerWithSharedStreams:  # noqa: N802 - ATorch's name
    """The process randomizer made by `init_randomizer` (`.randomizer`), with ATorch's state methods."""
    return _RandomizerWithSharedStreams(_randomizer.get_randomizer())


class _Stream:
    """One random stream of the process randomizer, with ATorch's `fork()`."""

    def __init__(self, randomizer: _randomizer.MultiDimParallelRandomizer, group: str, replicated: bool):
        self._randomizer, self._group, self._replicated = randomizer, group, replicated

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this stream inside the block (or the decorated function)."""
        with self._randomizer.fork(self._group, self._replicated):
            yield


class _SharedStream:
    """A stream equal on the ranks that differ only along `groups` (ATorch's several-group `get_randomizer`)."""

    def __init__(self, base_seed: int, groups: Sequence[str], coords: dict):
        import hashlib
        import json

        varying = {d: c for d, c in sorted(coords.items()) if d not in groups and c != 0}
        key = json.dumps([base_seed, sorted(groups), "shared", varying])
        self.seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)
        self.cpu_state = torch.Generator().manual_seed(self.seed).get_state()
        self.cuda_state: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu_state)
        saved_cuda = None
        if use_cuda:
            saved_cuda = torch.cuda.get_rng_state()
            if self.cuda_state is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self.cuda_state)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                self.cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


_SHARED: dict = {}   # (id of the process randomizer, sorted groups) -> _SharedStream


def get_randomizer(*same_groups: str) -> Union[_randomizer.MultiDimParallelRandomizer, _Stream, _SharedStream]:
    """The stream that is the same on the ranks of `same_groups`, with ATorch's `fork()`.

    Without groups: the process randomizer itself, whose `fork()` (defaults) is the stream
    that differs on every rank, as ATorch's `get_randomizer().fork()`.
    """
    from atorch import distributed as adist

    randomizer = _randomizer.get_randomizer()
    for name in same_groups:
        adist.parallel_group_size(name)  # ValueError naming the groups that exist
    if len(set(same_groups)) > 1:
        key = (id(randomizer), tuple(sorted(set(same_groups))))
        if key not in _SHARED:
            _SHARED[key] = _SharedStream(randomizer.base_seed, key[1], randomizer.coords)
        return _SHARED[key]
    if same_groups:
        return _Stream(randomizer, same_groups[0], True)
    return randomizer


# -- master weights split by hand (ATorch's layers module) --------------------------------------

def _initialize_affine_weight(weight: torch.Tensor, per_partition_size: int, partition_dim: int,
                              init_method: InitMethod = None, master_weight: Optional[torch.Tensor] = None,
                              out_features: Optional[int] = None, in_features: Optional[int] = None,
                              group_name: str = "tensor", stride: int = 1, return_master_weight: bool = False,
                              requires_grad: bool = True) -> Optional[torch.Tensor]:
    """Fill `weight` with this rank's slice of a master weight split over the `group_name` group (ATorch's helper).

    The master weight (given, or `[out_features, in_features]` drawn with `init_method`, the
    same on every rank when the random state is) is cut along `partition_dim` into pieces of
    `per_partition_size // stride` rows; rank r of a group of size n takes pieces r, r + n,
    r + 2n, ... (the strided layout of fused projections) concatenated. Without the group (no
    parallel groups, or size 1) `weight` gets the whole master weight. Returns the master
    weight when `return_master_weight`, else None.
    """
    from atorch.common.util_func import divide
    from atorch.distributed.distributed import parallel_group_size, parallel_rank

    size = parallel_group_size(group_name) or 1
    if size == 1:   # nothing to split: the weight is the master weight
        with torch.no_grad():
            if master_weight is not None:
                weight.data.copy_(master_weight)
            elif init_method is not None:
                init_method(weight)
        return weight if return_master_weight else None
    if master_weight is None:
        if out_features is None or in_features is None:
            raise ValueError("_initialize_affine_weight: give master_weight, or out_features and in_features to "
                             "draw one with init_method")
        master_weight = torch.empty(out_features, in_features, dtype=weight.dtype, requires_grad=requires_grad)
        if init_method is not None:
            init_method(master_weight)
    pieces = torch.split(master_weight, divide(per_partition_size, stride), dim=partition_dim)
    if len(pieces) != size * stride:
        raise ValueError(f"_initialize_affine_weight: the master weight {tuple(master_weight.shape)} cut along dim "
                         f"{partition_dim} into pieces of {per_partition_size // stride} gives {len(pieces)} "
                         f"pieces, not {group_name!r} size {size} x stride {stride}")
    rank = cast(int, parallel_rank(group_name))
    with torch.no_grad():
        weight.data.copy_(torch.cat(pieces[rank::size], dim=partition_dim))
    return master_weight if return_master_weight else None
