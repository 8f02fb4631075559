"""The small, non-tensor training state: JSON encoding, RNG states, and the data position.

Everything here is stored as JSON (never pickle): lr scheduler and grad scaler states,
optimizer hyperparameters, per-rank RNG states, the step and where the data stream stands.
`DataPosition` plus `resume_dataloader` make a resumed run see exactly the batches the
uninterrupted run would have seen, at any data-parallel size.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import itertools
import logging
import random
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterator, Optional, Tuple, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from atorch.checkpoint.manifest import CheckpointError

logger = logging.getLogger(__name__)

# -- JSON with the few Python types training state uses ----------------------------------

_TUPLE, _TENSOR, _ITEMS = "__tuple__", "__tensor__", "__items__"


def to_json_value(value: Any, where: str) -> Any:
    """Encode a state value (nested dicts/lists/tuples, numbers, strings, small tensors) as JSON data.

    Raises ValueError naming `where` and the offending type for anything else (a function,
    a live object), since loading it back would need pickle.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, tuple):
        return {_TUPLE: [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not ({_TUPLE, _TENSOR, _ITEMS} & set(value)):
            return {k: to_json_value(v, f"{where}.{k}") for k, v in value.items()}
        return {_ITEMS: [[to_json_value(k, f"{where} key"), to_json_value(v, f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {_TENSOR: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                          "data": t.reshape(-1).tolist()}}
    raise ValueError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved as JSON; "
                     "checkpoints never pickle objects. Keep only numbers, strings, lists, dicts and tensors there.")


def from_json_value(value: Any) -> Any:
    """Inverse of `to_json_value`."""
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(from_json_value(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {from_json_value(k): from_json_value(v) for k, v in value[_ITEMS]}
        if set(value) == {_TENSOR}:
            spec = value[_TENSOR]
            dtype = getattr(torch, spec["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown tensor dtype {spec['dtype']!r} in a JSON state file")
            return torch.tensor(spec["data"], dtype=dtype).reshape(spec["shape"])
        return {k: from_json_value(v) for k, v in value.items()}
    return value


# -- RNG ---------------------------------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> Dict[str, Any]:
    """This process's Python, NumPy, torch CPU and CUDA generator states, as JSON data."""
    version, mt, gauss = random.getstate()
    # legacy=True (the default) returns the tuple form; the stubs also allow the dict form.
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = cast(Tuple[str, np.ndarray, int, int, float],
                                                            np.random.get_state())
    state: Dict[str, Any] = {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {"name": np_name, "keys": np_keys.tolist(), "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch": _b64(torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], np.asarray(npst["keys"], dtype=np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            # Another machine shape: the CUDA streams cannot be matched device for device.
            logger.warning("the checkpoint has CUDA RNG states for %d devices, this process sees %d; CUDA "
                           "generators are not restored", len(cuda), torch.cuda.device_count())
            return
        torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])


def parallel_streams_state(randomizer: Any) -> Dict[str, Dict[str, Optional[str]]]:
    """A tensor-parallel randomizer's dropout streams (`MultiDimParallelRandomizer.get_states`), as JSON data.

    They are per rank like the default generators, and a resume without them restarts every
    stream from its seed: the dropout masks after the resume would differ from the uninterrupted run's.
    """
    return {name: {"cpu": _b64(cast(torch.Tensor, st["cpu"])),
                   "cuda": _b64(st["cuda"]) if st.get("cuda") is not None else None}
            for name, st in randomizer.get_states().items()}


def set_parallel_streams_state(randomizer: Any, raw: Dict[str, Dict[str, Optional[str]]]) -> None:
    """Inverse of `parallel_streams_state`: put the randomizer's streams back."""
    states: Dict[str, Dict[str, Optional[torch.Tensor]]] = {}
    for name, st in raw.items():
        cpu, cuda = st["cpu"], st.get("cuda")
        states[name] = {"cpu": _unb64(cast(str, cpu)), "cuda": _unb64(cuda) if cuda else None}
    randomizer.set_states(states)


# -- data position -----------------------------------------------------------------------

@dataclass(frozen=True)
class DataPosition:
    """Where the data stream stands: `batches_in_epoch` batches of epoch `epoch` were consumed.

    Counted in global batches, so the position means the same samples at any data-parallel
    size: with `DistributedSampler`, global batch k is always positions [k*B, (k+1)*B) of the
    epoch's (possibly shuffled) order, however it is spread over ranks. `global_batch_size` is
    B, the samples in one global batch (one dataloader item over all data ranks); with it a run
    with another B resumes at the same sample (`convert_position`).
    """

    epoch: int = 0
    batches_in_epoch: int = 0
    global_batch_size: Optional[int] = None
    sampler_epoch: Optional[int] = None
    """The epoch the sampler was last set to (`set_epoch`) when the position was taken, which decides its
    order; None: unknown (no `set_epoch`, an older checkpoint), then `epoch` is taken. It differs from
    `epoch` in a loop that never calls `set_epoch` (every pass in epoch 0's order) or numbers epochs
    its own way."""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Dict[str, Any]) -> "DataPosition":
        sampler_epoch = raw.get("sampler_epoch")
        return cls(int(raw.get("epoch", 0)), int(raw.get("batches_in_epoch", 0)), raw.get("global_batch_size"),
                   int(sampler_epoch) if sampler_epoch is not None else None)

    @property
    def order_epoch(self) -> int:
        """The epoch to set the resumed sampler to: `sampler_epoch` where it was recorded, else `epoch`."""
        return self.sampler_epoch if self.sampler_epoch is not None else self.epoch

    @classmethod
    def after_steps(cls, steps: int, batches_per_epoch: Optional[int], epoch: int = 0,
                    global_batch_size: Optional[int] = None) -> "DataPosition":
        """The position after `steps` batches from the start of `epoch` (one batch per step)."""
        if not batches_per_epoch:
            return cls(epoch, steps, global_batch_size)
        return cls(epoch + steps // batches_per_epoch, steps % batches_per_epoch, global_batch_size)


def convert_position(position: DataPosition, global_batch_size: int) -> DataPosition:
    """`position` counted in global batches of `global_batch_size` (the resuming run's) instead of the saved run's.

    The samples consumed in the epoch are `batches_in_epoch` times the saved global batch; they
    must be a whole number of the new global batches, or the resumed run would repeat or skip
    samples, so anything else raises ValueError (the same on every rank: it depends only on the
    checkpoint and the batch size). A position without a recorded batch size is taken as is.
    """
    saved = position.global_batch_size
    if saved is None or saved == global_batch_size:
        return replace(position, global_batch_size=global_batch_size)
    consumed = position.batches_in_epoch * saved
    if consumed % global_batch_size:
        raise ValueError(
            f"the checkpoint stopped {position.batches_in_epoch} global batches of {saved} samples "
            f"({consumed} samples) into epoch {position.epoch}, which is not a whole number of this run's global "
            f"batches of {global_batch_size}, so resuming would repeat or skip samples. Resume with global batch size "
            f"{saved} (or another divisor of {consumed}) and change it at an epoch boundary (a "
            "checkpoint taken there resumes at any batch size)")
    return replace(position, batches_in_epoch=consumed // global_batch_size, global_batch_size=global_batch_size)


def position_in_epoch(position: DataPosition, batches_per_epoch: Optional[int],
                      samples_per_epoch: Optional[int] = None, *, warn: bool = True) -> DataPosition:
    """`position`, moved to the start of the next epoch when it lies at or past the end of this run's epoch.

    `position` is counted in this run's global batches (`convert_position`); `batches_per_epoch` is this
    run's (None: unknown, then the position is kept). A saved position always lies inside the saving
    run's epoch, so one past the end of this run's means the dataset shrank since the save (other data,
    a filter, a smaller split). Resuming in the middle of the saved epoch would then be an empty epoch:
    the loop would silently do nothing until the next `set_epoch`. What the saved run had consumed
    already covers more than this run's whole epoch, so its epoch counts as finished: the resume starts
    the next epoch (the sampler moved on with it when the saving loop was setting it to the epoch), and
    a warning names both lengths. `samples_per_epoch` (this run's dataset length, when known) is named too.
    `warn=False` leaves the warning to the caller (`load_checkpoint`'s names the saved dataset length too).
    """
    done = position.batches_in_epoch
    if not batches_per_epoch or done == 0 or done < batches_per_epoch:
        return position
    if warn:
        logger.warning("%s: the dataset is smaller than when the checkpoint was saved. Resuming at the start of "
                       "epoch %d instead of an empty rest of epoch %d",
                       _past_the_end(position, batches_per_epoch, samples_per_epoch), position.epoch + 1,
                       position.epoch)
    sampler_epoch = position.sampler_epoch
    if sampler_epoch is not None and sampler_epoch == position.epoch:
        sampler_epoch += 1      # the saving loop set the sampler to each epoch; one that never did keeps its own
    return replace(position, epoch=position.epoch + 1, batches_in_epoch=0, sampler_epoch=sampler_epoch)


def _consumed(position: DataPosition) -> str:
    """"N global batches (M samples)": what `position` says the epoch has consumed."""
    done, batch = position.batches_in_epoch, position.global_batch_size
    return f"{done} global batches" + (f" ({done * batch} samples)" if batch else "")


def _past_the_end(position: DataPosition, batches_per_epoch: int, samples_per_epoch: Optional[int]) -> str:
    this_run = f"{batches_per_epoch} batches" + (f" ({samples_per_epoch} samples)" if samples_per_epoch else "")
    return f"the checkpoint stopped {_consumed(position)} into epoch {position.epoch}, but this run's epoch has " \
           f"only {this_run}"


def dataset_change_message(saved_samples: int, samples: int, position: DataPosition, resumed: DataPosition,
                           batches_per_epoch: Optional[int]) -> str:
    """The warning for a resume on a dataset of `samples` samples when the checkpoint's run had `saved_samples`.

    `position` is the saved position in this run's global batches, `resumed` where the resume starts
    (`position_in_epoch`). The saved position still applies to the new dataset: the message says where
    that puts the resume, and how to start the data from its first sample instead.
    """
    lengths = f"this run's dataset has {samples} samples, the checkpoint's run had {saved_samples}"
    if resumed != position:
        where = (f"{_past_the_end(position, cast(int, batches_per_epoch), samples)}, so the resume starts epoch "
                 f"{resumed.epoch} from its first sample")
    elif position.batches_in_epoch:
        where = (f"the resume starts {_consumed(position)} into epoch {position.epoch}, as saved, so this epoch "
                 "skips that many samples of this dataset")
    else:
        where = f"the resume starts epoch {position.epoch} from its first sample, as saved"
    return (f"{lengths} (other data, a filter, another split?); {where}. The data position is restored with "
            "load_optimizer=False too: to train on other data from its first sample, iterate a dataloader taken "
            "before the load (`state.dataloader`, and `result.dataloader` after the load, resume at the saved "
            "position)")


def loader_global_batch_size(dataloader: DataLoader) -> Optional[int]:
    """Samples in one global batch of `dataloader`: its batch size times its sampler's `num_replicas` (1 without)."""
    if dataloader.batch_size is None:
        return None
    replicas = getattr(dataloader.sampler, "num_replicas", 1)
    return dataloader.batch_size * (replicas if isinstance(replicas, int) and replicas > 0 else 1)


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Run a block without moving the Python, NumPy or torch CPU generators (they are put back afterwards)."""
    py, npst, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)
        torch.set_rng_state(cpu)


class ResumeSampler(Sampler):
    """Yields `sampler`'s indices, skipping the first `skip` in epoch `epoch` only, until one pass
    has run to its end.

    The current epoch is the wrapped sampler's own `epoch` when it has one, so `set_epoch` on
    either sampler (this one forwards it) ends the skip; so does a pass run to its end (a loop
    that never calls `set_epoch`, or a sampler without it, goes on with whole passes instead of
    losing the skipped samples again on every pass). The first pass of the resumed epoch
    leaves the global generators as they were: in the uninterrupted run, whatever the sampler
    draws at the start of an epoch (RandomSampler's seed) happened before the checkpoint.
    """

    def __init__(self, sampler: Any, skip: int, epoch: int) -> None:
        self.sampler = sampler
        self.skip = skip
        self.resume_epoch = epoch
        self._epoch = epoch
        # True until the resumed epoch's first pass starts; that pass must not move the generators.
        self.rng_pending = skip > 0
        self.skip_done = False   # a resumed pass ran to its end: later passes are whole
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        inner = getattr(self.sampler, "epoch", None)
        return inner if isinstance(inner, int) and hasattr(self.sampler, "set_epoch") else self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _skip(self) -> int:
        return self.skip if self.epoch == self.resume_epoch and not self.skip_done else 0

    def resume_pending(self) -> bool:
        """Whether the next pass is the resumed epoch's first (it must leave the global generators untouched)."""
        return self.rng_pending and self._skip() > 0

    def __iter__(self) -> Iterator[Any]:
        skip = self._skip()
        if not skip:
            return iter(self.sampler)
        if not self.resume_pending():
            return self._then_whole(itertools.islice(iter(self.sampler), skip, None))
        self.rng_pending = False
        with rng_untouched():
            indices = iter(self.sampler)
            # Skip now, so that a sampler drawing its seed lazily (at its first index) draws it here.
            collections.deque(itertools.islice(indices, self.skip), maxlen=0)
        return self._then_whole(indices)

    def _then_whole(self, indices: Iterator[Any]) -> Iterator[Any]:
        yield from indices
        self.skip_done = True

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self._skip())


class ResumedDataLoader(DataLoader):
    """A DataLoader whose first iterator in the resumed epoch leaves the global generators as they were.

    `DataLoader.__iter__` draws a base seed from torch's global generator when it has no
    `generator`. In the uninterrupted run that draw happened at the start of the epoch, before the
    checkpoint, so here it must not move the restored state (dropout would then differ).
    """

    sampler: ResumeSampler

    @property
    def batches_per_epoch(self) -> int:
        """Batches of a whole epoch (`len()` of this loader counts only what is left of the resumed one)."""
        samples, batch = len(self.sampler.sampler), cast(int, self.batch_size)
        return samples // batch if self.drop_last else -(-samples // batch)

    def __iter__(self) -> _BaseDataLoaderIter:
        with rng_untouched() if self.sampler.resume_pending() else contextlib.nullcontext():
            return super().__iter__()


def resume_dataloader(dataloader: DataLoader, position: DataPosition,
                      global_batch_size: Optional[int] = None) -> DataLoader:
    """A DataLoader like `dataloader` that starts at `position` (skipped samples are never loaded).

    The data-parallel size may differ from the saving run's: the skip is counted in global
    batches and converted to this rank's local batches. The global batch size may differ too
    when the samples consumed are a whole number of the new global batches (`convert_position`
    raises ValueError otherwise). `global_batch_size`: this run's samples in one dataloader item
    over all data ranks; default `loader_global_batch_size(dataloader)`. A position at or past the end
    of this run's epoch (a smaller dataset) starts the next epoch, with a warning (`position_in_epoch`).
    """
    if dataloader.batch_size is None or dataloader.batch_sampler is None:
        raise ValueError("resume_dataloader needs a DataLoader built with batch_size and a sampler; "
                         "a DataLoader with a custom batch_sampler must be resumed by its owner")
    position = convert_position(position, global_batch_size or cast(int, loader_global_batch_size(dataloader)))
    position = position_in_epoch(position, len_or_none(dataloader), len_or_none(dataloader.dataset))
    skip = position.batches_in_epoch * dataloader.batch_size
    sampler = ResumeSampler(dataloader.sampler, skip, position.order_epoch)
    kwargs: Dict[str, Any] = dict(batch_size=dataloader.batch_size, sampler=sampler, drop_last=dataloader.drop_last,
                                  collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                                  pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                                  worker_init_fn=dataloader.worker_init_fn, generator=dataloader.generator)
    if dataloader.num_workers > 0:
        kwargs.update(prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers,
                      multiprocessing_context=dataloader.multiprocessing_context)
    return ResumedDataLoader(dataloader.dataset, **kwargs)


def len_or_none(obj: Any) -> Optional[int]:
    """len(obj), or None for an object without a length (an iterable dataset)."""
    try:
        return len(obj)
    except TypeError:
        return None
