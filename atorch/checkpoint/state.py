"""The small, non-tensor training state: JSON encoding, RNG states, and the data position.

Everything here is stored as JSON (never pickle): lr scheduler and grad scaler states,
optimizer hyperparameters, per-rank RNG states, the step and where the data stream stands.
`DataPosition` plus `resume_dataloader` make a resumed run see exactly the batches the
uninterrupted run would have seen, at any data-parallel size.
"""

from __future__ import annotations

import base64
import itertools
import logging
import random
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Optional, Tuple, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

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


# -- data position -----------------------------------------------------------------------

@dataclass(frozen=True)
class DataPosition:
    """Where the data stream stands: `batches_in_epoch` batches of epoch `epoch` were consumed.

    Counted in global batches, so the position means the same samples at any data-parallel
    size: with `DistributedSampler`, global batch k is always positions [k*B, (k+1)*B) of the
    epoch's (possibly shuffled) order, however it is spread over ranks.
    """

    epoch: int = 0
    batches_in_epoch: int = 0
    global_batch_size: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Dict[str, Any]) -> "DataPosition":
        return cls(int(raw.get("epoch", 0)), int(raw.get("batches_in_epoch", 0)), raw.get("global_batch_size"))

    @classmethod
    def after_steps(cls, steps: int, batches_per_epoch: Optional[int], epoch: int = 0,
                    global_batch_size: Optional[int] = None) -> "DataPosition":
        """The position after `steps` batches from the start of `epoch` (one batch per step)."""
        if not batches_per_epoch:
            return cls(epoch, steps, global_batch_size)
        return cls(epoch + steps // batches_per_epoch, steps % batches_per_epoch, global_batch_size)


class ResumeSampler(Sampler):
    """Yields `sampler`'s indices, skipping the first `skip` in epoch `epoch` only.

    `set_epoch` is forwarded, so later epochs are the wrapped sampler's unchanged.
    """

    def __init__(self, sampler: Any, skip: int, epoch: int) -> None:
        self.sampler = sampler
        self.skip = skip
        self.resume_epoch = epoch
        self.epoch = epoch
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _skip(self) -> int:
        return self.skip if self.epoch == self.resume_epoch else 0

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self._skip(), None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self._skip())


def resume_dataloader(dataloader: DataLoader, position: DataPosition) -> DataLoader:
    """A DataLoader like `dataloader` that starts at `position` (skipped samples are never loaded).

    The data-parallel size may differ from the saving run's: the skip is counted in global
    batches and converted to this rank's local batches.
    """
    if dataloader.batch_size is None or dataloader.batch_sampler is None:
        raise ValueError("resume_dataloader needs a DataLoader built with batch_size and a sampler; "
                         "a DataLoader with a custom batch_sampler must be resumed by its owner")
    skip = position.batches_in_epoch * dataloader.batch_size
    sampler = ResumeSampler(dataloader.sampler, skip, position.epoch)
    kwargs: Dict[str, Any] = dict(batch_size=dataloader.batch_size, sampler=sampler, drop_last=dataloader.drop_last,
                                  collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                                  pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                                  worker_init_fn=dataloader.worker_init_fn, generator=dataloader.generator)
    if dataloader.num_workers > 0:
        kwargs.update(prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers,
                      multiprocessing_context=dataloader.multiprocessing_context)
    return DataLoader(dataloader.dataset, **kwargs)
