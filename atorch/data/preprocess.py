"""Tokenize a corpus into Megatron-LM `.bin` + `.idx` files, in parallel and in bounded memory.

Documents are read lazily, tokenized in chunks (in this process for one worker, else by a process
pool, results kept in corpus order) and written as they arrive, so memory depends on
`workers * chunk_size`, not on the corpus size.

One worker is one process on purpose: the tokenizer's native call is ~94% of its CPU (reading and
JSON ~1%, packing ids ~5%), so a tokenizing thread overlapped with the rest cost 2-3% more CPU per
token and gained no wall time (benchmarks/RESULTS.md, "After the workers=1 change (session 4)").

From the command line (`main`; `python -m atorch.data.preprocess` runs the same):

    atorch preprocess --input web.jsonl more/ --output-prefix data/web --tokenizer tok/ --workers 8
"""

from __future__ import annotations

import argparse
import collections
import itertools
import logging
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from atorch.data import sources
from atorch.data.indexed_dataset import (
    BINARIZATION_IMPLS,
    IndexedDatasetWriter,
    best_fitting_dtype,
    check_token_id,
    data_path,
    index_path,
    strip_suffix,
)
from atorch.data.sources import DocumentSource, LineProblem

logger = logging.getLogger(__name__)

# Chunks in flight per worker: enough to keep every worker busy while the parent writes.
_INFLIGHT_PER_WORKER = 4

Chunk = Tuple[np.ndarray, np.ndarray, int]
"""A chunk's flat token array, per-document sizes and number of texts that tokenized to nothing."""


