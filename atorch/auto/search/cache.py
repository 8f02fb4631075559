"""What a search measured, remembered: a second search on the same setup needs one confirming dry run.

A setup is (model config hash, world size, device kind and name, library versions, global batch,
sequence length): `SetupKey`. The cache is one JSON file (never pickle: a results file must not
be able to run code) holding one setup's dry-run results, keyed by the strategy's JSON, and the
last completed search (its winner, trial table and reason). A file that cannot be read, is not
this format (an entry that is not a valid measurement included, or a trial row with a number that is
not one), or was recorded for another setup is ignored with a warning that names it, and is replaced
on the next save; a remembered winner that its own search measured slower than another strategy is
not confirmed (the search runs again). Pure: no collectives and
no training code; `auto_search` decides when to read and write it (rank 0 only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import time
import types
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

import torch

from atorch.auto.devices import cpu_model_name
from atorch.auto.search.search import DryRunResult
from atorch.auto.strategy import Strategy
from atorch.utils.finite_numbers import finite_float, is_finite_number
from atorch.utils.stable import stable_repr

logger = logging.getLogger(__name__)

FORMAT = "atorch-search-cache"
FORMAT_VERSION = 1
CACHE_FILE_NAME = "search_cache.json"
# Distributions whose version changes what a strategy costs; a missing one is recorded as absent.
VERSIONED_PACKAGES = ("atorch", "torch", "transformers", "deepspeed", "peft")


@dataclass(frozen=True)
class SetupKey:
    """What must be equal for a cached measurement to stand for a new one."""

    model_hash: str
    world_size: int
    device: str                         # kind and name, e.g. "cuda: NVIDIA H100 80GB HBM3"
    versions: Tuple[Tuple[str, str], ...]
    global_batch: int
    seq_len: int
    # The optimizer factory and its arguments (e.g. "torch.optim.adamw.AdamW {'lr': 0.001}"): its
    # state is part of the memory, its step part of the time. "" in caches written before it was kept.
    optimizer: str = ""
    # Ranks per node when the job spans several nodes (0: one node). A strategy's collectives cross the
    # network only then, so a time measured on one node does not stand for a multi-node job of the same
    # world size (and its space differs: tensor splits stay inside a node). 0 in caches written before.
    ranks_per_node: int = 0

    def to_json(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_json(cls, data: Any) -> "SetupKey":
        """The key stored in a cache file; ValueError when a field is missing or of the wrong type."""
        if not isinstance(data, dict) or not isinstance(data.get("versions"), dict):
            raise ValueError("'setup' must be an object with a 'versions' object")
        return cls(_text(data, "model_hash"), _integer(data.get("world_size"), "world_size"), _text(data, "device"),
                   tuple(sorted((str(k), str(v)) for k, v in data["versions"].items())),
                   _integer(data.get("global_batch"), "global_batch"), _integer(data.get("seq_len"), "seq_len"),
                   str(data.get("optimizer", "")), _integer(data.get("ranks_per_node", 0), "ranks_per_node", least=0))

    def differences(self, cached: "SetupKey") -> List[str]:
        """What differs from `cached`, e.g. "world_size: cached 2, now 4"."""
        now, then = self.to_json(), cached.to_json()
        return [f"{k}: cached {then[k]!r}, now {now[k]!r}" for k in now if now[k] != then[k]]


def setup_key(model: torch.nn.Module, world_size: int, device: torch.device, global_batch: int,
              seq_len: int, optimizer: str = "", ranks_per_node: Optional[int] = None) -> SetupKey:
    return SetupKey(model_config_hash(model), int(world_size), device_description(device), library_versions(),
                    int(global_batch), int(seq_len), optimizer, int(ranks_per_node or 0))


def optimizer_description(optim_func: Any, optim_args: Mapping[str, Any]) -> str:
    """The optimizer part of the setup key: the factory's qualified name and its arguments, and for a
    factory that is a function (a lambda, a `functools.partial`) a fingerprint of its code: two lambdas
    building SGD and Adagrad share a name, and an edited factory keeps its name."""
    if optim_func is None:
        return ""
    qualname = getattr(optim_func, "__qualname__", None) or stable_repr(optim_func)
    name = f"{getattr(optim_func, '__module__', '')}.{qualname}"
    text = f"{name} {json.dumps(dict(optim_args), sort_keys=True, default=stable_repr)}"
    fingerprint = _code_fingerprint(optim_func)
    return f"{text} code:{fingerprint}" if fingerprint else text


def _code_fingerprint(obj: Any, depth: int = 0) -> str:
    """A short hash of what a function computes (bytecode, constants, names, defaults, closure values);
    "" for a class (its qualified name is the key) or anything without code. The same factory gives the
    same hash in every process: nothing hashed holds an object's address or a set's iteration order
    (which follows PYTHONHASHSEED for strings)."""
    if isinstance(obj, functools.partial):
        inner = _code_fingerprint(obj.func, depth + 1)
        return _short_hash(" ".join([inner, stable_repr(obj.func), stable_repr(obj.args),
                                     stable_repr(obj.keywords)]))
    code = getattr(obj, "__code__", None)
    if code is None or isinstance(obj, type) or depth > 3:
        return ""
    cells = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _has_contents(c)]
    parts = [code.co_code.hex(), stable_repr(_consts(code)), repr(code.co_names),
             stable_repr(getattr(obj, "__defaults__", None)), stable_repr(cells)]
    return _short_hash(" ".join(parts))


def _consts(code: types.CodeType) -> tuple:
    """A code object's constants, nested code objects by their own bytecode (their repr holds an address)."""
    return tuple((c.co_code.hex(), _consts(c), c.co_names) if isinstance(c, types.CodeType) else c
                 for c in code.co_consts)


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:      # an empty cell
        return False
    return True


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_config_hash(model: torch.nn.Module) -> str:
    """sha256 of the model's class, its config (a Hugging Face config's dict, if any) and every
    parameter's and buffer's name, shape, dtype and trainability: what decides a step's cost."""
    config = getattr(model, "config", None)
    config_dict: Any = None
    if config is not None and hasattr(config, "to_dict"):
        config_dict = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    tensors = [(n, list(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in model.named_parameters()]
    tensors += [(n, list(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
    text = json.dumps({"class": f"{type(model).__module__}.{type(model).__qualname__}", "config": config_dict,
                       "tensors": tensors}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def device_description(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {cpu_model_name()} x{os.cpu_count()}"


def library_versions() -> Tuple[Tuple[str, str], ...]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    versions["torch"] = torch.__version__           # the running one, also for source builds
    return tuple(sorted(versions.items()))


def result_to_json(result: DryRunResult) -> Dict[str, Any]:
    return {"throughput": result.throughput, "peak_memory_bytes": result.peak_memory_bytes, "error": result.error,
            "step_time_s": result.step_time_s, "step_times_s": list(result.step_times_s),
            "throughput_ci": list(result.throughput_ci) if result.throughput_ci else None}


def result_from_json(data: Mapping[str, Any]) -> DryRunResult:
    """A remembered dry run; ValueError when the entry is not what `result_to_json` writes (a hand-edited
    or damaged file must not reach the search as a measurement).

    Every number is finite and >= 0; a success (no error) is a measurement, so its throughput, step
    times and interval bounds are > 0, as a dry run reports them: a success with throughput 0 reached
    the search as the candidate's failure ("evaluator reported throughput 0.0") and retired it."""
    if not isinstance(data, dict):
        raise ValueError(f"a result must be an object, got {type(data).__name__}")
    error = data.get("error")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"error={error!r} must be a string or null")
    peak = data.get("peak_memory_bytes")
    steps = data.get("step_times_s") or []
    ci = data.get("throughput_ci")
    if not isinstance(steps, list) or (ci is not None and (not isinstance(ci, list) or len(ci) != 2)):
        raise ValueError("step_times_s must be a list and throughput_ci null or a [low, high] pair")
    step_time = data.get("step_time_s")
    positive = error is None        # what a successful dry run measured is > 0
    if ci is not None and _number(ci[0], "throughput_ci", positive) > _number(ci[1], "throughput_ci", positive):
        raise ValueError(f"throughput_ci={ci!r} is not a [low, high] pair")
    return DryRunResult(_number(data.get("throughput"), "throughput", positive),
                        None if peak is None else _integer(peak, "peak_memory_bytes", 0),
                        error, None if step_time is None else _number(step_time, "step_time_s", positive),
                        tuple(_number(t, "step_times_s", positive) for t in steps),
                        None if ci is None else (float(ci[0]), float(ci[1])))


def _number(value: Any, name: str, positive: bool = False) -> float:
    """`value` as a finite number >= 0 (> 0 when `positive`: a successful run's measurement)."""
    if not is_finite_number(value) or value < 0 or (positive and value == 0):
        least = "> 0 in a successful result" if positive else ">= 0"
        raise ValueError(f"{name}={value!r} must be a finite number {least}")
    return float(value)


def _integer(value: Any, name: str, least: int = 1) -> int:
    """`value` as an integer >= `least` (a JSON float with an integral value is accepted)."""
    if not is_finite_number(value) or value != int(value) or value < least:
        raise ValueError(f"{name}={value!r} must be an integer >= {least}")
    return int(value)


def _text(data: Mapping[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} must be a string")
    return value


# The numeric columns of the trial and pruned tables (TRIAL_COLUMNS'); NaN or null: unknown.
NUMERIC_ROW_COLUMNS = ("trial", "throughput", "throughput_lo", "throughput_hi", "predicted_throughput",
                       "predicted_memory", "measured_memory", "seconds", "planner_seconds")


def _last_search(data: Any) -> Optional[Dict[str, Any]]:
    """The remembered search, checked as far as `cached_best` and the confirmation read it; ValueError
    when it is damaged (its winner must parse as a strategy, its tables be lists of rows)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"last_search must be an object, got {type(data).__name__}")
    best = data.get("best")
    if best is not None:
        if not isinstance(best, str):
            raise ValueError(f"last_search.best={best!r} must be a strategy's JSON text")
        Strategy.from_json(best)
    for name in ("trials", "pruned"):
        rows = data.get(name) or []
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"last_search.{name} must be a list of objects")
        for i, row in enumerate(rows):
            # The report draws these (a throughput of "abc" passed here, then broke the report
            # with a warning that named the report's directory, not this file).
            for column in NUMERIC_ROW_COLUMNS:
                value = row.get(column)
                if value is not None and not (is_finite_number(value) or (isinstance(value, float) and value != value)):
                    raise ValueError(f"last_search.{name}[{i}].{column}={value!r} must be a finite number, NaN "
                                     "or null")
    for name in ("space", "reason", "stop_reason"):
        if not isinstance(data.get(name, ""), str):
            raise ValueError(f"last_search.{name}={data[name]!r} must be a string")
    if data.get("num_candidates") is not None:
        _integer(data["num_candidates"], "num_candidates", 0)
    return data


class SearchCache:
    """One setup's dry-run results and its last completed search, in a JSON file at `path`."""

    def __init__(self, path: str, key: SetupKey) -> None:
        self.path, self.key = path, key
        self.results: Dict[str, Dict[str, Any]] = {}     # strategy JSON -> result_to_json + "measured_at"
        self.last_search: Optional[Dict[str, Any]] = None
        self.write_failed = False                         # set by the first save that failed

    @classmethod
    def load(cls, path: str, key: SetupKey) -> "SearchCache":
        """The cache at `path` for `key`; empty (with a warning naming the file) if it is unusable."""
        cache = cls(path, key)
        if not os.path.exists(path):
            return cache
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
                raise ValueError(f"not an {FORMAT} file of version {FORMAT_VERSION}")
            stored = SetupKey.from_json(data.get("setup"))
            raw = data.get("results") or {}
            if not isinstance(raw, dict):
                raise ValueError("'results' must be an object")
            for k, v in raw.items():
                result_from_json(v)          # every entry must parse, or none is trusted
            results = {str(k): dict(v) for k, v in raw.items()}
            last = _last_search(data.get("last_search"))
        # Whatever the file holds, reading it must not stop the search: RecursionError for absurdly
        # nested JSON, ValueError for everything the checks above refuse (and for bad UTF-8).
        except (OSError, ValueError, RecursionError) as e:
            logger.warning("ignoring the search cache %s: it could not be read (%s: %s); it will be replaced",
                           path, type(e).__name__, e)
            return cache
        if stored != key:
            logger.warning("ignoring the search cache %s: it was recorded for another setup (%s); it will be "
                           "replaced", path, "; ".join(key.differences(stored)))
            return cache
        cache.results, cache.last_search = results, last
        return cache

    def get(self, strategy: Strategy) -> Optional[DryRunResult]:
        key = _strategy_key(strategy)
        entry = self.results.get(key) if key is not None else None
        return result_from_json(entry) if entry is not None else None

    def put(self, strategy: Strategy, result: DryRunResult) -> None:
        key = _strategy_key(strategy)
        if key is not None:
            self.results[key] = {**result_to_json(result), "measured_at": time.time()}

    def record_search(self, best: Optional[Strategy], space_signature: str, trials: List[Dict[str, Any]],
                      pruned: List[Dict[str, Any]], reason: str, stop_reason: str, num_candidates: int) -> None:
        self.last_search = {"best": best.to_json() if best is not None else None, "space": space_signature,
                            "trials": trials, "pruned": pruned, "reason": reason, "stop_reason": stop_reason,
                            "num_candidates": num_candidates, "finished_at": time.time()}

    def cached_best(self, space_signature: str, candidates: Optional[Collection[Strategy]] = None
                    ) -> Optional[Strategy]:
        """The winner of the last completed search over the same space, if any (and, when
        `candidates` is given, only if it is one of them: a hand-edited file cannot smuggle in a
        strategy the space does not hold)."""
        last = self.last_search
        if not last or last.get("space") != space_signature or not last.get("best"):
            return None
        best = Strategy.from_json(last["best"])
        if candidates is not None and best not in candidates:
            logger.warning("ignoring the winner remembered in %s: %s is not a candidate of this search's space",
                           self.path, best.describe())
            return None
        why = _implausible_winner(best.describe(), last.get("trials") or [])
        if why:
            logger.warning("ignoring the winner remembered in %s: %s; searching again", self.path, why)
            return None
        return best

    def save(self) -> None:
        """Write atomically (a crash leaves the old file or the new one, never half of one).

        A write that fails (disk full, the directory removed or made read-only meanwhile) is warned
        about once and the search goes on without the cache: losing what it would remember must
        not cost the search itself."""
        if self.write_failed:
            return
        data = {"format": FORMAT, "version": FORMAT_VERSION, "setup": self.key.to_json(), "results": self.results,
                "last_search": self.last_search}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, allow_nan=True, default=str)
            os.replace(tmp, self.path)
        except OSError as e:
            self.write_failed = True
            logger.warning("could not write the search cache %s (%s: %s); the search goes on without remembering "
                           "its results", self.path, type(e).__name__, e)
            with contextlib.suppress(OSError):
                os.remove(tmp)


def _implausible_winner(best: str, trials: List[Dict[str, Any]]) -> str:
    """Why `best` (a strategy's description) cannot be the winner of the search whose trial table is
    `trials`, or "" when it can: another strategy's measured interval lies wholly above every one of
    `best`'s (a winner is the fastest, or within noise of it: `Comparison`). A cache whose rows are each
    valid but whose winner was swapped for a slower strategy was trusted and confirmed."""
    def bound(row: Dict[str, Any], side: str) -> float:
        value = finite_float(row.get(side))
        return value if value is not None else float(row["throughput"])

    ok = [r for r in trials if r.get("status") == "ok" and is_finite_number(r.get("throughput"))]
    own = [r for r in ok if r.get("strategy") == best]
    if not ok:
        return ""           # nothing measured to compare with (an older or trimmed table)
    if not own:
        return f"{best} has no successful dry run in the trial table of the search that chose it"
    best_hi = max(bound(r, "throughput_hi") for r in own)
    others = [r for r in ok if r.get("strategy") != best]
    faster = max(others, key=lambda r: bound(r, "throughput_lo"), default=None)
    if faster is not None and bound(faster, "throughput_lo") > best_hi:
        return (f"{best} is not the fastest of the search that chose it: {faster['strategy']} measured at least "
                f"{bound(faster, 'throughput_lo'):.4g} samples/s, above {best}'s {best_hi:.4g}")
    return ""


def space_signature(labels: List[str], memory_limit_bytes: Optional[int]) -> str:
    """Identifies a search's space and memory limit (a cached winner only stands for the same ones)."""
    text = json.dumps({"candidates": sorted(labels), "memory_limit_bytes": memory_limit_bytes})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _strategy_key(strategy: Strategy) -> Optional[str]:
    try:
        return Strategy.from_any(strategy).to_json()
    except ValueError:        # a config that is not JSON: measured, but not remembered
        return None
