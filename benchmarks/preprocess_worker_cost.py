"""CPU nanoseconds per token of one preprocessing worker's function: atorch's vs Megatron's per-line path.

    .venv/bin/python benchmarks/preprocess_worker_cost.py [--documents 2048] [--rounds 3]

With 2 workers on a loaded machine the wall time follows the workers' CPU per token (each runnable thread
gets about the same share), so this is the figure that decides `preprocess_vs_megatron.py`'s 2-worker
ratio. Measured in this one process (CPU time, min over rounds), on documents from `preprocess.py`'s
generator, with the bundled tokenizer through the `tokenizers` backend:
- atorch: `_ChunkEncoder` on 512-document chunks (tokenize, EOD, flatten to one array, range check);
- encode_batch / encode_batch_fast: the backend's batch calls alone (the latter skips character offsets);
- megatron: per line `json.loads`, `Tokenizer.encode(...).ids`, append EOD (its `tools/preprocess_data.py`
  worker, with the Rust tokenizer directly).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    import numpy as np
    from preprocess import generate_corpus

    from atorch.data import preprocess as P
    from atorch.testing.assets import load_tokenizer

    tokenizer = load_tokenizer()
    backend = tokenizer.backend_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.jsonl"
        generate_corpus(path, args.documents * 2.3e-3 + 0.1, "jsonl")
        lines = path.read_text(encoding="utf-8").splitlines()[: args.documents]
    texts = [json.loads(line)["text"] for line in lines]
    chunks = [texts[i:i + 512] for i in range(0, len(texts), 512)]
    encoder = P._ChunkEncoder(tokenizer, np.dtype(np.uint16), P.vocab_size_of(tokenizer), tokenizer.eos_token_id)
    eod = tokenizer.eos_token_id

    def atorch() -> None:
        for chunk in chunks:
            encoder(chunk)

    def encode_batch() -> None:
        for chunk in chunks:
            [e.ids for e in backend.encode_batch(chunk, add_special_tokens=False)]

    def encode_batch_fast() -> None:
        for chunk in chunks:
            [e.ids for e in backend.encode_batch_fast(chunk, add_special_tokens=False)]

    def megatron() -> None:
        for line in lines:
            ids = backend.encode(json.loads(line)["text"], add_special_tokens=False).ids
            ids.append(eod)

    tokens = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
    cases = [atorch, encode_batch, encode_batch_fast, megatron]
    seconds: dict = {f.__name__: [] for f in cases}
    for _ in range(args.rounds):
        for f in cases:  # interleaved
            start = time.process_time()
            f()
            seconds[f.__name__].append(time.process_time() - start)
    print(f"{len(texts)} documents, {tokens} tokens; CPU ns per token, min (max) of {args.rounds} rounds:")
    for name, values in seconds.items():
        print(f"  {name:18s} {min(values) / tokens * 1e9:6.0f} ({max(values) / tokens * 1e9:.0f})")


if __name__ == "__main__":
    main()