@dataclass
class PreprocessStats:
    """What `DatasetPreprocessor.preprocess` wrote and skipped."""

    data_file: str
    index_file: str
    documents: int
    """Documents written (one sequence each)."""
    tokens: int
    """Tokens written, EOD tokens included."""
    empty_documents: int
    """Documents that tokenized to nothing; not written."""
    skipped_lines: int
    """Input lines or rows that held no usable document (bad JSON, missing key, ...)."""
    problems: List[LineProblem] = field(default_factory=list)
    """The first skipped lines, with file and line number."""
    seconds: float = 0.0

    @property
    def documents_per_second(self) -> float:
        return self.documents / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class _ChunkEncoder:
    """Turns a list of texts into (flat token array, per-document sizes, number of empty texts).

    Picklable, so it can travel to worker processes.
    """

    def __init__(self, tokenizer: Any, dtype: np.dtype, vocab_size: int, eod_token_id: Optional[int]) -> None:
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.eod_token_id = eod_token_id

    def _token_ids(self, texts: List[str]) -> List[List[int]]:
        # The Rust tokenizer's batch call skips the Python-side BatchEncoding: ~20% faster than __call__.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None and hasattr(self.tokenizer, "encode_batch"):
            backend = self.tokenizer
        if backend is not None:
            # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which only an aligner needs:
            # same ids, ~18% less worker CPU per token, and in workers that CPU is the whole critical path.
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    def pack(self, ids: List[List[int]]) -> Chunk:
        """One chunk's token ids (a list per text, in order) as a `Chunk`; checks the vocabulary range."""
        n_texts = len(ids)
        ids = [doc for doc in ids if doc]
        empty = n_texts - len(ids)
        if self.eod_token_id is not None:
            for doc in ids:
                doc.append(self.eod_token_id)
        sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(sizes.sum()))
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = int(flat.max()) if flat.max() >= self.vocab_size else int(flat.min())
            raise ValueError(f"tokenizer produced token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return flat.astype(self.dtype), sizes.astype(np.int32), empty

    def __call__(self, texts: List[str]) -> Chunk:
        return self.pack(self._token_ids(texts))


_worker_encoder: Optional[_ChunkEncoder] = None


def _init_worker(encoder: _ChunkEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder
    # Parallelism comes from the processes; Rust threads on top would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_in_worker(texts: List[str]) -> Chunk:
    assert _worker_encoder is not None, "worker initializer did not run"
    return _worker_encoder(texts)


def _is_local_path(name: Union[str, os.PathLike]) -> bool:
    """A filesystem path rather than a Hub id ('gpt2', 'org/model'): a PathLike, or absolute, or relative to
    '.'/'~', or with more than one separator."""
    text = os.fspath(name)
    return not isinstance(name, str) or os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1


def _load_tokenizer_directory(directory: str) -> Any:
    """`AutoTokenizer.from_pretrained(directory)`, with errors that name the directory and its tokenizer files.

    A directory without tokenizer files (a model's weights only, a wrong path) made transformers fail with
    "Couldn't instantiate the backend tokenizer ... You need to have sentencepiece or tiktoken installed",
    which sends the user to install packages instead of to the path. The files are those `atorch merge
    --tokenizer` copies (`atorch.checkpoint.tokenizer_files`), so both commands accept the same directories.
    """
    from transformers import AutoTokenizer

    from atorch.checkpoint.tokenizer_files import TOKENIZER_FILES, tokenizer_files_in

    found = tokenizer_files_in(directory)
    if not found:
        names = sorted(os.listdir(directory))
        holds = f"it holds {names[:8]}{' ...' if len(names) > 8 else ''}" if names else "it is empty"
        raise ValueError(f"tokenizer directory {directory} has none of the tokenizer files {list(TOKENIZER_FILES)} "
                         f"({holds}); pass the directory a tokenizer was saved to (tokenizer.save_pretrained(DIR)), "
                         "or a model directory that includes its tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from directory {directory} (its tokenizer files: {found}): "
                         f"{e}") from e
    size = vocab_size_of(tokenizer)
    if not set(found) & set(VOCABULARY_FILES) and size < BYTE_VOCABULARY:
        # transformers 5 builds an empty tokenizer of the configured class from tokenizer_config.json alone (a
        # LlamaTokenizer of 3 tokens): every document would become unknown tokens. Byte- and character-level
        # tokenizers (ByT5, Canine) need no vocabulary file and know at least the 256 bytes.
        raise ValueError(f"tokenizer directory {directory} holds no vocabulary ({found}, none of "
                         f"{list(VOCABULARY_FILES)}): the {type(tokenizer).__name__} transformers built from it knows "
                         f"{size} tokens. Pass the directory the tokenizer was saved to in full "
                         "(tokenizer.save_pretrained(DIR))")
    return tokenizer


# Files that hold a tokenizer's vocabulary (the others: its settings, special tokens, chat template).
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
# The smallest vocabulary of a tokenizer that needs no vocabulary file: the 256 byte values.
BYTE_VOCABULARY = 256


def vocab_size_of(tokenizer: Any) -> int:
    """Number of token ids a tokenizer can produce, added tokens included."""
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    try:
        return len(tokenizer)
    except TypeError:
        pass
    try:
        return int(tokenizer.vocab_size)
    except AttributeError:
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer, a tokenizers.Tokenizer or a directory, got "
                        f"{type(tokenizer).__name__} {tokenizer!r:.80}") from None


class DatasetPreprocessor:
    """Tokenizes documents into `<save_file_name>.bin` + `.idx` (Megatron-LM layouts).

    Args:
        tokenizer: a Hugging Face tokenizer, a `tokenizers.Tokenizer`, or a path to load with
            `AutoTokenizer.from_pretrained` (a directory without tokenizer files is a ValueError naming it).
            Special tokens (BOS, ...) are not added.
        chunk_size: documents per task sent to a worker.
        binarization_impl: "mmap" (default), "lazy" or "cached"; see `atorch.data.indexed_dataset`.
        append_eod: append `eod_token_id` to every document, so concatenated documents stay separated.
        eod_token_id: defaults to the tokenizer's `eos_token_id`.
        workers: tokenizing processes; 1 tokenizes in this process, more use a process pool.
        strict: make the first unusable input line an error instead of a counted skip.

    The token dtype is the smallest that fits the vocabulary (uint16 below 65500 ids, else int32).
    """

    def __init__(self, tokenizer: Any, chunk_size: int = 512, binarization_impl: str = "mmap",
                 append_eod: bool = True, eod_token_id: Optional[int] = None, workers: int = 1,
                 strict: bool = False) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            if _is_local_path(tokenizer) and not os.path.isdir(tokenizer):
                # transformers would read it as a Hub repository id and fail with "Repo id must be in the form ...".
                raise FileNotFoundError(f"tokenizer={os.fspath(tokenizer)!r} is not a directory; pass a tokenizer "
                                        "object or a directory written by save_pretrained")
            if os.path.isdir(tokenizer):
                tokenizer = _load_tokenizer_directory(os.fspath(tokenizer))
            else:
                tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        if binarization_impl not in BINARIZATION_IMPLS:
            raise ValueError(f"binarization_impl={binarization_impl!r} is not supported; choose one of "
                             f"{list(BINARIZATION_IMPLS)}")
        for name, value in (("chunk_size", chunk_size), ("workers", workers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.vocab_size = vocab_size_of(tokenizer)
        if append_eod:
            if eod_token_id is None:
                eod_token_id = getattr(tokenizer, "eos_token_id", None)
            if eod_token_id is None:
                raise ValueError("append_eod=True but eod_token_id is None and the tokenizer has no eos_token_id; "
                                 "pass eod_token_id or append_eod=False")
            # A float or bool would be written as int(value): 1.5 -> 1, 844.9 -> another real token.
            eod_token_id = check_token_id("eod_token_id", eod_token_id)
            if not eod_token_id < self.vocab_size:
                raise ValueError(f"eod_token_id={eod_token_id} is outside the vocabulary [0, {self.vocab_size})")
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.binarization_impl = binarization_impl
        self.append_eod = append_eod
        self.eod_token_id = eod_token_id if append_eod else None
        self.workers = workers
        self.strict = strict
        self.dtype = best_fitting_dtype(self.vocab_size)

    # Inputs -----------------------------------------------------------------------------------

    def open_jsonl(self, path: Union[str, os.PathLike], json_key: str = "text",
                   strict: Optional[bool] = None) -> DocumentSource:
        return sources.open_jsonl(path, json_key, self.strict if strict is None else strict)

    def open_text(self, path: Union[str, os.PathLike], strict: Optional[bool] = None) -> DocumentSource:
        return sources.open_text(path, self.strict if strict is None else strict)

    def open_directory(self, path: Union[str, os.PathLike], json_key: str = "text",
                       strict: Optional[bool] = None) -> DocumentSource:
        return sources.open_directory(path, json_key, self.strict if strict is None else strict)

    def open_hf_dataset(self, dataset: Iterable[Any], text_key: str = "text",
                        strict: Optional[bool] = None) -> DocumentSource:
        return sources.open_hf_dataset(dataset, text_key, self.strict if strict is None else strict)

    def open(self, source: Any, json_key: str = "text", strict: Optional[bool] = None) -> DocumentSource:
        """A .txt or .jsonl file, a directory of them, or a HF dataset, chosen by what `source` is."""
        return sources.open_source(source, json_key, self.strict if strict is None else strict)

    # Work -------------------------------------------------------------------------------------

    def preprocess(self, documents: Union[Iterable[str], str, os.PathLike], save_file_name: Union[str, os.PathLike],
                   log_interval: int = 10000, progress_enabled: bool = True) -> PreprocessStats:
        """Tokenize `documents` into `<save_file_name>.bin` and `.idx`; return what was written.

        `documents` is any iterable of str (one document each), a path given to `open`, a
        `DocumentSource`, or a Hugging Face `datasets.Dataset`/`IterableDataset`, read by its "text"
        column (another column: `open_hf_dataset(ds, text_key=...)`). A mapping is refused with a
        TypeError: iterating a `DatasetDict` yields its split names, so pass one split (`dd["train"]`).
        Nothing appears under the final names unless the whole corpus succeeds. Raises
        ValueError for a corpus without any non-empty document. A document that cannot be
        encoded as UTF-8 (a lone surrogate) is skipped and counted like a bad input line, or
        raises with `strict=True`.
        """
        if isinstance(documents, (str, os.PathLike)):
            documents = self.open(documents)
        elif sources.is_hf_dataset(documents):
            documents = self.open_hf_dataset(documents)
        elif not isinstance(documents, DocumentSource):
            # Checks each document (a str, encodable as UTF-8) and counts the unusable ones like a file's lines.
            documents = sources.open_documents(documents, self.strict)
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        prefix = strip_suffix(save_file_name)
        name = documents.name
        writer = IndexedDatasetWriter(prefix, self.dtype, self.binarization_impl)
        encoder = _ChunkEncoder(self.tokenizer, self.dtype, self.vocab_size, self.eod_token_id)
        progress = _Progress(log_interval, progress_enabled, desc=Path(prefix).name)
        empty = 0
        start = time.perf_counter()
        encoded = self._encode_chunks(encoder, _chunks(documents, self.chunk_size))
        try:
            for flat, sizes, n_empty in encoded:
                writer.add_sequences(flat, sizes)
                empty += n_empty
                progress.update(sizes.size + n_empty, flat.size)
            if writer.num_sequences == 0:
                problems, skipped = documents.problems, documents.problem_count
                first = f", first: {'; '.join(map(str, problems[:3]))}" if problems else ""
                raise ValueError(f"corpus {name!r} has no non-empty document ({empty} empty documents, "
                                 f"{skipped} unusable lines{first}); nothing written to {prefix}.bin/.idx")
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
        finally:
            encoded.close()  # type: ignore[attr-defined]  # a generator: close() stops the worker pool now, also on error
            progress.close()
        stats = PreprocessStats(str(data_path(prefix)), str(index_path(prefix)), writer.num_sequences,
                                writer.num_tokens, empty, 0, seconds=time.perf_counter() - start)
        stats.skipped_lines, stats.problems = documents.problem_count, list(documents.problems)
        if stats.skipped_lines:
            shown = "; ".join(map(str, stats.problems[:10]))
            logger.warning("%s: skipped %d unusable lines (first: %s)", name, stats.skipped_lines, shown)
        logger.info("wrote %d documents, %d tokens to %s in %.1f s (%.0f docs/s, %.0f tokens/s)", stats.documents,
                    stats.tokens, stats.data_file, stats.seconds, stats.documents_per_second,
                    stats.tokens_per_second)
        return stats

    def _encode_chunks(self, encoder: _ChunkEncoder, chunks: Iterator[List[str]]) -> Iterator[Chunk]:
        if self.workers == 1:
            yield from map(encoder, chunks)
        else:
            yield from _encode_in_pool(encoder, chunks, self.workers)


def _encode_in_pool(encoder: _ChunkEncoder, chunks: Iterator[List[str]], workers: int) -> Iterator[Chunk]:
    """`workers` processes tokenize and pack whole chunks; results come back in corpus order.

    A process pool executor rather than multiprocessing.Pool: when a worker dies (killed, out of
    memory) every pending result raises BrokenProcessPool, where Pool would wait forever.
    """
    # Fork shares the loaded tokenizer without pickling or re-importing torch in each worker.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(method), initializer=_init_worker,
                               initargs=(encoder,))
    pending: Deque[Future] = collections.deque()
    try:
        # A bounded window of submitted chunks instead of map(): the executor's map submits its whole
        # input at once, which would hold the corpus in memory.
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= _INFLIGHT_PER_WORKER * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # On an error or an early close: drop the queued chunks, wait only for those being encoded.
        pool.shutdown(wait=True, cancel_futures=True)


def _chunks(documents: Iterable[str], chunk_size: int) -> Iterator[List[str]]:
    chunk: List[str] = []
    for position, text in enumerate(documents):
        if not isinstance(text, str):  # a DocumentSource built by hand: its reader may yield anything
            raise TypeError(f"document {position} is {type(text).__name__}, expected str")
        chunk.append(text)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Progress:
    """tqdm bar with docs/s and tokens/s, or log lines every `log_interval` documents without it."""

    def __init__(self, log_interval: int, enabled: bool, desc: str) -> None:
        self.log_interval = log_interval
        self.enabled = enabled
        self.documents = self.tokens = 0
        self.next_report = log_interval
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=desc, unit=" docs", dynamic_ncols=True)

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(documents)
        if self.documents >= self.next_report:
            self.next_report = (self.documents // self.log_interval + 1) * self.log_interval
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            rates = {"docs/s": f"{self.documents / elapsed:,.0f}", "tokens/s": f"{self.tokens / elapsed:,.0f}"}
            if self.bar is not None:
                self.bar.set_postfix(rates, refresh=False)
            else:
                logger.info("%d documents, %d tokens (%s docs/s, %s tokens/s)", self.documents, self.tokens,
                            rates["docs/s"], rates["tokens/s"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Tokenize corpus files into Megatron-LM .bin/.idx files (DatasetPreprocessor). Text files hold one "
        "document per line; JSON Lines files one object per line, the document under --json-key. Unusable lines "
        "are counted and reported (--strict: the first one is an error)."))
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="corpus files (.txt, .jsonl, .json) and directories of them (read recursively, hidden "
                             "files skipped), in the order given")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory (AutoTokenizer.from_pretrained)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument("--chunk-size", type=int, default=512, help="documents per task sent to a worker")
    parser.add_argument("--json-key", default="text", help="the key holding the document in JSON lines")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="append the end-of-document token to every document (default: yes)")
    parser.add_argument("--eod-token-id", type=int, default=None, help="default: the tokenizer's eos_token_id")
    parser.add_argument("--dataset-impl", choices=BINARIZATION_IMPLS, default="mmap",
                        help="index layout (token dtype: the smallest that fits the vocabulary)")
    parser.add_argument("--strict", action="store_true", help="stop at the first unusable input line")
    parser.add_argument("--log-interval", type=int, default=10000, help="documents between progress reports")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "atorch preprocess") -> int:
    """The preprocessing command: parse `argv`, tokenize, print what was written. A bad argument or input
    exits with status 2 and the reason (argparse's usage error); nothing is written then."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        preprocessor = DatasetPreprocessor(args.tokenizer, chunk_size=args.chunk_size,
                                           binarization_impl=args.dataset_impl, append_eod=args.append_eod,
                                           eod_token_id=args.eod_token_id, workers=args.workers, strict=args.strict)
        documents = sources.open_paths(args.input, args.json_key, args.strict)
        stats = preprocessor.preprocess(documents, args.output_prefix, log_interval=args.log_interval,
                                        progress_enabled=sys.stderr.isatty())
    except (ValueError, TypeError, OSError) as e:
        parser.error(str(e))
    skipped = f", skipped {stats.skipped_lines} unusable lines" if stats.skipped_lines else ""
    print(f"wrote {stats.documents} documents, {stats.tokens} tokens to {stats.data_file} and {stats.index_file} "
          f"({stats.empty_documents} empty documents{skipped})")
    return 0


if __name__ == "__main__":
    # The module's own `main`, not this __main__ copy's: its classes are the ones worker processes unpickle.
    from atorch.data.preprocess import main as _main

    sys.exit(_main(prog="python -m atorch.data.preprocess"))
