"""Helpers ATorch training scripts import from `atorch.common.util_func`: batches, ports, division, time limits."""

from __future__ import annotations

import functools
import signal
import threading
import time
from typing import Any, Callable, TypeVar, Union, cast

import torch

from atorch.distributed.process_group import find_free_port

__all__ = ["apply_to_tensors", "data_to_device", "divide", "exit_after", "find_free_port", "get_ip_address"]

F = TypeVar("F", bound=Callable[..., Any])


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


def exit_after(seconds: float) -> Callable[[F], F]:
    """Decorator: the call raises TimeoutError (naming the function, the limit and the rank) after `seconds`.

    Uses SIGALRM, so it works only on Unix and in the main thread; called elsewhere, the
    decorated function raises RuntimeError before running. The previous SIGALRM handler and
    timer are restored when the call ends (a nested limit does not cancel an outer one for
    longer than the inner call).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ValueError(f"exit_after(seconds={seconds!r}): seconds must be a number > 0")

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def limited(*args: Any, **kwargs: Any) -> Any:
            if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
                raise RuntimeError(f"exit_after: {getattr(fn, '__qualname__', fn)} must be called in the main "
                                   "thread of a Unix process (the time limit is a SIGALRM)")

            def on_alarm(signum: int, frame: Any) -> None:
                where = f"rank {torch.distributed.get_rank()}: " if torch.distributed.is_initialized() else ""
                raise TimeoutError(f"{where}calling {getattr(fn, '__qualname__', fn)} timed out after {seconds} s")

            previous = signal.signal(signal.SIGALRM, on_alarm)
            started = time.monotonic()
            outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                return fn(*args, **kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if outer_left:
                    # An outer limit was running: give it back what it had left (at least a tick).
                    signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3))

        return cast(F, limited)

    return decorate
