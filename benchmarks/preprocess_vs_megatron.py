"""atorch's data tools against megatron-core's, side by side: preprocessing and random sample reads.

    .venv/bin/python benchmarks/preprocess_vs_megatron.py [--sizes-mb 16 48] [--repeats 2] [--workers 1 2]

What runs:
- Corpus: JSON lines generated from the bundled corpus (`benchmarks/preprocess.py`'s generator) in a
  temp directory, one file per size; never committed.
- atorch: `DatasetPreprocessor(workers=w).preprocess(corpus, out)` with the bundled tokenizer.
- Megatron: the flow of Megatron-LM's `tools/preprocess_data.py` (which megatron-core's wheel does
  not ship), driven here with megatron-core's own `IndexedDatasetBuilder`: a `multiprocessing.Pool`
  of `w` workers, `pool.imap(encode, input_file, 32)`, each worker `json.loads` a line and tokenizes
  it, the parent calls `builder.add_document(ids, [len(ids)])` and `builder.finalize(idx)`. The
  tokenizer is the same bundled `tokenizer.json` through `tokenizers` (the Rust core that
  transformers' fast tokenizer wraps; Megatron's HuggingFaceTokenizer would add transformers' Python
  layer per document, so this favours Megatron), no special tokens, EOD (`</s>`) appended.
- megatron-core needs numpy >= 2 and atorch pins numpy 1.24, so Megatron runs in its own venv,
  created once under `~/.cache/atorch-bench/megatron-core-venv` (or `--megatron-venv`): torch 2.13.0
  from the machine's local wheel, numpy >= 2, tokenizers, megatron-core (no dependencies: only
  `megatron.core.datasets.indexed_dataset` is used).
- Every run is a fresh process; runs are interleaved (repeat, size, workers, and the order of the two
  implementations alternates per repeat). Timed: from the first document to the finished `.idx`
  (start-up and imports excluded on both sides), and the CPU seconds of the run's process plus its
  joined workers over the same span (less disturbed by other load than wall time). Peak RSS: the run's own process and its largest
  worker (`ru_maxrss`). The `.bin`/`.idx` of both implementations are compared byte for byte.
- Reads: `DatasetForCausalLM` (mmap) random samples of `--seq-length` tokens vs the same samples
  assembled from megatron-core's `IndexedDataset(mmap=True).get(doc, offset, length)` with the same
  sample index (`.npy` files atorch built), plus random whole-document reads on both readers.

Prints a Markdown summary for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_JSON = REPO / "atorch" / "data" / "assets" / "tokenizer" / "tokenizer.json"
DEFAULT_VENV = Path.home() / ".cache" / "atorch-bench" / "megatron-core-venv"


# --------------------------------------------------------------------------------------------
# Child modes. The Megatron ones run under the megatron-core venv: stdlib, numpy, tokenizers and
# megatron-core only (no atorch import).
# --------------------------------------------------------------------------------------------

def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (the joined pool)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _peak_rss() -> dict:
    return {"rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


_mcore_tokenizer = None
_mcore_eod = -1


def _mcore_init(tokenizer_json: str, eod: int) -> None:
    global _mcore_tokenizer, _mcore_eod
    from tokenizers import Tokenizer

    _mcore_tokenizer = Tokenizer.from_file(tokenizer_json)
    _mcore_eod = eod


def _mcore_encode(line: str):
    text = json.loads(line)["text"]
    ids = _mcore_tokenizer.encode(text, add_special_tokens=False).ids
    if ids:
        ids.append(_mcore_eod)
    return ids, len(line)


def megatron_one(corpus: str, prefix: str, workers: int, eod: int, vocab_size: int) -> None:
    import multiprocessing

    from megatron.core.datasets import indexed_dataset

    cpu = _cpu_seconds()
    pool = multiprocessing.Pool(workers, initializer=_mcore_init, initargs=(str(TOKENIZER_JSON), eod))
    builder = indexed_dataset.IndexedDatasetBuilder(prefix + ".bin",
                                                    dtype=indexed_dataset.DType.optimal_dtype(vocab_size))
    start = time.perf_counter()
    documents = tokens = 0
    with open(corpus, "r", encoding="utf-8") as fin:
        for ids, _ in pool.imap(_mcore_encode, fin, 32):
            if ids:  # Megatron keeps no empty documents (keep_empty=False)
                builder.add_document(ids, [len(ids)])
                documents += 1
                tokens += len(ids)
    builder.finalize(prefix + ".idx")
    seconds = time.perf_counter() - start
    pool.close()
    pool.join()
    print(json.dumps({"documents": documents, "tokens": tokens, "seconds": seconds,
                      "cpu_seconds": _cpu_seconds() - cpu, **_peak_rss()}))


def atorch_one(corpus: str, prefix: str, workers: int) -> None:
    sys.path.insert(0, str(REPO))
    from atorch.data import DatasetPreprocessor
    from atorch.testing.assets import load_tokenizer

    preprocessor = DatasetPreprocessor(load_tokenizer(), workers=workers)
    cpu = _cpu_seconds()
    stats = preprocessor.preprocess(corpus, prefix, progress_enabled=False)  # joins its pool before returning
    print(json.dumps({"documents": stats.documents, "tokens": stats.tokens, "seconds": stats.seconds,
                      "cpu_seconds": _cpu_seconds() - cpu, **_peak_rss()}))


def _assemble(get, doc_order, doc_offsets, samples, seq, index):
    """The tokens of sample `index`: the same walk over the document index that atorch does."""
    import numpy as np

    start = int(samples[index]) * seq
    end = start + seq
    d = int(np.searchsorted(doc_offsets, start, side="right")) - 1
    pieces, position = [], start
    while position < end:
        take = min(end, int(doc_offsets[d + 1])) - position
        if take > 0:
            pieces.append(get(int(doc_order[d]), position - int(doc_offsets[d]), take))
        position += take
        d += 1
    return np.concatenate(pieces).astype(np.int64)


def reads_one(impl: str, prefix: str, seq: int, n: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    if impl == "atorch":
        sys.path.insert(0, str(REPO))
        from atorch.data import DatasetForCausalLM
        from atorch.data.indexed_dataset import open_indexed_dataset

        dataset = DatasetForCausalLM(prefix, seq, seed=1234)
        docs = open_indexed_dataset(prefix, "mmap")
        sample = dataset.sample_tokens
        n_docs, n_samples = len(docs), len(dataset)
        read_doc = docs.__getitem__
    else:
        import glob

        from megatron.core.datasets.indexed_dataset import IndexedDataset

        docs = IndexedDataset(prefix, mmap=True)
        stem = glob.glob(f"{prefix}_train_{seq}sl_0_1_1234s_samples.npy")[0][: -len("samples.npy")]
        order, offsets, samples = (np.load(stem + k + ".npy", mmap_mode="r")
                                   for k in ("doc_order", "doc_offsets", "samples"))
        n_docs, n_samples = len(docs), len(samples)
        get = docs.get

        def sample(i):
            return _assemble(get, order, offsets, samples, seq, i)

        read_doc = docs.__getitem__
    sample_ids = rng.integers(0, n_samples, size=n)
    doc_ids = rng.integers(0, n_docs, size=n)
    checksum = 0
    start = time.perf_counter()
    for i in sample_ids:
        checksum += int(sample(int(i))[::97].sum())
    sample_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for i in doc_ids:
        checksum += int(read_doc(int(i))[-1])
    doc_seconds = time.perf_counter() - start
    print(json.dumps({"samples_per_s": n / sample_seconds, "docs_per_s": n / doc_seconds, "checksum": checksum}))


# --------------------------------------------------------------------------------------------
# Driver (atorch's venv)
# --------------------------------------------------------------------------------------------

def ensure_megatron_venv(venv: Path) -> Path:
    """The megatron-core venv's python, created on first use (~1-2 min from the local wheels)."""
    python = venv / "bin" / "python"
    marker = venv / ".atorch-bench-ready"
    if not marker.exists():
        print(f"creating the megatron-core venv in {venv} ...", flush=True)
        subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        # torch: the pinned local CPU wheel (the project's constraints); numpy >= 2 for megatron-core.
        subprocess.run(pip + ["-c", str(REPO / "constraints.txt"), "torch", "tokenizers"], check=True,
                       env=dict(os.environ, PIP_CONSTRAINT=""))
        subprocess.run(pip + ["numpy>=2"], check=True, env=dict(os.environ, PIP_CONSTRAINT=""))
        subprocess.run(pip + ["--no-deps", "megatron-core"], check=True, env=dict(os.environ, PIP_CONSTRAINT=""))
        marker.touch()
    return python


