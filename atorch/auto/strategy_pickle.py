"""Read ATorch's pickled strategy files without executing anything they could contain.

ATorch saved strategies with `pickle.dumps(Strategy)`: an object whose `opt_list` is a list
of `(name, config, tunable)` tuples. `pickle.load` on such a file would import and call
whatever the file names, so this reader uses a restricted `Unpickler`: `find_class` resolves
only ATorch's `Strategy` class (to an inert stand-in that records its attributes), the torch
dtypes, and `copyreg._reconstructor` limited to that stand-in; everything else raises. The
result is then checked to be plain values only (None, bool, int, float, str, lists, tuples,
dicts with string keys, torch dtypes) and returned as `(name, config, tunable)` tuples.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, List, Tuple

import torch

PICKLE_PROTOCOL_2_PLUS = b"\x80"  # first byte of every pickle of protocol 2 or later (ATorch used the default)

# Where ATorch's Strategy class lived; pickles name it by this path.
_ATORCH_STRATEGY_CLASSES = {("atorch.auto.strategy", "Strategy")}


class PickledStrategy:
    """Inert stand-in for ATorch's `Strategy` while unpickling: it only receives attributes."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"ATorch Strategy state must be a dict, got {type(state).__name__}")
        self.__dict__.update(state)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # Protocol 0/1 pickles build objects through copyreg._reconstructor; only the stand-in may be built.
    if cls is not PickledStrategy or base is not object or state is not None:
        raise pickle.UnpicklingError("this pickle builds an object other than an ATorch Strategy")
    return PickledStrategy()


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ATORCH_STRATEGY_CLASSES:
            return PickledStrategy
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        if (module, name) == ("builtins", "object"):
            return object
        raise pickle.UnpicklingError(f"the strategy pickle refers to {module}.{name}; only ATorch's Strategy, its "
                                     "list of (name, config, tunable) and plain values are accepted")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not accepted in a strategy pickle")


def _check_plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_check_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{where}: key {bad[0]!r} is not a string")
        return {k: _check_plain(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where} holds {type(value).__name__}, which is not a plain value; pass this optimization in "
                     "code (load_strategy=[...]) instead of a file")


def is_pickle(data: bytes) -> bool:
    return data[:1] == PICKLE_PROTOCOL_2_PLUS


def read_pickled_strategy(data: bytes, source: str = "<bytes>") -> List[Tuple[str, Any, bool]]:
    """The `(name, config, tunable)` items of an ATorch strategy pickle; ValueError naming `source` otherwise.

    Accepts a pickled ATorch `Strategy` or a pickled plain list of items. `tunable` None
    (ATorch's "decide later") becomes False.
    """
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise ValueError(f"strategy {source!r} is not an accepted ATorch strategy pickle: {e}") from e
    items = getattr(obj, "opt_list", None) if isinstance(obj, PickledStrategy) else obj
    if not isinstance(items, list):
        raise ValueError(f"strategy {source!r}: the pickle holds {type(obj).__name__}, not an ATorch Strategy or a "
                         "list of (name, config, tunable)")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = (item, None, None)
        if not isinstance(item, (tuple, list)) or not 1 <= len(item) <= 3 or not isinstance(item[0], str):
            raise ValueError(f"strategy {source!r}: item {i} is {item!r}, not (name, config, tunable)")
        name = item[0]
        config = _check_plain(item[1] if len(item) > 1 else None, f"strategy {source!r} item {name!r} config")
        tunable = item[2] if len(item) > 2 else None
        if tunable is not None and not isinstance(tunable, bool):
            raise ValueError(f"strategy {source!r} item {name!r}: tunable={tunable!r} must be a bool or None")
        out.append((name, config, bool(tunable)))
    return out

