"""What a search measured, remembered: a second search on the same setup needs one confirming dry run.

A setup is (model config hash, world size, device kind and name, library versions, global batch,
sequence length): `SetupKey`. The cache is one JSON file (never pickle: a results file must not
be able to run code) holding one setup's dry-run results, keyed by the strategy's JSON, and the
last completed search (its winner, trial table and reason). A file that cannot be read, is not
this format, or was recorded for another setup is ignored with a warning that names it, and is
replaced on the next save. Pure: no collectives and no training code; `auto_search` decides
when to read and write it (rank 0 only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from atorch.auto.devices import cpu_model_name
from atorch.auto.search.search import DryRunResult
from atorch.auto.strategy import Strategy

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

    def to_json(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SetupKey":
        return cls(str(data["model_hash"]), int(data["world_size"]), str(data["device"]),
                   tuple(sorted((str(k), str(v)) for k, v in dict(data["versions"]).items())),
                   int(data["global_batch"]), int(data["seq_len"]))

    def differences(self, cached: "SetupKey") -> List[str]:
        """What differs from `cached`, e.g. "world_size: cached 2, now 4"."""
        now, then = self.to_json(), cached.to_json()
        return [f"{k}: cached {then[k]!r}, now {now[k]!r}" for k in now if now[k] != then[k]]


def setup_key(model: torch.nn.Module, world_size: int, device: torch.device, global_batch: int,
              seq_len: int) -> SetupKey:
    return SetupKey(model_config_hash(model), int(world_size), device_description(device), library_versions(),
                    int(global_batch), int(seq_len))


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
    ci = data.get("throughput_ci")
    peak = data.get("peak_memory_bytes")
    return DryRunResult(float(data["throughput"]), int(peak) if peak is not None else None, data.get("error"),
                        data.get("step_time_s"), tuple(float(t) for t in data.get("step_times_s") or ()),
                        (float(ci[0]), float(ci[1])) if ci else None)


class SearchCache:
    """One setup's dry-run results and its last completed search, in a JSON file at `path`."""

    def __init__(self, path: str, key: SetupKey) -> None:
        self.path, self.key = path, key
        self.results: Dict[str, Dict[str, Any]] = {}     # strategy JSON -> result_to_json + "measured_at"
        self.last_search: Optional[Dict[str, Any]] = None

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
            stored = SetupKey.from_json(data["setup"])
            results = {str(k): dict(v) for k, v in dict(data.get("results") or {}).items()}
            for v in results.values():
                result_from_json(v)          # every entry must parse, or none is trusted
            last = data.get("last_search")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring the search cache %s: it could not be read (%s: %s); it will be replaced",
                           path, type(e).__name__, e)
            return cache
        if stored != key:
            logger.warning("ignoring the search cache %s: it was recorded for another setup (%s); it will be "
                           "replaced", path, "; ".join(key.differences(stored)))
            return cache
        cache.results, cache.last_search = results, last if isinstance(last, dict) else None
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

    def cached_best(self, space_signature: str) -> Optional[Strategy]:
        """The winner of the last completed search over the same space, if any."""
        last = self.last_search
        if not last or last.get("space") != space_signature or not last.get("best"):
            return None
        return Strategy.from_json(last["best"])

    def save(self) -> None:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        data = {"format": FORMAT, "version": FORMAT_VERSION, "setup": self.key.to_json(), "results": self.results,
                "last_search": self.last_search}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=True, default=str)
        os.replace(tmp, self.path)


def space_signature(labels: List[str], memory_limit_bytes: Optional[int]) -> str:
    """Identifies a search's space and memory limit (a cached winner only stands for the same ones)."""
    text = json.dumps({"candidates": sorted(labels), "memory_limit_bytes": memory_limit_bytes})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _strategy_key(strategy: Strategy) -> Optional[str]:
    try:
        return Strategy.from_any(strategy).to_json()
    except ValueError:        # a config that is not JSON: measured, but not remembered
        return None
