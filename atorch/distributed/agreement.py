"""Agree on an error across ranks, so that one rank's failure never leaves the others waiting.

A collective operation (a checkpoint save, a load, reading a strategy file, the search) runs
local steps between its collectives. When a local step fails on one rank only (a file
exists, a permission differs, a shard is unreadable), that rank used to raise while the
others went on into the next barrier and waited for it forever. `agree_on_error` wraps such
a local step and replaces the barrier after it:

    with agree_on_error("save_checkpoint: creating the staging directory"):
        os.makedirs(...)                 # no collective inside the block

On exit every rank says whether its block failed (one small all-reduce: the barrier it
replaces). If any did, every rank raises an exception of the same type with the same
message, naming the operation, the ranks that failed and the first failure; the failing
ranks chain their own exception as the cause. A rank that fails inside the block raises
after the agreement, not before, so nobody waits.

The vote runs on the default group when it is gloo, else on a gloo group created once, on
first use, by every rank at the same point, so it never needs a CUDA tensor. Without a
process group (or with one rank) it is a plain pass-through.
"""

from __future__ import annotations

import builtins
import contextlib
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, cast

import torch
import torch.distributed as dist

from atorch.distributed.process_group import on_destroy

# Exception types a peer's failure may be re-raised as: the builtins and atorch's own.
_SAFE_MODULES = ("builtins", "atorch.")

_AGREED = "_atorch_agreed"   # set on an exception every rank raised through `agree`
_vote_group: Optional[Tuple[object, dist.ProcessGroup]] = None


class RemoteRankError(RuntimeError):
    """Another rank failed in a collective operation with an exception that cannot be re-raised as is."""


def _group() -> dist.ProcessGroup:
    """A gloo group of all ranks for votes, recreated after the default group is."""
    global _vote_group
    world = dist.group.WORLD
    if _vote_group is None or _vote_group[0] is not world:
        # Votes run inside an initialized process group, so neither is None. Gloo and the fake
        # backend (one simulated rank: collectives return their input, so every vote is "no error")
        # carry the vote themselves; a gloo group cannot be created next to a fake one.
        own = dist.get_backend() in ("gloo", "fake")
        group = cast(dist.ProcessGroup, world if own else dist.new_group(backend="gloo"))
        _vote_group = (world, group)
    return _vote_group[1]


def forget_group() -> None:
    """Drop the reference to the vote group (called when the process groups are destroyed)."""
    global _vote_group
    _vote_group = None


on_destroy(forget_group)


def _describe(exc: BaseException) -> Tuple[str, str, str]:
    cls = type(exc)
    return cls.__module__, cls.__qualname__, str(exc)


def _exception_type(module: str, qualname: str) -> type:
    if module == "builtins":
        cls = getattr(builtins, qualname, None)
    elif module.startswith(_SAFE_MODULES[1]):
        import importlib

        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            cls = None
    else:
        cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return RemoteRankError


def _agreed_exception(what: str, failures: List[Tuple[int, Tuple[str, str, str]]]) -> Exception:
    ranks = [r for r, _ in failures]
    first_rank, (module, qualname, message) = failures[0]
    cls = _exception_type(module, qualname)
    origin = "" if cls is not RemoteRankError else f"{module}.{qualname}: "
    text = f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {ranks}: {origin}{message}"
    try:
        return cls(text)
    except Exception:  # noqa: BLE001 - a type whose constructor takes other arguments
        return RemoteRankError(f"{what} failed on ranks {ranks}: {module}.{qualname}: {message}")


def agree(what: str, error: Optional[BaseException], group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank calls this at the same point; raises the same exception everywhere if any rank had one.

    `group`: a gloo group of all ranks to vote on instead of the default one (a background
    thread, such as an async checkpoint save, must not use the group the training step uses).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    if error is not None and getattr(error, _AGREED, False):
        # Raised by an inner agreement, so on every rank at the same point: no second vote.
        raise error
    group = group if group is not None else _group()
    flag = torch.tensor([1 if error is not None else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    mine = (dist.get_rank(), _describe(error)) if error is not None else None
    gathered: List[Optional[Tuple[int, Tuple[str, str, str]]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failures = sorted(f for f in gathered if f is not None)
    agreed = _agreed_exception(what, failures)
    setattr(agreed, _AGREED, True)
    if error is not None:
        raise agreed from error
    raise agreed


@contextlib.contextmanager
def agree_on_error(what: str, group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """Run a local (collective-free) block; on exit all ranks agree on success or raise the same exception.

    Exits from KeyboardInterrupt/SystemExit are not voted on: they end the process. `group`: as in `agree`.
    """
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure is voted on and re-raised below
        error = e
    agree(what, error, group)


DIFFERENT_COLLECTIVES = "so they would run different collectives"


def agree_on_values(what: str, values: Mapping[str, str], group: Optional[dist.ProcessGroup] = None,
                    why: str = DIFFERENT_COLLECTIVES) -> None:
    """Every rank calls this with its own `values` (a name -> a short text of what this rank was
    given); when any name's text differs between ranks, every rank raises the same ValueError naming
    it and what each rank had.

    For inputs that must be the same everywhere and that a rank cannot check alone: given different
    strategies or batch sizes, ranks run different collectives and wait for each other until the
    collective timeout, or fail inside the backend with a message about sizes ("Received data size
    doesn't match expected size") that names neither input. One `all_gather_object` of the texts.
    `why`: what the difference would do, said in the error.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    group = group if group is not None else _group()
    gathered: List[Optional[Dict[str, str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {str(k): str(v) for k, v in values.items()}, group=group)
    tables = [g or {} for g in gathered]
    names = list(dict.fromkeys(k for table in tables for k in table))
    differences, differing = [], []
    for name in names:
        by_text: Dict[str, List[int]] = {}
        for rank, table in enumerate(tables):
            by_text.setdefault(table.get(name, "(not given)"), []).append(rank)
        if len(by_text) > 1:
            differing.append(name)
            differences.append(f"{name}: " + "; ".join(f"{text} on rank{'s' if len(ranks) > 1 else ''} {ranks}"
                                                      for text, ranks in by_text.items()))
    if differences:
        error = ValueError(f"{what}: the ranks were given different {', '.join(differing)}, {why}; give every "
                           "rank the same. " + " | ".join(differences))
        setattr(error, _AGREED, True)
        raise error
