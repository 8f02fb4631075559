"""Random-number streams per parallel dimension, so dropout agrees where the data is replicated.

In tensor parallelism a replicated activation (the residual stream) must see the *same*
dropout mask on every rank of the tensor group, or the ranks drift apart; an activation
split over the group (attention probabilities of this rank's heads) must see *different*
masks, or every shard repeats the same pattern. `MultiDimParallelRandomizer` keeps one RNG
state per (group, replicated) stream, seeded from a base seed and this rank's coordinates:

- `fork("tensor", replicated=True)`: identical on all ranks of a tensor group, distinct
  across the other dimensions (data, pipeline), like independent samples of a batch;
- `fork("tensor")`: distinct on every rank.

Dropout layers draw from the default generator, so `fork` swaps the stream's state into the
default CPU generator (and the current CUDA device's, when CUDA is in use) and back out.
Unlike the CUDA-only trackers it replaces, it runs on CPU. Streams depend only on the
coordinates that are not zero, so a rank at coordinate 0 of a dimension of size one draws
the same numbers as a process without that dimension: a single process can replay any
rank's stream (the tensor-parallel parity tests do).

Dropout is often functional (`F.dropout` inside an attention forward, Falcon's `dropout_add`),
so hooks on dropout modules alone do not cover a model: `fork_model_rng` runs the whole root
forward inside the replicated stream, and the modules that see split activations fork their
per-rank stream inside it. Every draw that no split region claims is then identical across
the tensor group, whatever each rank did to its own default generator (seeding with
seed + rank, say), which is restored after the forward.

Activation checkpointing that recomputes a forked module must save and restore the streams
around the recomputation (`get_states` / `set_states`), and continue the streams that were
active when the block first ran (`active_streams` / `continuing`): torch's checkpoint
restores the default generators to the forward's state, which is that of the innermost
active stream.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, cast

import torch
from torch import nn

from atorch.utils.stable import stable_int63


def _cuda_in_use() -> bool:
    # Touching CUDA RNG state would initialize CUDA; only follow it once something else has.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class _Stream:
    seed: int
    cpu_state: torch.Tensor
    cuda_state: Optional[torch.Tensor] = None

    def cuda(self) -> torch.Tensor:
        if self.cuda_state is None:
            g = torch.Generator(device=f"cuda:{torch.cuda.current_device()}")
            g.manual_seed(self.seed)
            self.cuda_state = g.get_state()
        return self.cuda_state


@dataclass
class _Token:
    key: Tuple[str, bool]
    saved_cpu: torch.Tensor
    saved_cuda: Optional[torch.Tensor]


class MultiDimParallelRandomizer:
    """RNG streams keyed by (parallel group, replicated), seeded from `base_seed` and this rank's coordinates.

    `coords` maps each parallel dimension to this rank's coordinate along it; by default it
    is read from the groups of `atorch.distributed.create_parallel_group` (empty without them).
    """

    def __init__(self, base_seed: int, coords: Optional[Mapping[str, int]] = None):
        if not isinstance(base_seed, int) or isinstance(base_seed, bool):
            raise ValueError(f"base_seed={base_seed!r} must be an int")
        if coords is None:
            coords = _layout_coords()
        self.base_seed = base_seed
        self.coords: Dict[str, int] = {str(k): int(v) for k, v in coords.items()}
        self._streams: Dict[Tuple[str, bool], _Stream] = {}
        self._active: List[Tuple[str, bool]] = []

    # -- seeds -------------------------------------------------------------------
    def seed(self, group: str = "tensor", replicated: bool = False) -> int:
        """The seed of a stream: a hash of the base seed, the stream and the coordinates it varies along."""
        varying = {d: c for d, c in sorted(self.coords.items()) if c != 0 and not (replicated and d == group)}
        key = json.dumps([self.base_seed, group, "replicated" if replicated else "parallel", varying])
        return stable_int63(key)

    def _stream(self, key: Tuple[str, bool]) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            seed = self.seed(*key)
            stream = _Stream(seed, torch.Generator().manual_seed(seed).get_state())
            self._streams[key] = stream
        return stream

    # -- forking -----------------------------------------------------------------
    def enter(self, group: str = "tensor", replicated: bool = False) -> Optional[_Token]:
        """Make the stream the default generators' state; returns the token for `exit` (None if already in it).

        Entering a stream that is active further out (a replicated dropout inside the per-rank
        attention, all inside the model's replicated stream) continues it from where it was
        suspended: the stream in use is stored whenever another one is entered.
        """
        key = (group, bool(replicated))
        if self._active and self._active[-1] == key:
            # Re-entering the active stream must continue it, not restart it from its stored state.
            return None
        stream = self._stream(key)
        if self._active:
            self._suspend(self._active[-1])
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(stream.cpu_state)
        saved_cuda = None
        if _cuda_in_use():
            saved_cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(stream.cuda())
        self._active.append(key)
        return _Token(key, saved_cpu, saved_cuda)

    def _suspend(self, key: Tuple[str, bool]) -> None:
        """Store the live state of `key`, the stream in use, before another one takes the default generators."""
        stream = self._stream(key)
        stream.cpu_state = torch.get_rng_state()
        if _cuda_in_use():
            stream.cuda_state = torch.cuda.get_rng_state()

    def exit(self, token: Optional[_Token]) -> None:
        """Store the stream's advanced state and give the default generators back to the stream in use
        further out (its stored state), or, outermost, to the state they had before."""
        if token is None:
            return
        if not self._active or self._active[-1] != token.key:
            raise RuntimeError(f"random stream {token.key} exited out of order; active streams: {self._active}")
        self._active.pop()
        stream = self._streams[token.key]
        stream.cpu_state = torch.get_rng_state()
        if token.saved_cuda is not None:
            stream.cuda_state = torch.cuda.get_rng_state()
        if self._active:
            outer = self._stream(self._active[-1])
            torch.set_rng_state(outer.cpu_state)
            if token.saved_cuda is not None:
                torch.cuda.set_rng_state(outer.cuda())
            return
        torch.set_rng_state(token.saved_cpu)
        if token.saved_cuda is not None:
            torch.cuda.set_rng_state(token.saved_cuda)

    @contextlib.contextmanager
    def fork(self, group: str = "tensor", replicated: bool = False) -> Iterator[None]:
        """Run the block with the default generators drawing from stream (group, replicated)."""
        token = self.enter(group, replicated)
        try:
            yield
        finally:
            self.exit(token)

    # -- state (checkpoints, activation recomputation) ----------------------------
    def active_streams(self) -> Tuple[Tuple[str, bool], ...]:
        """The streams entered and not yet exited, outermost first (what a recomputation must continue)."""
        return tuple(self._active)

    @contextlib.contextmanager
    def continuing(self, keys: Iterable[Tuple[str, bool]]) -> Iterator[None]:
        """Treat `keys` as active for the block without touching the default generators.

        For a recomputation under activation checkpointing: torch has put the default generators
        back to their state when the block first ran, which was the live state of the innermost
        stream then active (the root model's replicated one). Entering that stream again would
        restart it from its stored state, which is only written when the root forward ends; marked
        active, a module forking it continues the default generators as it did in the forward.
        """
        added = [(str(g), bool(r)) for g, r in keys if (g, r) not in self._active]
        self._active.extend(added)
        try:
            yield
        finally:
            for key in reversed(added):
                if not self._active or self._active[-1] != key:
                    raise RuntimeError(f"random stream {key} continued out of order; active streams: {self._active}")
                self._active.pop()

    def get_states(self) -> Dict[str, Dict[str, Optional[torch.Tensor]]]:
        return {f"{g}|{int(r)}": {"cpu": s.cpu_state.clone(),
                                  "cuda": s.cuda_state.clone() if s.cuda_state is not None else None}
                for (g, r), s in self._streams.items()}

    def set_states(self, states: Mapping[str, Mapping[str, Optional[torch.Tensor]]]) -> None:
        """Put every stream back to `states` (from `get_states`).

        A stream missing from `states` did not exist then, so it restarts from its seed: a
        snapshot taken before a stream's first use replays that first use exactly (activation
        recomputation of the first step).
        """
        keys = set()
        for name, state in states.items():
            group, _, replicated = name.rpartition("|")
            key = (group, bool(int(replicated)))
            keys.add(key)
            stream = self._stream(key)
            stream.cpu_state = cast(torch.Tensor, state["cpu"]).clone()  # only the CUDA state may be None
            cuda = state.get("cuda")
            stream.cuda_state = cuda.clone() if cuda is not None else None
        for key in [k for k in self._streams if k not in keys and k not in self._active]:
            del self._streams[key]


def _layout_coords() -> Dict[str, int]:
    from atorch.distributed import is_parallel_group_created, parallel_layout, rank

    if not is_parallel_group_created():
        return {}
    return parallel_layout().coords(rank())


_DEFAULT: Optional[MultiDimParallelRandomizer] = None


def init_randomizer(base_seed: int, coords: Optional[Mapping[str, int]] = None) -> MultiDimParallelRandomizer:
    """Create the process's default randomizer (after `create_parallel_group`, which gives the coordinates)."""
    global _DEFAULT
    _DEFAULT = MultiDimParallelRandomizer(base_seed, coords)
    return _DEFAULT


def get_randomizer() -> MultiDimParallelRandomizer:
    if _DEFAULT is None:
        raise RuntimeError("no randomizer: call atorch.tensor_parallel.randomizer.init_randomizer("
                           "base_seed) first (the tensor_parallel optimization does it)")
    return _DEFAULT


# Marks a module whose forward runs inside a parallel stream (set by fork_module_rng).
_FORK_ATTR = "_atorch_rng_fork"


def randomizer_for(module: nn.Module) -> Optional[MultiDimParallelRandomizer]:
    """The randomizer that the forked modules inside `module` draw from; None when none draws.

    Activation checkpointing replays these streams when it recomputes `module`, and needs no
    replay (so torch.compile can trace it) when nothing inside draws from one. A dropout with
    p == 0 draws nothing.
    """
    for m in module.modules():
        if _FORK_ATTR not in m.__dict__ or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0):
            continue
        explicit = m.__dict__[_FORK_ATTR]
        if explicit is not None:
            return explicit
        return _DEFAULT
    return None


