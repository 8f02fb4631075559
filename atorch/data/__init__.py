"""Pretraining data: tokenize corpora to Megatron-LM `.bin`/`.idx` files and stream samples from them.

`DatasetPreprocessor` writes the files in parallel and bounded memory; `DatasetForCausalLM`
cuts them into fixed-length samples; `DatasetBlender`, `DistributedProxySampler` and
`InfiniteDataLoader` mix, shard and repeat them.

    pre = DatasetPreprocessor(tokenizer, workers=8)                # EOD = tokenizer.eos_token_id
    pre.preprocess(pre.open_jsonl("web.jsonl"), "data/web")        # data/web.bin + data/web.idx
    train = DatasetForCausalLM("data/web", 2048, "train", 0.0, 0.99, seed=1)
    valid = DatasetForCausalLM("data/web", 2048, "valid", 0.99, 1.0)
    sampler = DistributedProxySampler(SequentialSampler(train), seed=1)  # ranks from torch.distributed
    batches = InfiniteDataLoader(DataLoader(train, batch_size=8, sampler=sampler))
"""

from typing import Any

from atorch.data.batch_utils import data_to_device, expand_batch_dim
from atorch.data.blender import DatasetBlender, blend_schedule
from atorch.data.causal_lm import DatasetForCausalLM
from atorch.data.indexed_dataset import (
    IndexedCachedDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    MMapIndexedDataset,
    best_fitting_dtype,
    open_indexed_dataset,
)
from atorch.data.samplers import DistributedProxySampler, InfiniteDataLoader
from atorch.data.sources import DocumentSource, LineProblem, open_directory, open_hf_dataset, open_jsonl, open_text

__all__ = [
    "DatasetBlender", "DatasetForCausalLM", "DatasetPreprocessor", "DistributedProxySampler", "DocumentSource",
    "IndexedCachedDataset", "IndexedDataset", "IndexedDatasetWriter", "InfiniteDataLoader", "LineProblem",
    "MMapIndexedDataset", "PreprocessStats", "best_fitting_dtype", "blend_schedule", "data_to_device",
    "expand_batch_dim", "open_directory",
    "open_hf_dataset", "open_indexed_dataset", "open_jsonl", "open_text",
]


def __getattr__(name: str) -> Any:
    # `preprocess` is imported on first use, so `python -m atorch.data.preprocess` (the command) runs
    # the module once, not after the package had already imported it (runpy's RuntimeWarning).
    if name in ("DatasetPreprocessor", "PreprocessStats"):
        from atorch.data import preprocess

        return getattr(preprocess, name)
    raise AttributeError(f"module 'atorch.data' has no attribute {name!r}")
