"""atorch's data tools against megatron-core's, side by side: preprocessing and random sample reads.

    .venv/bin/python benchmarks/preprocess_vs_megatron.py [--sizes-mb 16 48] [--repeats 2] [--workers 1 2]
        [--work-dir /tmp/atorch-vs-megatron] [--max-seconds 500] [--fresh]

Resumable: the results of every run are appended to `<work-dir>/results.jsonl`; a rerun of the same
command skips the runs already there, `--max-seconds` stops before a run that would end past it (so each
invocation under a shared benchmark lock stays short), and the summary covers all recorded runs.

What runs:
- Corpus: JSON lines generated from the bundled corpus (`benchmarks/preprocess.py`'s generator, seed 0)
  under `--work-dir` on first use, one file per size; never committed.
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


class _SchedSampler:
    """Where this process's workers spent the timed span: on a CPU, runnable but waiting for one, or asleep.

    A thread reads `/proc/<pid>/task/*/schedstat` (Linux: ns on CPU, ns waiting on a run queue) of
    every child process every 50 ms and keeps each one's last reading; `sleep` is the rest of the
    span (blocked on a pipe, a lock, I/O). It tells a worker that idles for lack of work (sleep)
    from one that is preempted by other load (run-queue wait), which wall time alone cannot.
    """

    def __init__(self, include_self: bool = False) -> None:
        import threading

        self.include_self = include_self
        self.first: dict = {}
        self.last: dict = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read(pid: int) -> tuple:
        cpu = wait = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                c, w, _ = f.read().split()
            cpu, wait = cpu + int(c), wait + int(w)
        return cpu, wait, time.perf_counter()

    def _sample(self) -> None:
        me = os.getpid()
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        if self.include_self:  # the process that tokenizes when there is no pool
            pids.append(me)
        for pid in pids:
            try:
                reading = self._read(pid)
            except (OSError, ValueError):
                continue  # exited between the listing and the read
            self.first.setdefault(pid, reading)
            self.last[pid] = reading

    def _run(self) -> None:
        while not self.stop_event.wait(0.05):
            self._sample()

    def start(self) -> "_SchedSampler":
        self.thread.start()
        return self

    def stop(self) -> dict:
        """Summed over the workers seen: seconds on CPU, waiting for a CPU, asleep, and their span."""
        self._sample()
        self.stop_event.set()
        self.thread.join()
        totals = {"worker_cpu_s": 0.0, "worker_runq_s": 0.0, "worker_sleep_s": 0.0, "worker_span_s": 0.0}
        for pid, (cpu1, wait1, t1) in self.last.items():
            cpu0, wait0, t0 = self.first[pid]
            span, cpu, wait = t1 - t0, (cpu1 - cpu0) / 1e9, (wait1 - wait0) / 1e9
            totals["worker_cpu_s"] += cpu
            totals["worker_runq_s"] += wait
            totals["worker_sleep_s"] += max(span - cpu - wait, 0.0)
            totals["worker_span_s"] += span
        return totals


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
    sampler = _SchedSampler().start()
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
    sched = sampler.stop()
    pool.close()
    pool.join()
    print(json.dumps({"documents": documents, "tokens": tokens, "seconds": seconds,
                      "cpu_seconds": _cpu_seconds() - cpu, **sched, **_peak_rss()}))


def atorch_one(corpus: str, prefix: str, workers: int) -> None:
    sys.path.insert(0, str(REPO))
    from atorch.data import DatasetPreprocessor
    from atorch.testing.assets import load_tokenizer

    preprocessor = DatasetPreprocessor(load_tokenizer(), workers=workers)
    cpu = _cpu_seconds()
    # The pool's workers until they are joined (workers >= 2), else this process, which tokenizes.
    sampler = _SchedSampler(include_self=workers == 1).start()
    stats = preprocessor.preprocess(corpus, prefix, progress_enabled=False)  # joins its pool before returning
    sched = sampler.stop()
    print(json.dumps({"documents": stats.documents, "tokens": stats.tokens, "seconds": stats.seconds,
                      "cpu_seconds": _cpu_seconds() - cpu, **sched, **_peak_rss()}))


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


def _plan(args) -> list:
    """Every run, in the interleaved order: repeat -> size -> workers -> implementation (alternating),
    then the read runs on the largest corpus."""
    runs = []
    for repeat in range(args.repeats):
        for size in args.sizes_mb:
            for workers in args.workers:
                order = ["atorch", "megatron"] if (repeat + workers) % 2 == 0 else ["megatron", "atorch"]
                runs += [{"kind": "preprocess", "repeat": repeat, "size": size, "workers": workers, "impl": impl}
                         for impl in order]
    for repeat in range(args.repeats + 1):
        order = ["atorch", "megatron"] if repeat % 2 == 0 else ["megatron", "atorch"]
        runs += [{"kind": "reads", "repeat": repeat, "size": max(args.sizes_mb), "impl": impl} for impl in order]
    return runs


def _key(run: dict) -> tuple:
    return tuple(run.get(k) for k in ("kind", "repeat", "size", "workers", "impl"))


def _corpus(work: Path, size: float) -> Path:
    """The generated corpus of `size` MB under `work`, generated on first use (seed 0, so reruns agree)."""
    from preprocess import generate_corpus

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"corpus_{size:g}mb.jsonl"
    if not path.exists():
        partial = path.with_suffix(".partial")
        docs = generate_corpus(partial, size, "jsonl")
        partial.rename(path)
        print(f"generated corpus {path}: {path.stat().st_size / 1e6:.1f} MB, {docs} documents", flush=True)
    return path


def _estimate(done: list, run: dict) -> float:
    """Seconds the run will likely take: its configuration's last run, else a run of another corpus size with
    the same kind and workers scaled by size, else 0 (unknown: just run it)."""
    alike = [r for r in done if r["kind"] == run["kind"] and r.get("workers") == run.get("workers")]
    same = [r for r in alike if r["size"] == run["size"] and r["impl"] == run["impl"]]
    if same:
        return same[-1]["elapsed"]
    return max((r["elapsed"] * run["size"] / r["size"] for r in alike), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16.0, 48.0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--reads", type=int, default=20000, help="random reads per reader and run")
    parser.add_argument("--megatron-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "atorch-vs-megatron",
                        help="generated corpora, outputs and the results file (outside the repository)")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="stop before a run that would end past this many seconds (estimated from the last "
                             "run of its configuration); rerun the same command to continue. 0: no limit")
    parser.add_argument("--fresh", action="store_true", help="forget the results of earlier invocations")
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
    from atorch.data.preprocess import vocab_size_of  # noqa: E402
    from atorch.testing.assets import load_tokenizer  # noqa: E402

    began = time.perf_counter()
    tokenizer = load_tokenizer()
    eod, vocab = tokenizer.eos_token_id, vocab_size_of(tokenizer)
    mpython = str(ensure_megatron_venv(args.megatron_venv))
    pythons = {"atorch": sys.executable, "megatron": mpython}
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    results_file = work / "results.jsonl"
    if args.fresh and results_file.exists():
        results_file.unlink()
    done = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    finished = {_key(r) for r in done}
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, python {platform.python_version()}, "
          f"load average before: {os.getloadavg()}; {len(done)} runs already in {results_file}", flush=True)
    for run in _plan(args):
        if _key(run) in finished:
            continue
        if args.max_seconds and time.perf_counter() - began + _estimate(done, run) > args.max_seconds:
            print(f"stopping before {run} (time limit); rerun the same command to continue", flush=True)
            break
        corpus = _corpus(work, run["size"])
        impl, size = run["impl"], run["size"]
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        if run["kind"] == "preprocess":
            prefix = str(work / f"{impl}_{size:g}_{run['workers']}")
            if impl == "atorch":
                r = _child(pythons[impl], ["--atorch-one", corpus, prefix, run["workers"]])
            else:
                r = _child(pythons[impl], ["--megatron-one", corpus, prefix, run["workers"], eod, vocab])
            r["sha"] = {s: _sha(Path(prefix + s)) for s in (".bin", ".idx")}
            print(f"  repeat {run['repeat']} {size:g} MB workers={run['workers']} {impl}: {r['documents']} docs "
                  f"{r['tokens'] / r['seconds']:,.0f} tokens/s, {r['seconds']:.1f} s, CPU {r['cpu_seconds']:.1f} s, "
                  f"main {r['rss_main_mb']:.0f} MiB, worker {r['rss_worker_mb']:.0f} MiB, load {load_before:.1f}",
                  flush=True)
        else:
            # The files atorch wrote with the first worker count (byte-identical to Megatron's when the check
            # passes), read by both readers; atorch's sample index (.npy) is built by its first reads run.
            prefix = str(work / f"atorch_{size:g}_{args.workers[0]}")
            r = _child(pythons[impl], ["--reads-one", impl, prefix, args.seq_length, args.reads, run["repeat"]])
            print(f"  reads repeat {run['repeat']} {impl}: {r['samples_per_s']:,.0f} samples/s, "
                  f"{r['docs_per_s']:,.0f} docs/s, load {load_before:.1f}", flush=True)
        r.update(run, load=load_before, elapsed=time.perf_counter() - started)
        done.append(r)
        with open(results_file, "a") as f:
            f.write(json.dumps(r) + "\n")
    _summarize(args, done)


def _summarize(args, done: list) -> None:
    pre = {}
    for r in done:
        if r["kind"] == "preprocess" and r["size"] in args.sizes_mb and r["workers"] in args.workers:
            pre.setdefault((r["size"], r["workers"], r["impl"]), []).append(r)
    print(f"\nload average now: {os.getloadavg()}\n")
    print("| corpus | workers | impl | runs | documents | tokens | docs/s median (min-max) | tokens/s median (min-max) | "
          "tokens per CPU s median (min-max) | worker time asleep / waiting for a CPU | peak RSS main | "
          "peak RSS worker | .bin/.idx identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes_mb:
        for workers in args.workers:
            # "atorch-serial": recorded by session 4's experiment (commit a445a56), where workers=1 "atorch" was a
            # tokenizing thread overlapped with the rest and "atorch-serial" the one-thread path atorch keeps.
            impls = ("atorch", "atorch-serial", "megatron")
            shas = set().union(*({json.dumps(r["sha"]) for r in pre.get((size, workers, impl), [])} for impl in impls))
            same = len(shas) == 1
            for impl in impls:
                rs = pre.get((size, workers, impl))
                if not rs:
                    continue
                span = sum(r.get("worker_span_s", 0.0) for r in rs)
                sched = (f"{100 * sum(r['worker_sleep_s'] for r in rs) / span:.1f}% / "
                         f"{100 * sum(r['worker_runq_s'] for r in rs) / span:.1f}%") if span else "-"
                print(f"| {size:g} MB | {workers} | {impl} | {len(rs)} | {rs[0]['documents']:,} | {rs[0]['tokens']:,} | "
                      f"{_spread([r['documents'] / r['seconds'] for r in rs])} | "
                      f"{_spread([r['tokens'] / r['seconds'] for r in rs])} | "
                      f"{_spread([r['tokens'] / r['cpu_seconds'] for r in rs])} | {sched} | "
                      f"{max(r['rss_main_mb'] for r in rs):.0f} MiB | {max(r['rss_worker_mb'] for r in rs):.0f} MiB | "
                      f"{'yes' if same else 'NO'} |")
    print("\nPer repeat, atorch/megatron: tokens/s ratio = tokens per CPU s ratio x ratio of CPU obtained per wall "
          "second; then each side's workers' share of their time on a CPU / asleep (the rest: waiting for a CPU), "
          "and the 1-min loads before the two runs:")
    for size, workers, other in ((s, w, o) for s in args.sizes_mb for w in args.workers
                                 for o in ("megatron", "atorch-serial")):
        pairs = []
        for repeat in range(args.repeats):
            a = [r for r in pre.get((size, workers, "atorch"), []) if r["repeat"] == repeat]
            m = [r for r in pre.get((size, workers, other), []) if r["repeat"] == repeat]
            if a and m:
                a0, m0 = a[0], m[0]
                def share(r: dict) -> str:
                    span = r.get("worker_span_s") or float("nan")
                    return f"{100 * r['worker_cpu_s'] / span:.0f}/{100 * r['worker_sleep_s'] / span:.0f}%"

                obtained = (a0["cpu_seconds"] / a0["seconds"]) / (m0["cpu_seconds"] / m0["seconds"])
                pairs.append(f"{a0['tokens'] / a0['seconds'] / (m0['tokens'] / m0['seconds']):.2f} = "
                             f"{m0['cpu_seconds'] / a0['cpu_seconds']:.2f} x {obtained:.2f} "
                             f"(workers {share(a0)} vs {share(m0)}; load {a0['load']:.0f}/{m0['load']:.0f})")
        if pairs:
                print(f"  {size:g} MB, workers={workers}, atorch/{other}: " + ", ".join(pairs))
    reads = {}
    for r in done:
        if r["kind"] == "reads" and r["size"] == max(args.sizes_mb):
            reads.setdefault(r["impl"], []).append(r)
    if reads.get("atorch") and reads.get("megatron"):
        print(f"\n| reader | samples/s ({args.seq_length} tokens) median (min-max) | documents/s median (min-max) |")
        print("|---|---|---|")
        for impl, label in (("atorch", "atorch DatasetForCausalLM / MMapIndexedDataset"),
                            ("megatron", "megatron-core IndexedDataset(mmap=True)")):
            print(f"| {label} | {_spread([r['samples_per_s'] for r in reads[impl]])} | "
                  f"{_spread([r['docs_per_s'] for r in reads[impl]])} |")
        same = all(a["checksum"] == m["checksum"] for a, m in zip(reads["atorch"], reads["megatron"]))
        print(f"\nsame tokens read by both readers (checksums): {'yes' if same else 'NO'}")
    loads = [r["load"] for r in done]
    if loads:
        print(f"\nper-run 1-min loads: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
