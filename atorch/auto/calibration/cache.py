"""The calibration cache: measured rates as JSON, one file per user (never pickle).

`$ATORCH_CALIBRATION_CACHE` or `~/.cache/atorch/calibration.json`, {"version", "entries": {device kind: ...}};
an unreadable, corrupt or other-version file is ignored with a warning naming it."""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
from typing import Any, Dict, Mapping

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
