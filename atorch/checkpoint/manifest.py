"""Crash-safe checkpoint directories: staging, checksummed manifest, atomic commit, `latest`, rotation.

A checkpoint directory exists under its final name only once it is complete: every file is
written into `<name>.tmp-<token>`, fsynced, listed with its size and checksum in
`manifest.json` (written last), and the directory is renamed atomically. Readers verify the
manifest before reading any other file, so a killed save, a truncated or edited file, or a
missing shard is refused with the file named, and nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
FORMAT_NAME = "atorch-checkpoint"
# Version 2 records each file's checksum under its algorithm's name ("xxh3_128" or "sha256");
# version 1 manifests (sha256 only) still read and verify.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
STAGING_MARK = ".tmp-"
_HASH_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not match the model; the message says which file."""


# Checksums a manifest may record, by name. xxh3_128 (the xxhash library) detects corruption
# (truncation, bit flips, edits) at memory speed; sha256 is there for users who want a
# cryptographic digest (and is what version 1 manifests hold).
SHA256 = "sha256"
XXH3_128 = "xxh3_128"
CHECKSUMS = (XXH3_128, SHA256)
DEFAULT_CHECKSUM = XXH3_128


def new_hasher(algorithm: str) -> Any:
    """A fresh incremental hasher (`update(bytes)`, `hexdigest()`) for `algorithm`."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"checksum={algorithm!r}; valid values are {list(CHECKSUMS)}")


def check_checksum(algorithm: str) -> None:
    """Raise ValueError (naming the valid values) for an unknown checksum algorithm."""
    if algorithm not in CHECKSUMS:
        raise ValueError(f"checksum={algorithm!r}; valid values are {list(CHECKSUMS)}")


@dataclass(frozen=True)
class FileRecord:
    """Size in bytes and hex checksum of one file of a checkpoint, with the checksum's algorithm."""

    size: int
    digest: str
    algorithm: str = SHA256

    @property
    def sha256(self) -> str:
        """The sha256 digest (only for records made with sha256; kept for version 1 callers)."""
        if self.algorithm != SHA256:
            raise AttributeError(f"this record holds a {self.algorithm} checksum, not sha256")
        return self.digest


@dataclass
class Manifest:
    """The list of a checkpoint's files with their sizes and checksums, plus a short summary."""

    files: Dict[str, FileRecord]
    step: Optional[int] = None
    created: float = field(default_factory=time.time)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "version": self.version, "step": self.step, "created": self.created,
            "files": {name: {"size": r.size, r.algorithm: r.digest} for name, r in sorted(self.files.items())},
        }, indent=1)

    @classmethod
    def read(cls, ckpt_dir: str) -> "Manifest":
        """Parse `<ckpt_dir>/manifest.json`, refusing anything that is not an atorch manifest."""
        path = os.path.join(ckpt_dir, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise CheckpointError(_not_a_checkpoint_message(ckpt_dir))
        try:
            with open(path, "r", encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: manifest is not valid JSON ({e}); the checkpoint is corrupted") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path}: format is {raw.get('format') if isinstance(raw, dict) else raw!r}, "
                                  f"expected {FORMAT_NAME!r}: not an atorch checkpoint")
        if raw.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{path}: format version {raw.get('version')!r}; this atorch reads versions "
                                  f"{list(READABLE_VERSIONS)}")
        files: Dict[str, FileRecord] = {}
        for name, rec in (raw.get("files") or {}).items():
            _check_relative(name, path)
            algorithms = [a for a in CHECKSUMS if isinstance(rec, dict) and a in rec]
            try:
                if len(algorithms) != 1:
                    raise KeyError("checksum")
                files[name] = FileRecord(int(rec["size"]), str(rec[algorithms[0]]), algorithms[0])
            except (KeyError, TypeError, ValueError) as e:
                shown = repr(rec)
                shown = shown if len(shown) <= 200 else shown[:197] + "..."
                raise CheckpointError(f"{path}: entry {name!r} must have an integer size and one checksum "
                                      f"(one of {list(CHECKSUMS)}); it holds {shown}") from e
        return cls(files=files, step=raw.get("step"), created=float(raw.get("created") or 0.0))


