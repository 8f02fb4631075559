"""Documents to preprocess, read lazily from .txt / .jsonl files, a directory of them, or a HF dataset.

Unusable lines (not JSON, missing key, not UTF-8, ...) are counted and kept with their line
numbers so the preprocessor can report them; with `strict=True` the first one raises instead.
A UTF-8 byte order mark at the start of a file is not part of its first line (as `utf-8-sig`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Sequence, Tuple, Union

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
# Only the first problems are kept verbatim; all of them are counted.
MAX_KEPT_PROBLEMS = 1000
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class LineProblem:
    """One input line (or dataset row) that produced no document."""

    source: str
    line: int
    """1-based line number in `source` (row index + 1 for a dataset)."""
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


class DocumentSource:
    """An iterable of documents (str) that also records the input it had to skip.

    Iterating again starts over and resets the record. `problems` keeps the first
    MAX_KEPT_PROBLEMS; `problem_count` counts all of them.
    """

    def __init__(self, name: str, read: Callable[["DocumentSource"], Iterator[str]], strict: bool = False) -> None:
        self.name = name
        self.strict = strict
        self.problems: List[LineProblem] = []
        self.problem_count = 0
        self._read = read

    def __iter__(self) -> Iterator[str]:
        self.problems, self.problem_count = [], 0
        return self._read(self)

    def report(self, source: str, line: int, reason: str) -> None:
        problem = LineProblem(source, line, reason)
        if self.strict:
            raise ValueError(f"{problem} (strict=True; pass strict=False to skip and count such lines)")
        self.problem_count += 1
        if len(self.problems) < MAX_KEPT_PROBLEMS:
            self.problems.append(problem)

    def __repr__(self) -> str:
        return f"DocumentSource({self.name!r}, strict={self.strict})"


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {str(path)!r} not found")


def _decode(source: DocumentSource, path: Path, number: int, raw: bytes) -> Union[str, None]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        source.report(str(path), number, f"not valid UTF-8 ({e.reason} at byte {e.start})")
        return None


def utf8_problem(text: str) -> Union[str, None]:
    """Why `text` cannot be encoded as UTF-8 (a lone surrogate, from a JSON escape like "\\ud800" or a
    `surrogateescape` decode), or None. The tokenizer would refuse the whole chunk holding it with a bare
    TypeError, so it is found here, where the file and line are known."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"text not encodable as UTF-8 ({e.reason} {text[e.start]!r} at character {e.start})"
    return None