def fork_module_rng(module: nn.Module, randomizer: Optional[MultiDimParallelRandomizer] = None,
                    group: str = "tensor", replicated: bool = False) -> List[torch.utils.hooks.RemovableHandle]:
    """Run `module`'s forward (in training) inside `randomizer.fork(group, replicated)`; returns the hook handles.

    Hooks rather than a wrapper module keep the module's name and its parameters' state-dict
    keys unchanged. `randomizer=None` uses the process default (`get_randomizer()`) at each
    call. A dropout with p == 0 draws nothing and is left alone.
    """
    tokens: List[Optional[Tuple[MultiDimParallelRandomizer, Optional[_Token]]]] = []
    module.__dict__[_FORK_ATTR] = randomizer   # read by randomizer_for (None: the process default)

    def enter(mod: nn.Module, args: tuple) -> None:
        if not mod.training or (isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p == 0):
            tokens.append(None)
            return
        source = randomizer if randomizer is not None else get_randomizer()
        tokens.append((source, source.enter(group, replicated)))

    def leave(mod: nn.Module, args: tuple, output: object) -> None:
        entry = tokens.pop() if tokens else None
        if entry is not None:
            entry[0].exit(entry[1])

    return [module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True)]


# Marks a model whose whole forward runs inside the replicated stream (set by fork_model_rng).
_MODEL_FORK_ATTR = "_atorch_rng_model_fork"


def fork_model_rng(model: nn.Module, randomizer: Optional[MultiDimParallelRandomizer] = None,
                   group: str = "tensor") -> None:
    """Run `model`'s whole forward (in training) inside the stream `group` shares; idempotent.

    Draws outside the modules forked otherwise (functional dropout in an attention module the
    plan leaves whole, a residual `dropout_add`) then give the same mask on every rank of the
    group instead of each rank's own default generator's; the split modules' per-rank streams
    nest inside. The default generators get the user's state back after the forward.
    """
    if model.__dict__.get(_MODEL_FORK_ATTR):
        return
    fork_module_rng(model, randomizer, group, replicated=True)
    model.__dict__[_MODEL_FORK_ATTR] = True