def _check_relative(name: str, where: str) -> None:
    # A manifest names files inside its own directory only; anything else is a tampered manifest.
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm != name.replace("/", os.sep):
        raise CheckpointError(f"{where}: file name {name!r} is not a plain relative path inside the checkpoint")


def _not_a_checkpoint_message(path: str) -> str:
    if not os.path.exists(path):
        return f"{path}: no such checkpoint directory"
    if not os.path.isdir(path):
        return f"{path}: not a directory, so not a checkpoint"
    if STAGING_MARK in os.path.basename(os.path.normpath(path)):
        return (f"{path}: an incomplete checkpoint (a save that did not finish leaves a '{STAGING_MARK}' "
                "directory); load the previous one or the parent directory's 'latest'")
    return f"{path}: not a checkpoint (no {MANIFEST_NAME}; a checkpoint directory is complete only once it has one)"


# -- hashing and durable writes ---------------------------------------------------------

def sha256_file(path: str) -> str:
    return checksum_file(path, SHA256)


def checksum_file(path: str, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """Hex checksum of the file at `path` with `algorithm`.

    The file is memory-mapped and hashed in 8 MiB slices of the mapping: the hasher reads the
    page cache's pages in place, about 3x faster than `read()` into a buffer (a copy per chunk).
    """
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, size, _HASH_CHUNK):
                    h.update(view[start:start + _HASH_CHUNK])
                    release_pages(mapped, start, min(_HASH_CHUNK, size - start))
            finally:
                view.release()
    return h.hexdigest()


def release_pages(mapped: mmap.mmap, offset: int, length: int) -> None:
    """Unmap the pages of `mapped` covering [offset, offset + length) (the page cache keeps them).

    A read-only file mapping's pages count in the process's RSS once touched; dropping the ones
    already used keeps a pass over a large file from raising the RSS by the file's size. The
    range is widened to whole pages; a page shared with a later use is simply faulted in again.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or length <= 0:
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(len(mapped), offset + length)
    try:
        mapped.madvise(advice, start, end - start)
    except (OSError, ValueError):
        pass  # only an RSS optimization


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or file creation inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def record_files(root: str, names: Iterable[str], algorithm: str = DEFAULT_CHECKSUM) -> Dict[str, FileRecord]:
    """Size and checksum of each file, fsynced on the way (the data must be durable before the manifest)."""
    check_checksum(algorithm)
    out: Dict[str, FileRecord] = {}
    for name in names:
        path = os.path.join(root, name)
        fsync_file(path)
        out[name] = FileRecord(os.path.getsize(path), checksum_file(path, algorithm), algorithm)
    return out


def list_files(root: str) -> List[str]:
    """Every regular file under `root`, as sorted '/'-separated relative paths."""
    out = []
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file, fsync and rename: readers see old or new, never half."""
    tmp = f"{path}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# -- verification -----------------------------------------------------------------------

def verify_files(ckpt_dir: str, manifest: Manifest, names: Sequence[str]) -> List[str]:
    """Problems with `names` (missing, truncated/extended, checksum mismatch), one message per file."""
    problems = []
    for name in names:
        rec = manifest.files[name]
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the manifest lists it with {rec.size} bytes)")
            continue
        size = os.path.getsize(path)
        if size != rec.size:
            what = "truncated" if size < rec.size else "larger than written"
            problems.append(f"{path}: {what}: {size} bytes, the manifest says {rec.size}")
            continue
        digest = checksum_file(path, rec.algorithm)
        if digest != rec.digest:
            problems.append(f"{path}: checksum mismatch: {rec.algorithm} {digest[:16]}..., the manifest says "
                            f"{rec.digest[:16]}... (the file was modified or corrupted after the save)")
    return problems


def raise_problems(ckpt_dir: str, problems: Sequence[str]) -> None:
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} failed verification, nothing was loaded:\n  "
                              + "\n  ".join(problems))