def _strip_newline(raw: bytes) -> bytes:
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _raw_lines(path: Path) -> Iterator[Tuple[int, bytes]]:
    """(1-based number, bytes without the line ending) of each line. A UTF-8 byte order mark opening the
    file is dropped, as the `utf-8-sig` codec does: editors on Windows write one, and it would otherwise be
    the first character of a text file's first document, or make a JSON file's first line invalid JSON."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            yield number, _strip_newline(raw)


def _read_text(path: Path, source: DocumentSource) -> Iterator[str]:
    # Read bytes and decode line by line so a bad byte costs one line, with its number.
    for number, raw in _raw_lines(path):
        text = _decode(source, path, number, raw)
        if text is not None:
            yield text


def _json_array_error(path: Path, line: str) -> ValueError:
    return ValueError(f"corpus file {str(path)!r} holds a JSON array (its first line is {line.strip()[:40]!r}); "
                      "preprocessing reads JSON Lines, one object per line: convert it first, e.g. with "
                      "`jq -c '.[]' in.json > out.jsonl`")


def _read_jsonl(path: Path, json_key: str, source: DocumentSource) -> Iterator[str]:
    # A .json file holding one JSON array (pretty-printed or on one line) is refused rather than read: its
    # lines are not documents (each was skipped as "not JSON", losing the whole file but a warning), and
    # reading it as an array needs the whole file in memory (json.load) or a streaming parser this package
    # does not depend on, while preprocessing promises memory bounded by the chunks, not the corpus.
    first = True
    for number, raw in _raw_lines(path):
        line = _decode(source, path, number, raw)
        if line is None:
            continue
        if not line.strip():
            source.report(str(path), number, "empty line, expected a JSON object")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if first and line.lstrip().startswith("["):
                raise _json_array_error(path, line) from None
            source.report(str(path), number, f"not JSON ({e.msg} at column {e.colno})")
            first = False
            continue
        if first and isinstance(record, list) and record and all(isinstance(r, dict) for r in record):
            raise _json_array_error(path, line)
        first = False
        text = _field(record, json_key, source, str(path), number)
        if text is not None:
            yield text


def _field(record: Any, key: str, source: DocumentSource, name: str, number: int,
           is_json: bool = True) -> Union[str, None]:
    if not isinstance(record, dict):
        what = f"a JSON {type(record).__name__}" if is_json else f"row is {type(record).__name__}"
        source.report(name, number, f"{what}, expected {'an object' if is_json else 'a dict'} with key {key!r}")
        return None
    if key not in record:
        source.report(name, number, f"missing key {key!r} (keys: {sorted(record)[:10]})")
        return None
    return _text(record[key], key, source, name, number)


def _text(value: Any, key: str, source: DocumentSource, name: str, number: int) -> Union[str, None]:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        # Sentence-split text: the writer stores one sequence per document, so the sentences cannot be kept
        # apart, and which separator would rebuild the document is the user's call.
        source.report(name, number, f"value of {key!r} is a list of {len(value)} str (split sentences?); a document "
                                    f"is one str: join them first (a .jsonl file: `jq -c '.{key} |= join(\" \")'`)")
        return None
    if not isinstance(value, str):
        source.report(name, number, f"value of {key!r} is {type(value).__name__}, expected str")
        return None
    problem = utf8_problem(value)
    if problem is not None:
        source.report(name, number, problem)
        return None
    return value


def open_text(path: Union[str, os.PathLike], strict: bool = False) -> DocumentSource:
    """A plain text file, one document per line (the line ending is not part of the document)."""
    path = Path(path)
    _require_file(path)
    return DocumentSource(str(path), lambda source: _read_text(path, source), strict)


def open_jsonl(path: Union[str, os.PathLike], json_key: str = "text", strict: bool = False) -> DocumentSource:
    """A JSON-lines file; each line is an object whose `json_key` holds one document."""
    path = Path(path)
    _require_file(path)
    return DocumentSource(str(path), lambda source: _read_jsonl(path, json_key, source), strict)


def _kind(path: Path) -> Union[str, None]:
    """The reader `path` needs by its suffix, in any case (UPPER.TXT is a text file): "text", "jsonl" or None."""
    suffix = path.suffix.lower()
    return "text" if suffix in TEXT_SUFFIXES else "jsonl" if suffix in JSONL_SUFFIXES else None


def _directory_files(root: Path) -> List[Path]:
    """The corpus files under `root`: .txt/.jsonl/.json (any case), recursively, in sorted path order.
    Hidden files and everything under hidden folders (a name starting with '.': `.git`, editor swap and
    backup files) are skipped, as are other suffixes; a warning counts what was left out."""
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {str(root)!r} not found")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    visible = [p for p in files if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    usable = [p for p in visible if _kind(p) is not None]
    ignored, hidden = len(visible) - len(usable), len(files) - len(visible)
    if not usable:
        raise ValueError(f"corpus directory {str(root)!r} has no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files "
                         f"(found {ignored} other files{f' and {hidden} hidden ones' if hidden else ''})")
    left_out = [f"{ignored} files that are not {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}"] if ignored else []
    left_out += [f"{hidden} hidden files"] if hidden else []
    if left_out:
        logger.warning("%s: ignoring %s", root, " and ".join(left_out))
    return usable


def _read_files(files: Sequence[Path], json_key: str, source: DocumentSource) -> Iterator[str]:
    for p in files:
        if _kind(p) == "text":
            yield from _read_text(p, source)
        else:
            yield from _read_jsonl(p, json_key, source)


def open_directory(path: Union[str, os.PathLike], json_key: str = "text", strict: bool = False) -> DocumentSource:
    """Every .txt and .jsonl/.json file under `path` (suffixes in any case), recursively, in sorted path order.

    Hidden files and folders (names starting with '.') are skipped, as are files with other suffixes.
    """
    root = Path(path)
    usable = _directory_files(root)
    return DocumentSource(str(root), lambda source: _read_files(usable, json_key, source), strict)


def open_paths(paths: Sequence[Union[str, os.PathLike]], json_key: str = "text",
               strict: bool = False) -> DocumentSource:
    """Several files and directories read one after the other, in the order given (a directory as
    `open_directory` reads it). Every path is checked before anything is read."""
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise ValueError(f"paths={paths!r} must be a non-empty list of corpus files or directories")
    files: List[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            files.extend(_directory_files(given))
        else:
            _check_corpus_file(given)
            files.append(given)
    name = str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)"
    return DocumentSource(name, lambda source: _read_files(files, json_key, source), strict)


def _check_corpus_file(path: Path) -> None:
    """FileNotFoundError or ValueError (naming the suffixes read) unless `path` is a corpus file."""
    if _kind(path) is None:
        if not path.exists():
            raise FileNotFoundError(f"corpus {str(path)!r} not found")
        raise ValueError(f"corpus {str(path)!r} has suffix {path.suffix!r}; expected a directory or one of "
                         f"{list(TEXT_SUFFIXES + JSONL_SUFFIXES)}")
    _require_file(path)


def open_hf_dataset(dataset: Iterable[Any], text_key: str = "text", strict: bool = False,
                    batch_size: int = 1000) -> DocumentSource:
    """A Hugging Face `datasets.Dataset` / `IterableDataset` (or any iterable of dict rows).

    A map-style `Dataset` is read a column batch at a time (`dataset.iter(batch_size)`), which is
    far faster than row by row. A `DatasetDict` (or any mapping) is refused: pass one of its splits.
    """
    refuse_mapping(dataset, "dataset")
    info = getattr(dataset, "info", None)
    name = (info and getattr(info, "dataset_name", None)) or type(dataset).__name__
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and text_key not in columns:
        raise ValueError(f"dataset {name!r} has no column {text_key!r}; its columns are {columns}: name the text "
                         "column, e.g. preprocess(open_hf_dataset(dataset, text_key=...), ...)")

    def read(source: DocumentSource) -> Iterator[str]:
        if hasattr(dataset, "iter") and isinstance(columns, list):
            row = 0
            for batch in dataset.iter(batch_size=batch_size):
                for value in batch[text_key]:
                    row += 1
                    text = _text(value, text_key, source, name, row)
                    if text is not None:
                        yield text
            return
        for row, record in enumerate(dataset, start=1):
            text = _field(record, text_key, source, name, row, is_json=False)
            if text is not None:
                yield text

    return DocumentSource(name, read, strict)


def refuse_mapping(value: Any, argument: str) -> None:
    """TypeError naming `argument` when `value` is a mapping: iterating one yields its keys, so a `DatasetDict`
    would be read as its split names ('train') and a dict of columns as its column names ('text')."""
    if not isinstance(value, Mapping):
        return
    keys = list(value)
    if keys and all(is_hf_dataset(v) for v in value.values()):
        raise TypeError(f"{argument} is a {type(value).__name__} of splits {keys}; a mapping's keys would be read "
                        f"as the documents: pass one split, e.g. {argument}[{keys[0]!r}]")
    example = f", e.g. {argument}[{keys[0]!r}] if it holds the texts" if keys else ""
    raise TypeError(f"{argument} is a {type(value).__name__} with keys {keys[:10]}; a mapping's keys would be read "
                    f"as the documents: pass an iterable of str{example}, a corpus path, or a datasets.Dataset")


def is_hf_dataset(value: Any) -> bool:
    """Whether `value` is a Hugging Face `datasets.Dataset` or `IterableDataset` (whose rows are dicts).
    Without `datasets` imported no such object can exist, so this never imports it."""
    datasets = sys.modules.get("datasets")
    types = tuple(t for t in (getattr(datasets, "Dataset", None), getattr(datasets, "IterableDataset", None))
                  if isinstance(t, type))
    return bool(types) and isinstance(value, types)


def open_documents(documents: Iterable[Any], strict: bool = False) -> DocumentSource:
    """Any iterable of str, one document each. A str that cannot be encoded as UTF-8 is an unusable row
    (line = position + 1, as for a dataset); anything but a str is a TypeError (a bug, not bad data),
    and so is a mapping (whose keys iteration would yield)."""
    refuse_mapping(documents, "documents")
    name = type(documents).__name__

    def read(source: DocumentSource) -> Iterator[str]:
        for position, text in enumerate(documents):
            if not isinstance(text, str):
                hint = (": rows of a dataset? read them with open_hf_dataset(rows, text_key=...)"
                        if isinstance(text, Mapping) else "")
                raise TypeError(f"document {position} is {type(text).__name__}, expected str{hint}")
            problem = utf8_problem(text)
            if problem is None:
                yield text
            else:
                source.report(name, position + 1, f"document {position}: {problem}")

    return DocumentSource(name, read, strict)


def open_source(source: Any, json_key: str = "text", strict: bool = False) -> DocumentSource:
    """Pick the reader by what `source` is: .txt file, .jsonl/.json file (suffixes in any case), directory,
    or dataset (a mapping such as a `DatasetDict` is refused: pass one of its splits)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            return open_directory(path, json_key, strict)
        _check_corpus_file(path)
        return open_text(path, strict) if _kind(path) == "text" else open_jsonl(path, json_key, strict)
    refuse_mapping(source, "source")
    return open_hf_dataset(source, json_key, strict)
