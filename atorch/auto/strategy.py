"""`Strategy`: an ordered list of optimizations `(name, config, tunable)`, with exact JSON round trips.

Strategy files are JSON, never pickle: configs may hold plain JSON values, tuples, torch dtypes,
classes (stored by import path) and dataclasses of those; anything else (a callable, a live
object) is refused with the key that holds it. Reading a file imports no module outside
`TRUSTED_PACKAGES` (importing runs a module's code): a class of any other module is found once
the reading script has imported that module itself. ATorch's pickled strategy files are still read
(`Strategy.load` detects them) by a restricted reader that executes nothing
(`atorch.auto.strategy_pickle`); `convert_strategy_file` turns one into JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch

from atorch.auto.strategy_pickle import is_pickle, read_pickled_strategy

StrategyLike = Union["Strategy", Sequence[Any], str, os.PathLike]


# The keys of one item of a JSON strategy (`Strategy.to_json`).
_ITEM_KEYS = ("name", "config", "tunable")
# Packages whose modules a JSON strategy may import to find a class it names; a class of any other
# module is found only once the reading process has imported that module itself (`_import_class`).
TRUSTED_PACKAGES = ("torch", "transformers", "atorch", "peft", "deepspeed")


class NotStorableError(ValueError):
    """A config value that a JSON strategy file cannot store (a callable, a live object); `where` names its key."""

    def __init__(self, where: str, value: Any):
        self.where, self.value = where, value
        super().__init__(f"{where} holds {self.what}, which a JSON strategy file cannot store; pass it in code "
                         "(load_strategy=[...]) instead of a file")

    @property
    def what(self) -> str:
        text = repr(self.value)
        return f"{type(self.value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


@dataclass(frozen=True)
class StrategyItem:
    """One optimization of a strategy. `tunable` marks a config the planner may change."""

    name: str
    config: Any = None
    tunable: bool = False

    def as_tuple(self) -> Tuple[str, Any, bool]:
        return (self.name, self.config, self.tunable)


def _to_item(raw: Any) -> StrategyItem:
    if isinstance(raw, StrategyItem):
        return raw
    if isinstance(raw, str):
        return StrategyItem(raw)
    if isinstance(raw, (tuple, list)) and 1 <= len(raw) <= 3 and isinstance(raw[0], str):
        name = raw[0]
        config = raw[1] if len(raw) > 1 else None
        tunable = raw[2] if len(raw) > 2 else False
        if not isinstance(tunable, bool):
            raise ValueError(f"strategy item {name!r}: tunable must be a bool, got {tunable!r}")
        return StrategyItem(name, config, tunable)
    raise ValueError(
        f"strategy item {raw!r} must be a name, (name, config) or (name, config, tunable)")


class Strategy:
    """An ordered list of optimizations, as given by the user or chosen by the search."""

    def __init__(self, items: Iterable[Any] = ()):
        if isinstance(items, (str, bytes)):
            # A string is iterable, and its characters would each become an "optimization".
            raise TypeError(f"Strategy({items!r}): items must be a list of optimizations, e.g. "
                            f"Strategy([{items!r}]) (Strategy.load(path) reads a file)")
        self._items: List[StrategyItem] = [_to_item(i) for i in items]

    @classmethod
    def from_any(cls, obj: Optional[StrategyLike]) -> "Strategy":
        """Accept a Strategy, a list of items (names / (name, config) / (name, config, tunable)) or a JSON path."""
        if obj is None:
            return cls()
        if isinstance(obj, Strategy):
            return cls(obj._items)
        if isinstance(obj, (str, os.PathLike)):
            return cls.load(obj)
        if isinstance(obj, (bytes, bytearray)):
            return cls.from_bytes(bytes(obj))
        if isinstance(obj, (list, tuple)):
            return cls(obj)
        raise ValueError(f"load_strategy={obj!r} must be a Strategy, a list of optimizations, a JSON strategy file "
                         "path, or the bytes of a strategy (JSON or ATorch pickle)")

    # -- container protocol -------------------------------------------------
    def __iter__(self) -> Iterator[StrategyItem]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> StrategyItem:
        return self._items[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and self._items == other._items

    def __hash__(self) -> int:
        # Consistent with __eq__ (equal items hash alike, whatever the order of a config dict's keys)
        # and never raising: a config may hold anything, a callable included.
        return hash(tuple((i.name, _hash_key(i.config), i.tunable) for i in self._items))

    def __repr__(self) -> str:
        return f"Strategy({[i.as_tuple() for i in self._items]!r})"

    def names(self) -> List[str]:
        return [i.name for i in self._items]

    def get(self, name: str) -> Optional[StrategyItem]:
        return next((i for i in self._items if i.name == name), None)

    def __contains__(self, name: object) -> bool:
        return any(i.name == name for i in self._items)

    def to_list(self) -> List[Tuple[str, Any, bool]]:
        return [i.as_tuple() for i in self._items]

    # -- ATorch's Strategy methods ---------------------------------------------
    def opt_names(self) -> List[str]:
        """The optimization names, in order (ATorch's name for `names()`)."""
        return self.names()

    def add_opt(self, opt: Any) -> None:
        """Append an optimization: a name, (name, config) or (name, config, tunable); tunable None means False."""
        if isinstance(opt, (tuple, list)) and len(opt) == 3 and opt[2] is None:
            opt = (opt[0], opt[1], False)
        self._items.append(_to_item(opt))

    def get_parallel_mode(self) -> Tuple[bool, Any]:
        """(True, config of parallel_mode) when the strategy has one, else (False, None)."""
        item = self.get("parallel_mode")
        return (True, item.config) if item is not None else (False, None)

    def describe(self) -> str:
        """Short human name with each item's settings, e.g. 'parallel_mode(data=2)+amp_native(bfloat16)+fsdp'.

        Settings are what each optimization says about its config (`describe_config`): the
        dtype of amp_native, 'deepspeed stage 3' for fsdp with use_ds_zero, non-default fields.
        """
        from atorch.auto.opt_lib.base import get_optimization  # the registry sits above this module

        parts = []
        for item in self._items:
            try:
                cls = get_optimization(item.name)
                settings = cls.describe_config(cls.parse_config(item.config))
            except ValueError:   # an unknown name or a bad config: show it as given
                settings = ""
            parts.append(f"{item.name}({settings})" if settings else item.name)
        return "+".join(parts) if parts else "(no optimization)"

    # -- JSON ---------------------------------------------------------------
    def to_json(self, indent: Optional[int] = None) -> str:
        payload = {"format": "atorch.strategy/1",
                   "items": [{"name": i.name, "config": _encode(i.config, f"{i.name}.config"), "tunable": i.tunable}
                             for i in self._items]}
        return json.dumps(payload, indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"strategy is not valid JSON: {e}") from e
        if not isinstance(payload, dict):
            raise ValueError(f"strategy JSON must be an object with format 'atorch.strategy/1' and 'items', got a "
                             f"{type(payload).__name__}")
        if payload.get("format") != "atorch.strategy/1":
            found = f"format {payload['format']!r}" if "format" in payload else "no 'format' key"
            raise ValueError(f"strategy JSON has {found}; this atorch reads format 'atorch.strategy/1' (an object "
                             "{\"format\": \"atorch.strategy/1\", \"items\": [...]}, as Strategy.save writes); a "
                             "file of another version or tool needs converting: list its optimizations as items")
        items = payload.get("items")
        if not isinstance(items, list):
            raise ValueError(f"strategy JSON 'items' must be a list of {{'name': ..., 'config': ...}} objects, got "
                             f"{items!r}")
        out = []
        for k, d in enumerate(items):
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                raise ValueError(f"strategy JSON items[{k}]={d!r} must be an object with a string 'name' (and "
                                 "optionally 'config' and 'tunable')")
            unknown = sorted(set(d) - set(_ITEM_KEYS))
            if unknown:
                hints = [f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
                         for k, close in ((k, difflib.get_close_matches(k, _ITEM_KEYS, n=1, cutoff=0.5))
                                          for k in unknown)]
                raise ValueError(f"strategy JSON items[{k}] ({d['name']!r}): unknown key(s) {', '.join(hints)}; an "
                                 f"item has {list(_ITEM_KEYS)}")
            tunable = d.get("tunable", False)
            if not isinstance(tunable, bool):
                raise ValueError(f"strategy JSON items[{k}] ({d['name']!r}): tunable={tunable!r} must be true or false")
            out.append(StrategyItem(d["name"], _decode(d.get("config"), f"items[{k}].config"), tunable))
        return cls(out)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the JSON strategy file atomically (a temporary file renamed over `path`).

        A failed write or rename (e.g. `path` is a directory) removes the temporary file
        instead of leaving `<path>.tmp` behind, then raises.
        """
        text = self.to_json(indent=2)
        tmp = f"{os.fspath(path)}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.isfile(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Strategy":
        """Read a JSON strategy file, or an ATorch pickled one (read without executing anything)."""
        if os.path.isdir(path):
            raise ValueError(f"strategy file {os.fspath(path)!r} is a directory; give the path of a JSON strategy "
                             "file inside it (auto_accelerate's save_strategy_to_file writes one)")
        if not os.path.isfile(path):
            name = os.fspath(path)
            # A bare word is likelier an optimization's name given where a list was meant.
            hint = (f"; to apply optimizations by name, pass a list, e.g. load_strategy=[{name!r}]"
                    if isinstance(name, str) and name.isidentifier() else "")
            raise ValueError(f"strategy file {name!r} does not exist{hint}")
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), source=os.fspath(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> "Strategy":
        """A strategy from the bytes of a JSON strategy or of an ATorch strategy pickle."""
        if is_pickle(data):
            return cls(read_pickled_strategy(data, source))
        try:
            text = data.decode("utf-8-sig")    # a byte-order mark (some Windows editors write one) is not content
        except UnicodeDecodeError:
            text = None
        if not data.strip():
            raise ValueError(f"strategy {source!r} is empty; a strategy file is the JSON that "
                             "Strategy.save (or auto_accelerate's save_strategy_to_file) writes")
        if text is not None and text.lstrip().startswith("["):
            raise ValueError(f"strategy {source!r} is a JSON list; a strategy file is an object "
                             "{\"format\": \"atorch.strategy/1\", \"items\": [{\"name\": \"fsdp\"}, ...]} "
                             "(Strategy([...]).save(path) writes one), or pass the list in code as load_strategy=[...]")
        if text is None or not text.lstrip().startswith("{"):
            raise ValueError(f"strategy {source!r} is neither a JSON strategy (an object with format "
                             "'atorch.strategy/1') nor an ATorch strategy pickle; those are the accepted formats")
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"strategy {source!r}: {e}") from e


def convert_strategy_file(src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> "Strategy":
    """Read `src` (an ATorch pickled strategy, or JSON) and write it to `dst` as a JSON strategy file."""
    strategy = Strategy.load(src)
    strategy.save(dst)
    return strategy


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, f"{where}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{k}]") for k, v in enumerate(value)]}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string; strategy JSON needs string keys")
        return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if isinstance(value, type):
        return {"__class__": f"{value.__module__}:{value.__qualname__}"}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
        return {"__dataclass__": f"{type(value).__module__}:{type(value).__qualname__}", "fields": fields}
    raise NotStorableError(where, value)


def _import_class(path: Any, where: str) -> type:
    """The class named 'module:QualName' in strategy JSON, or a ValueError naming the entry.

    Importing a module runs its code, so a strategy file may only import from `TRUSTED_PACKAGES`;
    any other module must already be imported by the process that reads the file (the user's
    script imported it: nothing new runs).
    """
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"strategy JSON {where}: {path!r} must name a class as 'module:QualName'")
    module, _, qualname = path.partition(":")
    if module not in sys.modules and module.partition(".")[0] not in TRUSTED_PACKAGES:
        raise ValueError(f"strategy JSON {where}: class {path!r} is in module {module!r}, which is not imported; a "
                         f"strategy file only imports modules of {', '.join(TRUSTED_PACKAGES)} (importing a module "
                         f"runs its code): import {module} in your script before loading the strategy, or pass the "
                         "class in code (load_strategy=[...])")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"strategy JSON {where}: class {path!r} cannot be imported here ({type(e).__name__}: "
                         f"{e})") from None
    if not isinstance(obj, type):
        raise ValueError(f"strategy JSON {where}: {path!r} is a {type(obj).__name__}, not a class")
    return obj


def _decode(value: Any, where: str = "config") -> Any:
    if isinstance(value, list):
        return [_decode(v, f"{where}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, dict):
        if "__tuple__" in value and len(value) == 1:
            if not isinstance(value["__tuple__"], list):
                raise ValueError(f"strategy JSON {where}: __tuple__ must hold a list, got {value['__tuple__']!r}")
            return tuple(_decode(v, f"{where}[{k}]") for k, v in enumerate(value["__tuple__"]))
        if "__dtype__" in value and len(value) == 1:
            dtype = getattr(torch, str(value["__dtype__"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown torch dtype {value['__dtype__']!r} in strategy JSON {where}")
            return dtype
        if "__class__" in value and len(value) == 1:
            return _import_class(value["__class__"], where)
        if "__dataclass__" in value and set(value) == {"__dataclass__", "fields"}:
            cls = _import_class(value["__dataclass__"], where)
            if not dataclasses.is_dataclass(cls) or not isinstance(value["fields"], dict):
                raise ValueError(f"strategy JSON {where}: {value['__dataclass__']} is not a dataclass, or its "
                                 "fields are not an object")
            fields = {k: _decode(v, f"{where}.{k}") for k, v in value["fields"].items()}
            try:
                return cast(Any, cls)(**fields)  # a dataclass type
            except TypeError as e:
                raise ValueError(f"strategy JSON {where}: {value['__dataclass__']}{tuple(fields)} cannot be "
                                 f"built: {e}") from None
        return {k: _decode(v, f"{where}.{k}") for k, v in value.items()}
    return value


def _hash_key(value: Any) -> Any:
    """A hashable stand-in for `value` that every value equal to it shares: dicts and sets by their
    contents in any order, sequences item by item, dataclasses (whose == compares their fields) by
    their fields; a value not hashable otherwise counts as 0 (unequal values may share a hash, equal ones must)."""
    if isinstance(value, dict):
        return frozenset((k, _hash_key(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_hash_key(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    try:
        return hash(value)
    except Exception:  # noqa: BLE001 - unhashable (TypeError), or a __hash__ of the user's that fails
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple(_hash_key(getattr(value, f.name)) for f in dataclasses.fields(value)))
    return 0