# -- locating checkpoints ---------------------------------------------------------------

def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def check_dir_arg(func: str, name: str, value: Any) -> None:
    """Raise TypeError, naming `func`, the argument and the value's type, unless `value` can be a path.

    Pure and cheap: entry points call it on every rank before any collective.
    """
    if not isinstance(value, (str, os.PathLike)):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise TypeError(f"{func}: {name}={shown} ({type(value).__name__}) must be a str or os.PathLike")


def checkpoint_use(path: str) -> Optional[str]:
    """Why files written into the directory `path` would land in checkpoints' space, or None.

    Recognizes what save and rotation treat as theirs: a checkpoint (a directory holding
    `manifest.json`) or a directory inside one, and a checkpoint root (a directory holding the
    `latest` pointer or complete checkpoints). Symlinks and relative paths are resolved first.
    """
    real = os.path.realpath(path)
    if is_checkpoint(real):
        return f"is a checkpoint (it holds {MANIFEST_NAME})"
    enclosing = enclosing_checkpoint(real)
    if enclosing is not None:
        return f"is inside the checkpoint {enclosing} (it holds {MANIFEST_NAME})"
    if os.path.isfile(os.path.join(real, LATEST_NAME)):
        return f"is a checkpoint root (it holds the {LATEST_NAME!r} pointer)"
    held = sorted(os.path.basename(p) for p, _ in list_checkpoints(real))
    if held:
        return f"is a checkpoint root (it holds the checkpoints {held[:3]}{' ...' if len(held) > 3 else ''})"
    return None


def enclosing_checkpoint(path: str) -> Optional[str]:
    """The checkpoint `path` lies inside (its nearest ancestor holding `manifest.json`, symlinks resolved), or None.

    `path` itself does not count: a checkpoint is not inside itself. Files written under a checkpoint are
    not in its manifest, so it would no longer verify; save and merge refuse such a directory.
    """
    real = os.path.realpath(path)
    ancestor = os.path.dirname(real)
    while True:
        if is_checkpoint(ancestor):
            return ancestor
        parent = os.path.dirname(ancestor)
        if parent == ancestor:
            return None
        ancestor = parent


def resolve_checkpoint_dir(path: str) -> str:
    """`path` itself when it is a checkpoint, else the checkpoint its `latest` pointer names."""
    path = os.path.normpath(path)
    if is_checkpoint(path):
        return path
    latest = read_latest(path)
    if latest is not None:
        return latest
    raise CheckpointError(_not_a_checkpoint_message(path))


def checkpoint_name(path: str) -> str:
    """`resolve_checkpoint_dir(path)` relative to `path`: "." for a checkpoint, else the name its `latest` holds.

    Relative, so that another process can find the same checkpoint under its own spelling of `path`
    (nodes may mount the filesystem at different places): `checkpoint_at(path, name)`.
    """
    path = os.path.normpath(path)
    return os.path.relpath(resolve_checkpoint_dir(path), path)


def checkpoint_at(path: str, name: str) -> str:
    """`<path>/<name>` for a `checkpoint_name` another process resolved; CheckpointError unless it is a complete
    checkpoint in this process's view of the filesystem."""
    _check_relative(name, f"the checkpoint name resolved from {path!r}")
    ckpt_dir = os.path.normpath(os.path.join(path, name))
    if not is_checkpoint(ckpt_dir):
        raise CheckpointError(f"{path!r} resolved to {name!r} on rank 0, which is not a complete checkpoint here "
                              f"({_not_a_checkpoint_message(ckpt_dir)}); every rank must see the same filesystem")
    return ckpt_dir


def read_latest(parent: str) -> Optional[str]:
    """The complete checkpoint named by `<parent>/latest`, or None when there is no usable pointer."""
    pointer = os.path.join(parent, LATEST_NAME)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, "r", encoding="utf-8") as f:
        name = f.read().strip()
    if not name:
        return None
    _check_relative(name, pointer)
    target = os.path.join(parent, name)
    if not is_checkpoint(target):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint "
                              f"({_not_a_checkpoint_message(target)})")
    return target


