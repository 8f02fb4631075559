"""Preprocessing throughput and peak memory: tokens/s with 1 vs 2 workers on a generated corpus.

    .venv/bin/python benchmarks/preprocess.py [--size-mb 50] [--big-size-mb 100] [--format jsonl]

Generates a corpus of documents (random runs of sentences from the bundled corpus) in a temp
directory, then preprocesses it with the bundled tokenizer, each configuration in a fresh process
so its peak RSS (the main process, and the largest worker) is its own. The Rust tokenizer's own
threads are off (TOKENIZERS_PARALLELISM=false) so that "workers" is the number of busy cores;
one extra row shows workers=1 with them on. A second, larger corpus with 2 workers shows whether
memory grows with corpus size. CPU seconds (main process + joined workers) are reported beside
wall time: on a shared, busy machine they move much less than wall time does. Prints a Markdown
table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def generate_corpus(path: Path, size_mb: float, fmt: str, seed: int = 0) -> int:
    """Write documents of 5-60 random sentences from the bundled corpus until `size_mb` MB; return doc count."""
    sys.path.insert(0, str(REPO))
    from atorch.testing.assets import corpus_documents

    sentences = [s.strip() + "." for doc in corpus_documents() for s in doc.split(".") if s.strip()]
    rng = np.random.default_rng(seed)
    target, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            picks = rng.integers(0, len(sentences), size=int(rng.integers(5, 61)))
            text = " ".join(sentences[i] for i in picks)
            line = (json.dumps({"text": text}) if fmt == "jsonl" else text) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    return docs


def run_one(corpus: str, out: str, workers: int) -> None:
    """Child mode: preprocess once and print a JSON line of figures."""
    sys.path.insert(0, str(REPO))
    from atorch.data import DatasetPreprocessor
    from atorch.testing.assets import load_tokenizer

    preprocessor = DatasetPreprocessor(load_tokenizer(), workers=workers)
    baseline = _current_rss_mb()  # torch, transformers and the tokenizer, before any document
    before = _cpu_seconds()
    stats = preprocessor.preprocess(corpus, out, progress_enabled=False)
    # The pool's workers are joined by now, so their time is counted in RUSAGE_CHILDREN.
    cpu_main, cpu_workers = (after - b for after, b in zip(_cpu_seconds(), before))
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"documents": stats.documents, "tokens": stats.tokens, "seconds": stats.seconds,
                      "rss_baseline_mb": baseline, "rss_main_mb": own,
                      "rss_worker_mb": children if workers > 1 else 0.0,
                      "cpu_seconds": cpu_main + cpu_workers, "cpu_main_seconds": cpu_main,
                      "bin_mb": os.path.getsize(stats.data_file) / 1e6}))


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_seconds() -> tuple:
    """(this process, its reaped children) user + system CPU seconds."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return tuple(u.ru_utime + u.ru_stime for u in usage)


def measure(corpus: Path, out: Path, workers: int, rust_threads: bool) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true" if rust_threads else "false", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--run-one", str(corpus), str(out), str(workers)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=50.0, help="corpus size for the throughput runs")
    parser.add_argument("--big-size-mb", type=float, default=100.0, help="larger corpus for the memory check (0: skip)")
    parser.add_argument("--format", choices=["jsonl", "txt"], default="jsonl")
    parser.add_argument("--run-one", nargs=3, metavar=("CORPUS", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        run_one(args.run_one[0], args.run_one[1], int(args.run_one[2]))
        return

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
          f"python {platform.python_version()}, load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="atorch-preprocess-bench-") as tmp:
        tmp_path = Path(tmp)
        corpora = {args.size_mb: tmp_path / f"corpus_{args.size_mb:g}mb.{args.format}"}
        if args.big_size_mb:
            corpora[args.big_size_mb] = tmp_path / f"corpus_{args.big_size_mb:g}mb.{args.format}"
        for size, path in corpora.items():
            start = time.perf_counter()
            docs = generate_corpus(path, size, args.format)
            print(f"generated {path.name}: {path.stat().st_size / 1e6:.1f} MB, {docs} documents "
                  f"in {time.perf_counter() - start:.1f} s")
        runs = [(args.size_mb, 1, False), (args.size_mb, 2, False), (args.size_mb, 1, True)]
        if args.big_size_mb:
            runs.append((args.big_size_mb, 2, False))
        rows = []
        for size, workers, rust_threads in runs:
            r = measure(corpora[size], tmp_path / "out", workers, rust_threads)
            rows.append((size, workers, rust_threads, r))
            print(f"  {size:g} MB, workers={workers}, rust threads {'on' if rust_threads else 'off'}: "
                  f"{r['tokens'] / r['seconds']:,.0f} tokens/s", flush=True)
    print(f"load average after: {os.getloadavg()}\n")
    print("| corpus | workers | tokenizer threads | documents | tokens | seconds | docs/s | tokens/s | "
          "CPU s (main) | tokens per CPU s | RSS before | peak RSS main | peak RSS worker |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, workers, rust_threads, r in rows:
        print(f"| {size:g} MB {args.format} | {workers} | {'on' if rust_threads else 'off'} | {r['documents']:,} | "
              f"{r['tokens']:,} | {r['seconds']:.1f} | {r['documents'] / r['seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds']:,.0f} | {r['cpu_seconds']:.1f} ({r['cpu_main_seconds']:.1f}) | "
              f"{r['tokens'] / r['cpu_seconds']:,.0f} | "
              f"{r['rss_baseline_mb']:.0f} MiB | {r['rss_main_mb']:.0f} MiB | "
              f"{(str(round(r['rss_worker_mb'])) + ' MiB') if workers > 1 else '-'} |")


if __name__ == "__main__":
    main()
