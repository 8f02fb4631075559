"""The calibration cache: measured rates as JSON, one file per user (never pickle), and the cycle
both probes run on it (`measure_cached`: read, agree across ranks on what to measure, measure, save).

`$ATORCH_CALIBRATION_CACHE` or `~/.cache/atorch/calibration.json`, {"version", "entries": {device kind: ...}};
an unreadable, corrupt or other-version file is ignored with a warning naming it."""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from atorch.distributed.process_group import collective_device
from atorch.utils.finite_numbers import is_finite_number

logger = logging.getLogger(__name__)

CACHE_ENV = "ATORCH_CALIBRATION_CACHE"
CACHE_VERSION = 1


def default_cache_path() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atorch", "calibration.json")


def load_cache(path: str) -> Dict[str, Any]:
    """The cache's entries; an unreadable, corrupt or other-version file is ignored with a warning."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"),
                                                                                               dict):
            raise ValueError(f"expected {{'version': {CACHE_VERSION}, 'entries': {{...}}}}")
        return data["entries"]
    except (OSError, ValueError, RecursionError) as e:     # RecursionError: absurdly nested JSON
        logger.warning("calibration cache %s is unusable (%s: %s); measuring again", path, type(e).__name__, e)
        return {}


def save_cache(path: str, entries: Mapping[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": dict(entries)}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def as_mapping(value: Any) -> Dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def probe_device(group: Any = None, device: Optional[torch.device] = None) -> torch.device:
    """Where a probe's collectives on `group` run: `device` when it is a CUDA device (gloo takes those
    too: the probe then measures the link the GPUs use), else where the group's collectives must run."""
    if device is not None and device.type == "cuda":
        return device
    return collective_device(group)


@dataclass(frozen=True)
class Measurement:
    """One cached measurement of a device kind, {name: number}, and how to take it."""

    where: Tuple[str, ...]
    """The keys leading to it in the device kind's cache entry, e.g. ("comm", "gloo:2")."""
    names: Sequence[str]
    """The numbers wanted; those the cache lacks are measured."""
    measure: Callable[[List[str]], Mapping[str, float]]
    """Measures (at least) the given names; called on every rank of the group at once when distributed."""
    per_rank: bool = True
    """The numbers are this rank's own (a matmul rate): averaged over the group. False: every rank
    already returns the same (a collective's time)."""
    whole: bool = False
    """The names are measured together: a cached entry holding only some of them is damaged, and the
    entry records when it was measured ("measured")."""


def _usable(name: str, value: Any) -> bool:
    """A rate or time is divided by (> 0); an overhead or a latency may be 0."""
    return is_finite_number(value) and (value > 0 or (value == 0 and name.endswith(("latency_s", ":overhead"))))


def _cached_numbers(path: str, entry: Mapping[str, Any], where: str, m: Measurement) -> Dict[str, float]:
    """The cached numbers of `m`; {} (measure again) when absent, and with a warning naming the file when damaged."""
    value: Any = entry
    for key in m.where:
        value = as_mapping(value).get(key)
    if value is None:
        return {}
    if isinstance(value, dict):
        numbers = {str(k): v for k, v in value.items() if k != "measured"}
        if all(_usable(k, v) for k, v in numbers.items()) and not (m.whole and set(m.names) - set(numbers)):
            return {k: float(v) for k, v in numbers.items()}
    expected = f"numbers > 0 for {', '.join(m.names)}" if m.whole else "{name: number > 0}"
    logger.warning("calibration cache %s: entry %s/%s is unusable (expected %s); measuring again", path, where,
                   "/".join(m.where), expected)
    return {}


def _average(numbers: Mapping[str, float], group: Any) -> Dict[str, float]:
    """The mean of each number over the ranks of `group` (which all hold the same names)."""
    names = sorted(numbers)
    values = torch.tensor([numbers[n] for n in names], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(values, group=group)
    values /= dist.get_world_size(group)
    return {n: float(v) for n, v in zip(names, values.tolist())}


def measure_cached(path: str, kind: str, measurements: Sequence[Measurement], group: Any = None,
                   refresh: bool = False) -> List[Dict[str, float]]:
    """The numbers of each of `measurements` for device kind `kind`: those in the cache at `path` (none
    when `refresh`), the missing ones measured and written back.

    Collective when a process group is initialized: every rank of `group` calls it with the same
    measurements. The ranks agree on which measurements any of them misses (their caches may differ)
    and measure every name of those, so the collectives of the probes see the same sizes on every
    rank; `per_rank` numbers are averaged over the group. Rank 0 writes the cache.
    """
    distributed = dist.is_available() and dist.is_initialized()
    entries = load_cache(path)
    if kind in entries and not isinstance(entries[kind], dict):
        logger.warning("calibration cache %s: entry %s is unusable (not an object); measuring again", path, kind)
    entry = as_mapping(entries.get(kind))
    found = [{} if refresh else _cached_numbers(path, entry, kind, m) for m in measurements]
    needed = [any(n not in numbers for n in m.names) for m, numbers in zip(measurements, found)]
    if distributed:
        flags = torch.tensor([int(x) for x in needed], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        needed = [bool(x) for x in flags.tolist()]
    results: List[Dict[str, float]] = []
    for m, numbers, need in zip(measurements, found, needed):
        numbers = dict(numbers)
        if need:
            names = list(m.names) if distributed else [n for n in m.names if n not in numbers]
            measured = {str(k): float(v) for k, v in m.measure(names).items()}
            numbers.update(_average(measured, group) if distributed and m.per_rank else measured)
        results.append(numbers)
    if any(needed) and (not distributed or dist.get_rank() == 0):
        new_entry: Dict[str, Any] = dict(entry)
        stamp = now_iso()
        for m, numbers, need in zip(measurements, results, needed):
            if need:
                _put(new_entry, m.where, {**numbers, "measured": stamp} if m.whole else numbers)
        new_entry["measured"] = stamp
        try:
            save_cache(path, {**entries, kind: new_entry})
        except OSError as e:
            logger.warning("could not write the calibration cache %s: %s", path, e)
    return results


def _put(entry: Dict[str, Any], where: Tuple[str, ...], value: Any) -> None:
    """entry[where[0]][where[1]]... = value, copying the mappings on the way (never editing what was read)."""
    head, *rest = where
    entry[head] = value if not rest else as_mapping(entry.get(head))
    if rest:
        _put(entry[head], tuple(rest), value)
