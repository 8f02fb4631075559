"""What crosses between the deployment proxy and its workers, and how: JSON headers and raw tensor bytes.

A message is one JSON frame followed by one raw frame per tensor, all through a
`multiprocessing.connection.Connection` (a Unix socket pair: no files, no pickling). Values
that may cross, nested freely: None, bool, int, float, str, lists/tuples, dicts with str
keys, tensors (any dtype, shape and device; they travel as contiguous CPU bytes), and
transformers `ModelOutput`s (by class name, rebuilt only from `transformers` itself).
A model output's KV cache stays with the workers: a field holding one (a transformers `Cache`,
or the legacy tuples of key/value tensors) is left out, whatever transformers names the field
(`past_key_values` before 5.x, `cache` since). Anything else is rejected with a TypeError
naming where it was found.
"""

from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_OUTPUT = "__model_output__"
# The names transformers gives a model output's cache field (4.x: past_key_values; 5.x: cache; state-space
# models: cache_params). A legacy tuple cache is recognized only under one of these names.
CACHE_FIELDS = ("past_key_values", "cache", "cache_params")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"deploy protocol: unknown dtype {name!r}")
    return dtype


def _encode(value: Any, tensors: List[torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_TENSOR: len(tensors) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    output_cls = _model_output_class()
    if output_cls is not None and isinstance(value, output_cls):
        fields = {k: v for k, v in cast(Any, value).items() if not is_cache(k, v)}  # caches stay with the workers
        return {_OUTPUT: type(value).__name__, "fields": _encode(fields, tensors, where)}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"deploy: {where} has non-string keys {bad[:3]}; only str keys can cross processes")
        return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"deploy: {where} is of type {type(value).__name__}; only tensors, numbers, strings, None and "
                    "lists/tuples/dicts of them can be sent to the deployed model")


def _decode(value: Any, tensors: List[torch.Tensor], device: Optional[torch.device]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, device) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        t = tensors[value[_TENSOR]]
        return t.to(device) if device is not None else t
    if _TUPLE in value:
        return tuple(_decode(v, tensors, device) for v in value[_TUPLE])
    if _OUTPUT in value:
        fields = _decode(value["fields"], tensors, device)
        cls = _find_model_output_class(value[_OUTPUT])
        return cls(**fields) if cls is not None else fields
    return {k: _decode(v, tensors, device) for k, v in value.items()}


def is_cache(field: str, value: Any) -> bool:
    """Whether a model output's `field` holds a KV cache: a transformers `Cache` (or a model's own transformers
    class named `...Cache`) under any name, or legacy tuples of key/value tensors under a cache field's name.

    Recognized by what it is, not by one field name: transformers 5 renamed `past_key_values` to `cache`, and a
    cache must never be sent (it is large, it is not plain data, and the caller cannot use a shard's cache)."""
    if value is None:
        return False
    cache_utils = sys.modules.get("transformers.cache_utils")
    base = getattr(cache_utils, "Cache", None)
    if isinstance(base, type) and isinstance(value, base):
        return True
    cls = type(value)
    if cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache"):
        return True
    return field in CACHE_FIELDS and _is_legacy_cache(value)


def _is_legacy_cache(value: Any) -> bool:
    """Tuples (one per layer) of tuples of tensors (key, value, ...): the cache format of transformers before 4.36."""
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(layer, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in layer) for layer in value)


def _model_output_class() -> Optional[type]:
    utils = sys.modules.get("transformers.utils")
    return getattr(utils, "ModelOutput", None)


def _find_model_output_class(name: str) -> Optional[type]:
    """A `ModelOutput` subclass of transformers by name (from transformers' own modules only)."""
    import transformers.generation.utils as generation_utils
    import transformers.modeling_outputs as modeling_outputs

    base = _model_output_class()
    for module in (modeling_outputs, generation_utils):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and base is not None and issubclass(cls, base):
            return cls
    return None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # An ndarray exports the buffer protocol; numpy's stubs do not declare __buffer__.
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def encode(header: Dict[str, Any], payload: Any = None) -> List[Union[bytes, memoryview]]:
    """The frames of one message: `header` (plain JSON data) with `payload` (any value the module
    docstring allows), then one frame per tensor. Raises TypeError for a payload it cannot carry."""
    tensors: List[torch.Tensor] = []
    body = _encode(payload, tensors, "the payload")
    return [json.dumps({**header, "payload": body, "n_tensors": len(tensors)}).encode()] + \
        [_tensor_bytes(t) for t in tensors]


def send_frames(conn: Connection, frames: List[Union[bytes, memoryview]]) -> None:
    for frame in frames:
        conn.send_bytes(frame)


def send(conn: Connection, header: Dict[str, Any], payload: Any = None) -> None:
    """Send `header` (plain JSON data) and `payload` (any value the module docstring allows)."""
    send_frames(conn, encode(header, payload))


def recv(conn: Connection, device: Optional[torch.device] = None) -> Tuple[Dict[str, Any], Any]:
    """The next `(header, payload)`; payload tensors are moved to `device` when given. EOFError if the peer is gone."""
    header = json.loads(conn.recv_bytes().decode())
    specs: List[Dict[str, Any]] = []
    _collect_specs(header["payload"], specs)
    specs.sort(key=lambda s: s[_TENSOR])
    tensors: List[torch.Tensor] = []
    for spec in specs:
        data = conn.recv_bytes()
        dtype = _dtype(spec["dtype"])
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(spec["shape"]))
    if len(tensors) != header["n_tensors"]:
        raise ValueError(f"deploy protocol: header announced {header['n_tensors']} tensors, found {len(tensors)}")
    return header, _decode(header.pop("payload"), tensors, device)


def _collect_specs(value: Any, out: List[Dict[str, Any]]) -> None:
    if isinstance(value, list):
        for v in value:
            _collect_specs(v, out)
    elif isinstance(value, dict):
        if _TENSOR in value:
            out.append(value)
            return
        for v in value.values():
            _collect_specs(v, out)