def _base_python() -> str:
    base = Path(sys.base_prefix) / "bin" / "python3"
    return str(base if base.exists() else sys.executable)


def _child(python: str, args: list) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([python, __file__] + [str(a) for a in args], env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{args[0]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _spread(values: list) -> str:
    med = statistics.median(values)
    return f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16.0, 48.0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--reads", type=int, default=20000, help="random reads per reader and run")
    parser.add_argument("--megatron-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--megatron-one", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--atorch-one", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--reads-one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.megatron_one:
        c, p, w, e, v = args.megatron_one
        return megatron_one(c, p, int(w), int(e), int(v))
    if args.atorch_one:
        c, p, w = args.atorch_one
        return atorch_one(c, p, int(w))
    if args.reads_one:
        i, p, s, n, seed = args.reads_one
        return reads_one(i, p, int(s), int(n), int(seed))

    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    from preprocess import generate_corpus  # noqa: E402
    from atorch.data.preprocess import vocab_size_of  # noqa: E402
    from atorch.testing.assets import load_tokenizer  # noqa: E402

    tokenizer = load_tokenizer()
    eod, vocab = tokenizer.eos_token_id, vocab_size_of(tokenizer)
    mpython = str(ensure_megatron_venv(args.megatron_venv))
    pythons = {"atorch": sys.executable, "megatron": mpython}
    loads = [os.getloadavg()]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, python {platform.python_version()}, "
          f"load average before: {loads[0]}", flush=True)
    results: dict = {}
    identical: dict = {}
    reads: dict = {}
    with tempfile.TemporaryDirectory(prefix="atorch-vs-megatron-") as tmp:
        tmp_path = Path(tmp)
        corpora = {}
        for size in args.sizes_mb:
            corpora[size] = tmp_path / f"corpus_{size:g}mb.jsonl"
            docs = generate_corpus(corpora[size], size, "jsonl")
            print(f"corpus {size:g} MB: {corpora[size].stat().st_size / 1e6:.1f} MB, {docs} documents", flush=True)
        for repeat in range(args.repeats):
            for size in args.sizes_mb:
                for workers in args.workers:
                    order = ["atorch", "megatron"] if (repeat + workers) % 2 == 0 else ["megatron", "atorch"]
                    for impl in order:
                        prefix = str(tmp_path / f"{impl}_{size:g}_{workers}")
                        if impl == "atorch":
                            r = _child(pythons[impl], ["--atorch-one", corpora[size], prefix, workers])
                        else:
                            r = _child(pythons[impl], ["--megatron-one", corpora[size], prefix, workers, eod, vocab])
                        r["load"] = os.getloadavg()[0]
                        results.setdefault((size, workers, impl), []).append(r)
                        print(f"  repeat {repeat} {size:g} MB workers={workers} {impl}: {r['documents']} docs "
                              f"{r['tokens'] / r['seconds']:,.0f} tokens/s, {r['seconds']:.1f} s, CPU {r['cpu_seconds']:.1f} s, main "
                              f"{r['rss_main_mb']:.0f} MiB, worker {r['rss_worker_mb']:.0f} MiB, load {r['load']:.1f}",
                              flush=True)
                    a, m = (tmp_path / f"{i}_{size:g}_{workers}" for i in ("atorch", "megatron"))
                    identical[(size, workers)] = all(_sha(Path(str(a) + s)) == _sha(Path(str(m) + s))
                                                     for s in (".bin", ".idx"))
        # Reads, on the largest corpus's files written with the first worker count (identical on both sides
        # when the check above passed); atorch first so its sample index exists for both readers.
        size = max(args.sizes_mb)
        files = {impl: str(tmp_path / f"{impl}_{size:g}_{args.workers[0]}") for impl in ("atorch", "megatron")}
        for repeat in range(args.repeats + 1):
            order = ["atorch", "megatron"] if repeat % 2 == 0 else ["megatron", "atorch"]
            for impl in order:
                r = _child(pythons[impl], ["--reads-one", impl, files["atorch"], args.seq_length, args.reads, repeat])
                reads.setdefault(impl, []).append(r)
                print(f"  reads repeat {repeat} {impl}: {r['samples_per_s']:,.0f} samples/s, "
                      f"{r['docs_per_s']:,.0f} docs/s", flush=True)
    loads.append(os.getloadavg())
    print(f"load average after: {loads[-1]}\n")

    print("| corpus | workers | impl | documents | tokens | docs/s median (min-max) | tokens/s median (min-max) | "
          "tokens per CPU s median (min-max) | peak RSS main | peak RSS worker | .bin/.idx identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes_mb:
        for workers in args.workers:
            for impl in ("atorch", "megatron"):
                rs = results[(size, workers, impl)]
                print(f"| {size:g} MB | {workers} | {impl} | {rs[0]['documents']:,} | {rs[0]['tokens']:,} | "
                      f"{_spread([r['documents'] / r['seconds'] for r in rs])} | "
                      f"{_spread([r['tokens'] / r['seconds'] for r in rs])} | "
                      f"{_spread([r['tokens'] / r['cpu_seconds'] for r in rs])} | "
                      f"{max(r['rss_main_mb'] for r in rs):.0f} MiB | {max(r['rss_worker_mb'] for r in rs):.0f} MiB | "
                      f"{'yes' if identical[(size, workers)] else 'NO'} |")
    print("\nRatio atorch/megatron (tokens/s, per repeat):")
    for size in args.sizes_mb:
        for workers in args.workers:
            ratios = [a["tokens"] / a["seconds"] / (m["tokens"] / m["seconds"])
                      for a, m in zip(results[(size, workers, "atorch")], results[(size, workers, "megatron")])]
            print(f"  {size:g} MB, workers={workers}: " + ", ".join(f"{x:.2f}" for x in ratios))
    print(f"\n| reader | samples/s ({args.seq_length} tokens) median (min-max) | documents/s median (min-max) |")
    print("|---|---|---|")
    for impl, label in (("atorch", "atorch DatasetForCausalLM / MMapIndexedDataset"),
                        ("megatron", "megatron-core IndexedDataset(mmap=True)")):
        print(f"| {label} | {_spread([r['samples_per_s'] for r in reads[impl]])} | "
              f"{_spread([r['docs_per_s'] for r in reads[impl]])} |")
    same = all(a["checksum"] == m["checksum"] for a, m in zip(reads["atorch"], reads["megatron"]))
    print(f"\nsame tokens read by both readers (checksums): {'yes' if same else 'NO'}")
    print(f"\nload average (1, 5, 15 min) before {loads[0]}, after {loads[-1]}; per-run 1-min loads: "
          f"{min(r['load'] for rs in results.values() for r in rs):.1f}-"
          f"{max(r['load'] for rs in results.values() for r in rs):.1f}")


if __name__ == "__main__":
    main()