def write_latest(parent: str, name: str) -> None:
    write_text_atomic(os.path.join(parent, LATEST_NAME), name + "\n")


def list_checkpoints(parent: str) -> List[Tuple[str, Manifest]]:
    """Complete atorch checkpoints directly under `parent`, oldest first (by step, then creation time)."""
    found: List[Tuple[str, Manifest]] = []
    if not os.path.isdir(parent):
        return found
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if STAGING_MARK in name or not is_checkpoint(path):
            continue
        try:
            manifest = Manifest.read(path)
        except CheckpointError:
            continue  # someone else's directory with a manifest.json: never ours to rotate
        found.append((path, manifest))
    found.sort(key=lambda pm: (pm[1].step if pm[1].step is not None else -1, pm[1].created))
    return found


# -- the commit protocol ----------------------------------------------------------------

def staging_dir(final_dir: str, token: str) -> str:
    return f"{os.path.normpath(final_dir)}{STAGING_MARK}{token}"


def remove_stale_staging(final_dir: str) -> List[str]:
    """Delete the `<name>.tmp-*` directories left by killed saves of this same checkpoint name."""
    final_dir = os.path.normpath(final_dir)
    parent, name = os.path.split(final_dir)
    removed: List[str] = []
    if not os.path.isdir(parent or "."):
        return removed
    for entry in os.listdir(parent or "."):
        path = os.path.join(parent, entry)
        if entry.startswith(name + STAGING_MARK) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def commit(staging: str, final_dir: str, manifest: Manifest) -> None:
    """Write the manifest last, then atomically publish `staging` as `final_dir` (replacing an old one)."""
    write_text_atomic(os.path.join(staging, MANIFEST_NAME), manifest.to_json())
    for dirpath, dirnames, _ in os.walk(staging):
        for d in dirnames:
            fsync_dir(os.path.join(dirpath, d))
    fsync_dir(staging)
    final_dir = os.path.normpath(final_dir)
    parent = os.path.dirname(os.path.abspath(final_dir))
    old = None
    if os.path.exists(final_dir):
        # rename() cannot replace a non-empty directory: move the old one aside first; until the
        # second rename the old checkpoint stays complete under its aside name.
        old = f"{final_dir}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final_dir, old)
    os.rename(staging, final_dir)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def rotate(parent: str, keep_last: int, protect: Sequence[str] = ()) -> List[str]:
    """Delete the least recently saved complete checkpoints under `parent` so that `keep_last` remain; never
    `protect` or the one `latest` names (so more than `keep_last` may remain).

    "Recently saved" is the manifest's `created` (the commit time), not the step: a run restarted from an
    earlier checkpoint saves lower steps than the abandoned run left behind, and ordering by step would
    delete the restarted run's own new checkpoints while keeping the abandoned ones.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}; it must be >= 1 (or None to keep every checkpoint)")
    protected = {os.path.normpath(os.path.abspath(p)) for p in protect}
    try:
        latest = read_latest(parent)
    except CheckpointError:
        latest = None  # a dangling pointer protects nothing
    if latest is not None:
        protected.add(os.path.normpath(os.path.abspath(latest)))
    # Oldest commit first; equal times (a coarse clock) fall back to the step.
    checkpoints = sorted(list_checkpoints(parent),
                         key=lambda pm: (pm[1].created, pm[1].step if pm[1].step is not None else -1))
    removable = [p for p, _ in checkpoints[:max(0, len(checkpoints) - keep_last)]
                 if os.path.normpath(os.path.abspath(p)) not in protected]
    for path in removable:
        # Remove the manifest first: an interrupted rotation leaves a non-checkpoint, never a broken one.
        os.remove(os.path.join(path, MANIFEST_NAME))
        shutil.rmtree(path, ignore_errors=True)
    return removable


def read_json(ckpt_dir: str, name: str) -> Any:
    """A JSON file of a (verified) checkpoint, with the file named in any error."""
    path = os.path.join(ckpt_dir, name)
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
