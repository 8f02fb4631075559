"""Helpers ATorch training scripts import from `atorch.common.util_func`: moving nested batches, ports, division."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from atorch.distributed.process_group import find_free_port

__all__ = ["apply_to_tensors", "data_to_device", "divide", "find_free_port", "get_ip_address"]


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """`data` with `fn` applied to every tensor in it; dicts, lists, tuples and namedtuples keep their type.

    Anything that is not a tensor or a container of them is returned as it is.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: apply_to_tensors(fn, v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple: positional constructor
        return type(data)(*(apply_to_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(fn, v) for v in data)
    return data


def data_to_device(data: Any, device: Union[str, torch.device, int], non_blocking: bool = False) -> Any:
    """Move every tensor of a nested batch to `device`; `device="pin"` pins host memory instead.

    The default `prepare_input` of ATorch's `auto_accelerate` (`prepare_input(data, device)`).
    """
    if device == "pin":
        return apply_to_tensors(lambda t: t.pin_memory(), data)
    return apply_to_tensors(lambda t: t.to(device, non_blocking=non_blocking), data)


def divide(numerator: int, denominator: int) -> int:
    """`numerator // denominator`, raising ValueError (with both values) when it does not divide exactly."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def get_ip_address() -> str:
    """This host's outbound IPv4 address (no packet is sent), or 127.0.0.1 when there is no route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
