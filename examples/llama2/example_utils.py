"""Shared pieces of the Llama 2 examples: arguments, model/tokenizer/data loading, the training loop.

Each example script only builds its strategy and calls `auto_accelerate`; what to load, how the
corpus becomes samples, metrics, checkpoints and resuming live here, identical for all three.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from atorch import distributed as adist
from atorch.utils.trackers import MetricsLogger
from atorch.utils.metrics import (
    DevicePeak,
    StepMetrics,
    ThroughputMeter,
    TransformerFlops,
    device_peak,
    dtype_name,
    peak_memory_mb,
)

logger = logging.getLogger("llama2_example")

MODE_FINE_TUNING = "fine-tuning"
MODE_PRETRAINING = "pretraining"
MODE_TINY = "offline tiny default"

# Learning rates that train each mode sensibly out of the box: the tiny random model needs a
# large one to show learning within tens of steps; fine-tuning a real checkpoint a small one.
DEFAULT_LEARNING_RATES = {MODE_FINE_TUNING: 2e-5, MODE_PRETRAINING: 3e-4, MODE_TINY: 3e-3}
LORA_LEARNING_RATE = 2e-4
TINY_LORA_LEARNING_RATE = 1e-2

# Adapter parameter names as peft creates them; everything else must stay frozen under LoRA.
LORA_PARAMETER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


class UsageError(ValueError):
    """A mistake in the arguments or the environment the user can fix; printed without a traceback."""


# -- Arguments ---------------------------------------------------------------------------------


def common_parser(description: str, per_device_batch: bool = True) -> argparse.ArgumentParser:
    """The arguments every example takes; each script adds its own. The entry scripts fill them from env vars.

    `per_device_batch=False` leaves out `--per_device_train_batch_size`, for scripts that size
    their batch otherwise (micro-batches x accumulation under pipeline parallelism).
    """
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = parser.add_argument_group("model (give none: the tiny Llama and the bundled tokenizer, offline)")
    model.add_argument("--model_name_or_path", help="fine-tune: load config, weights and tokenizer from this dir")
    model.add_argument("--config_name", help="pretrain: random init from this config dir (or config.json)")
    model.add_argument("--tokenizer_name", help="tokenizer dir; defaults to the model or config dir")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_path", help="a .txt (one document per line) or .jsonl ('text' key) file, a dir "
                                             "of them, or a preprocessed .bin/.idx prefix; none: the bundled corpus")
    data.add_argument("--data_cache_dir", help="where the tokenized corpus is cached; default OUTPUT_DIR/data_cache")
    data.add_argument("--block_size", type=int, default=256, help="tokens per training sample")
    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", default="./outputs/llama2")
    if per_device_batch:
        train.add_argument("--per_device_train_batch_size", type=int, default=4)
    train.add_argument("--max_steps", type=int, default=100, help="optimizer steps in total (resumed runs included)")
    train.add_argument("--learning_rate", type=float, default=None,
                       help=f"default by mode: {DEFAULT_LEARNING_RATES}; with --use_lora {LORA_LEARNING_RATE} "
                            f"({MODE_TINY}: {TINY_LORA_LEARNING_RATE})")
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--warmup_steps", type=int, default=0, help="linear warm-up, then cosine decay to 10%%")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--log_steps", type=int, default=10, help="print a metrics line every N steps (rank 0)")
    train.add_argument("--log_with", default="jsonl",
                       help="metric trackers, comma-separated: tensorboard, jsonl, none (OUTPUT_DIR/logs, rank 0)")
    train.add_argument("--save_steps", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    train.add_argument("--save_total_limit", type=int, default=2, help="newest checkpoints kept")
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                       help="resume from CHECKPOINT, or (bare flag) from the latest one in OUTPUT_DIR/checkpoints "
                            "if there is one")
    train.add_argument("--peak_tflops", type=float, default=None,
                       help="device peak for MFU/HFU; default: the GPU table, or a CPU matmul probe")
    return parser


def add_lora_fp8_args(parser: argparse.ArgumentParser) -> None:
    """`--use_lora` / `--use_fp8`, for the scripts whose strategy can include them."""
    group = parser.add_argument_group("LoRA / FP8")
    group.add_argument("--use_lora", action="store_true", help="train rank-8 LoRA adapters only (peft)")
    group.add_argument("--use_fp8", action="store_true", help="FP8 linears (GPUs with FP8 tensor cores only)")


def validate_common_args(args: argparse.Namespace) -> None:
    """Raise UsageError, with the value given, for arguments no run could use."""
    for name in ("block_size", "per_device_train_batch_size", "max_steps", "log_steps"):
        if getattr(args, name, 1) < 1:
            raise UsageError(f"--{name}={getattr(args, name)} must be >= 1")
    if getattr(args, "block_size", 2) < 2:
        raise UsageError(f"--block_size={args.block_size} (BLOCK_SIZE) must be >= 2: a sample of one token has no "
                         "next token to predict")
    if args.save_total_limit < 1:
        raise UsageError(f"--save_total_limit={args.save_total_limit} must be >= 1")
    for name in ("save_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name}={getattr(args, name)} must be >= 0")
    if args.model_name_or_path and args.config_name:
        raise UsageError(f"give --model_name_or_path ({args.model_name_or_path!r}, fine-tuning) or --config_name "
                         f"({args.config_name!r}, pretraining from scratch), not both")
    if args.tokenizer_name and not (args.model_name_or_path or args.config_name):
        raise UsageError(f"--tokenizer_name={args.tokenizer_name!r} needs --config_name (pretraining) or "
                         "--model_name_or_path; without either the tiny default uses its own tokenizer")
    _check_positive(args.learning_rate, "LEARNING_RATE (--learning_rate)")
    _check_positive(args.peak_tflops, "PEAK_TFLOPS (--peak_tflops)")
    _check_log_with(args.log_with)
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"OUTPUT_DIR (--output_dir)={args.output_dir!r} is an existing file; give a directory "
                         "(created if missing) for checkpoints, logs and the data cache")
    check_model_paths(args)


def _check_positive(value: Optional[float], name: str) -> None:
    """Unset (None) is the default; a value must be a positive number (NaN is not)."""
    if value is not None and not value > 0:
        raise UsageError(f"{name}={value} must be > 0 (unset: the default)")


def _check_log_with(log_with: Optional[str]) -> None:
    """The trackers' names are checked now, not when rank 0 opens them after loading the model."""
    from atorch.utils.trackers import TRACKERS, parse_log_with

    try:
        parse_log_with(log_with)
    except ValueError:
        raise UsageError(f"LOG_WITH (--log_with)={log_with!r}: valid values are {', '.join(TRACKERS)} or none, "
                         "comma-separated") from None


def check_fp8_supported(use_fp8: bool) -> None:
    """Fail before loading anything when FP8 cannot run here (no CUDA, a GPU older than Ada/Hopper, no torchao).

    The `fp8` optimization validates the same again inside auto_accelerate; checking first saves
    loading a large checkpoint only to fail.
    """
    if not use_fp8:
        return
    from atorch.auto.opt_lib.fp8 import check_fp8_support

    try:
        check_fp8_support(adist.device().type)
    except ValueError as e:
        raise UsageError(f"USE_FP8=1 (--use_fp8): {e}. Unset USE_FP8 to train without float8.") from e


def run_main(main: Callable[[argparse.Namespace], None], parser: argparse.ArgumentParser) -> None:
    """Parse, run, and turn a UsageError into `error: ...` on stderr and exit status 2 on every rank."""
    logging.basicConfig(level=logging.INFO, datefmt="%H:%M:%S",
                        format=f"[rank{adist.rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser.parse_args()
    try:
        main(args)
    except UsageError as e:
        print(f"[rank{adist.rank()}] error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def is_rank0() -> bool:
    return adist.rank() == 0


def print_rank0(message: str) -> None:
    if is_rank0():
        print(message, flush=True)


def announce_launch() -> None:
    """The job's shape on rank 0: how many processes, on how many nodes, on what device."""
    world, local = adist.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", adist.world_size()))
    print_rank0(f"launch: world_size={world} local_world_size={local} nodes={max(1, world // max(local, 1))} "
                f"device={adist.device()} backend={dist.get_backend() if dist.is_initialized() else 'none'}")


# -- Model and tokenizer -----------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: Optional[nn.Module]
    tokenizer: Any
    config: Any
    """The model's config (also when `model` is None)."""
    mode: str
    """MODE_FINE_TUNING, MODE_PRETRAINING or MODE_TINY."""
    source: str


# Files that hold a tokenizer's vocabulary: a folder with only tokenizer_config.json cannot build one.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _require_local(path: str, name: str, config_file_allowed: bool = False) -> None:
    """Raise a UsageError unless `path` is a local model folder (or, when allowed, a config.json file).

    The examples never download: a hub id or a size name would end, after the process group
    is up, in a network error from transformers on every rank. Said here, before anything runs.
    """
    from atorch.auto.search.cluster_plan import MODEL_PRESETS

    if os.path.isfile(path) and config_file_allowed:
        return
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"{name}={path!r} has no config.json; give a Hugging Face model folder")
        return
    what = "a local folder or config.json" if config_file_allowed else "a local model folder"
    if os.path.exists(path):
        raise UsageError(f"{name}={path!r} is not {what}")
    hint = (f"{path!r} is a size preset of `atorch plan`, not a model; " if path in MODEL_PRESETS else
            "the examples load local files only (no hub downloads); ")
    raise UsageError(f"{name}={path!r} does not exist: {hint}it must be {what} "
                     "(e.g. `huggingface-cli download meta-llama/Llama-2-7b-hf --local-dir /models/llama2-7b`)")


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, n)) for n in TOKENIZER_VOCAB_FILES)


def check_model_paths(args: argparse.Namespace) -> None:
    """Model, config and tokenizer locations exist locally and hold what is loaded from them.

    Pure file checks, run on every rank before the process group starts.
    """
    if args.model_name_or_path:
        _require_local(args.model_name_or_path, "MODEL_NAME_OR_PATH (--model_name_or_path)")
    if args.config_name:
        _require_local(args.config_name, "CONFIG_NAME (--config_name)", config_file_allowed=True)
    if args.tokenizer_name:
        if not os.path.isdir(args.tokenizer_name) or not _has_tokenizer(args.tokenizer_name):
            raise UsageError(f"TOKENIZER_NAME (--tokenizer_name)={args.tokenizer_name!r} is not a local folder "
                             f"with a tokenizer (one of {', '.join(TOKENIZER_VOCAB_FILES)})")
        return
    source = args.model_name_or_path or args.config_name
    if source:
        folder = (os.path.dirname(source) or ".") if os.path.isfile(source) else source
        if not _has_tokenizer(folder):
            variable = "MODEL_NAME_OR_PATH" if args.model_name_or_path else "CONFIG_NAME"
            raise UsageError(f"the {variable} folder {folder!r} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_VOCAB_FILES)}); set TOKENIZER_NAME (--tokenizer_name) to a "
                             "tokenizer folder")


def load_model_and_tokenizer(args: argparse.Namespace, build_model: bool = True) -> LoadedModel:
    """Fine-tuning (`--model_name_or_path`), pretraining (`--config_name`), or the offline tiny default.

    The model is built in fp32 (the optimizer's master weights; autocast picks the compute
    dtype) with the same seed on every rank. `build_model=False` returns only the tokenizer and
    the config (as `model=None`), for scripts that build the model themselves (e.g. on meta).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_model_paths(args)   # again: callers need not have run validate_common_args
    torch.manual_seed(args.seed)
    if args.model_name_or_path:
        mode, source = MODE_FINE_TUNING, args.model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path)
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        model = (AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
                 if build_model else None)
    elif args.config_name:
        mode, source = MODE_PRETRAINING, args.config_name
        config_dir = os.path.dirname(args.config_name) if os.path.isfile(args.config_name) else args.config_name
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or config_dir)
        config = AutoConfig.from_pretrained(args.config_name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32) if build_model else None
    else:
        from atorch.testing import tiny_llama_config
        from atorch.testing.assets import TOKENIZER_DIR, load_tokenizer

        mode, source = MODE_TINY, f"tiny Llama config, tokenizer {TOKENIZER_DIR}"
        tokenizer = load_tokenizer()
        config = tiny_llama_config()
        model = AutoModelForCausalLM.from_config(config) if build_model else None
    vocab = len(tokenizer)
    if vocab > config.vocab_size:
        raise UsageError(f"the tokenizer has {vocab} tokens but the model's vocab_size is {config.vocab_size}: "
                         "token ids would fall outside the embedding; use the model's own tokenizer")
    if model is not None:
        config = model.config
        config.use_cache = False  # training never reads the KV cache; keeping it costs memory
    if args.block_size > getattr(config, "max_position_embeddings", args.block_size):
        raise UsageError(f"--block_size={args.block_size} (BLOCK_SIZE) exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    return LoadedModel(model, tokenizer, config, mode, source)


def with_lora_adapters(flops: TransformerFlops, lora_summary: dict) -> TransformerFlops:
    """The FLOPs count once LoRA is on: the adapters are matmul weights too, and the only ones whose
    weight gradients are computed (the frozen base weights still pass activation gradients back)."""
    adapters = int(lora_summary["trainable_params"])
    return dataclasses.replace(flops, matmul_params=flops.matmul_params + adapters, trainable_matmul_params=adapters)


def learning_rate(args: argparse.Namespace, mode: str) -> float:
    if args.learning_rate is not None:
        return args.learning_rate
    if getattr(args, "use_lora", False):
        return TINY_LORA_LEARNING_RATE if mode == MODE_TINY else LORA_LEARNING_RATE
    return DEFAULT_LEARNING_RATES[mode]


def parameter_counts(model: nn.Module) -> dict:
    """Total and trainable elements (this rank's view), and trainable elements outside LoRA adapters."""
    total = trainable = outside = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
            outside += 0 if any(marker in name for marker in LORA_PARAMETER_MARKERS) else p.numel()
    return {"total": total, "trainable": trainable, "trainable_non_lora": outside}


def announce_parameters(model: nn.Module, lora_summary: Optional[dict] = None) -> None:
    """`params: total=... trainable=... trainable_non_lora=...` on rank 0.

    total/trainable come from the lora optimization's count (taken before sharding) when LoRA is
    on, else from this rank's view of the model. `trainable_non_lora` counts trainable elements
    outside LoRA adapters, maximum over ranks: 0 is what LoRA promises.
    """
    counts = parameter_counts(model)
    outside = torch.tensor([counts.pop("trainable_non_lora")], dtype=torch.int64, device=adist.device())
    if dist.is_initialized():
        dist.all_reduce(outside, op=dist.ReduceOp.MAX)
    if lora_summary is not None:
        counts = {"total": lora_summary["total_params"], "trainable": lora_summary["trainable_params"]}
    print_rank0(f"params: total={counts['total']} trainable={counts['trainable']} "
                f"trainable_non_lora={int(outside.item())}")


# -- Data ---------------------------------------------------------------------------------------------


def _is_preprocessed_prefix(path: str) -> Optional[str]:
    from atorch.data.indexed_dataset import data_path, index_path, strip_suffix

    prefix = strip_suffix(path)
    return prefix if data_path(prefix).is_file() and index_path(prefix).is_file() else None


def _check_not_half_a_pair(path: str) -> None:
    """A UsageError naming the missing file when DATASET_PATH names one file of a `.bin`/`.idx` pair (the file
    itself, or their prefix) and the other is missing; it would otherwise be read as a text corpus."""
    from atorch.data.indexed_dataset import data_path, index_path, strip_suffix

    prefix = strip_suffix(path)
    data, index = data_path(prefix), index_path(prefix)
    names_the_pair = path != prefix or not Path(path).exists()
    if names_the_pair and data.is_file() != index.is_file():
        there, missing = (data, index) if data.is_file() else (index, data)
        raise UsageError(f"DATASET_PATH (--dataset_path) {path!r}: {str(missing)!r} is missing next to {str(there)!r}; "
                         "a preprocessed corpus is both files (copy the other, or preprocess the corpus again)")


def _source_fingerprint(path: Path) -> List[Any]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenized_corpus(args: argparse.Namespace, tokenizer: Any) -> Tuple[str, str]:
    """(`.bin`/`.idx` prefix, source) of the training corpus, tokenizing (once, cached) when needed.

    No `--dataset_path`: the bundled corpus, with a logged notice. A path that does not exist is a
    UsageError naming it. The cache key covers the source files (path, size, mtime) and the
    tokenizer, so a changed corpus or tokenizer is tokenized again, never silently reused.
    """
    from atorch.data import DatasetPreprocessor
    from atorch.data.causal_lm import build_once_per_node
    from atorch.testing.assets import CORPUS_PATH

    if not args.dataset_path:
        if is_rank0():
            logger.warning("DATASET_PATH (--dataset_path) not set: training on the bundled corpus %s", CORPUS_PATH)
        source = CORPUS_PATH
    else:
        prefix = _is_preprocessed_prefix(args.dataset_path)
        if prefix is not None:
            return prefix, args.dataset_path
        _check_not_half_a_pair(args.dataset_path)
        source = Path(args.dataset_path)
        if not source.exists():
            raise UsageError(f"DATASET_PATH (--dataset_path) {args.dataset_path!r} does not exist; give a .txt or "
                             ".jsonl file, a directory of them, or a preprocessed .bin/.idx prefix")
    files = _source_fingerprint(source)
    key = hashlib.sha256(json.dumps([files, _tokenizer_fingerprint(tokenizer)]).encode("utf-8")).hexdigest()[:16]
    cache_dir = Path(args.data_cache_dir or Path(args.output_dir) / "data_cache")
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = str(cache_dir / f"{source.stem}-{key}")
    large = sum(size for _, size, _ in files) > 64 * 2 ** 20
    # A worker pool only pays off on a large corpus; the other ranks wait while local rank 0 builds.
    workers = max(1, min(16, (os.cpu_count() or 1) - 1)) if large else 1

    if _is_preprocessed_prefix(prefix) is None:
        check_has_document(source, tokenizer)   # every rank, so every rank says why; the build is rank 0's

    def build() -> None:
        logger.info("tokenizing %s into %s.bin/.idx (%d workers)", source, prefix, workers)
        DatasetPreprocessor(tokenizer, workers=workers).preprocess(source, prefix, progress_enabled=False)

    build_once_per_node(lambda: _is_preprocessed_prefix(prefix) is not None, build, f"the tokenized corpus {prefix}")
    return prefix, str(source)


def check_has_document(source: Path, tokenizer: Any) -> None:
    """Raise a UsageError when the corpus has no document that gives a token.

    Reads up to the first usable document (the first line of a real corpus), on every rank:
    the tokenization itself runs on one rank per node, and its failure would reach the other
    ranks only as "failed on the local rank 0".
    """
    from atorch.data import DatasetPreprocessor

    preprocessor = DatasetPreprocessor(tokenizer)
    try:   # the reader's ValueErrors (no corpus file in a directory, a JSON array, a suffix it cannot read) are usage
        documents = preprocessor.open(source)
        texts = iter(documents)
        try:
            if any(text and tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts):
                return
        finally:
            getattr(texts, "close", lambda: None)()   # a generator holding the file open
    except ValueError as e:
        raise UsageError(f"DATASET_PATH (--dataset_path) {str(source)!r}: {e}") from e
    first = f"; first problem: {documents.problems[0]}" if documents.problems else ""
    raise UsageError(f"DATASET_PATH (--dataset_path) {str(source)!r} has no usable document ({documents.problem_count} "
                     f"unusable lines{first}); give .txt lines of text or .jsonl objects with a 'text' key")


def load_train_dataset(args: argparse.Namespace, tokenizer: Any, global_batch_size: int, vocab_size: int) -> Any:
    """`DatasetForCausalLM` of `--block_size` tokens per sample over the tokenized corpus.

    `vocab_size` (the model's): a preprocessed corpus with a token id >= it is refused here, naming the file and
    the id (it would fail inside the embedding at the first step). The check reads the `.bin` once per node.
    """
    from atorch.data import DatasetForCausalLM

    prefix, source = tokenized_corpus(args, tokenizer)
    try:
        dataset = DatasetForCausalLM(prefix, max_seq_length=args.block_size, seed=args.seed, vocab_size=vocab_size)
    except ValueError as e:  # e.g. a block longer than the whole corpus, a token id outside the vocabulary
        raise UsageError(str(e)) from e
    if len(dataset) < global_batch_size:
        raise UsageError(f"the corpus {prefix!r} gives {len(dataset)} samples of {args.block_size} tokens, fewer than "
                         f"one global batch of {global_batch_size}; lower BLOCK_SIZE or the batch size")
    print_rank0(f"data: {len(dataset)} samples of {args.block_size} tokens from {source} (tokenized: {prefix}.bin)")
    return dataset


# -- Training loop ----------------------------------------------------------------------------------


class WarmupCosine:
    """LambdaLR factor: linear warm-up over `warmup` steps, then cosine decay to `floor` at `total`."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, max(total, 1), floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler_args(args: argparse.Namespace) -> dict:
    """`lr_scheduler_cls`/`lr_scheduler_args` for auto_accelerate."""
    return {"lr_scheduler_cls": torch.optim.lr_scheduler.LambdaLR,
            "lr_scheduler_args": {"lr_lambda": WarmupCosine(args.warmup_steps, args.max_steps)}}


def follow_schedule(scheduler: Any, args: argparse.Namespace) -> Optional[str]:
    """Extend a resumed WarmupCosine schedule to this run's MAX_STEPS; a line saying what it did (None: no such
    schedule).

    LambdaLR's state restores the lambda's attributes, so a run extended with a larger MAX_STEPS
    would keep the first run's cosine horizon and sit at the floor for the extra steps. MAX_STEPS
    counts the whole training ("resumed runs included"), so a larger one extends the schedule to
    it (with this run's --warmup_steps), as Hugging Face's Trainer rebuilds the schedule from the
    new max_steps on resume: the LR continues from this step's value on the longer curve. A smaller
    MAX_STEPS only stops the run early (a job that trains a planned schedule in chunks): the planned
    horizon stays, so the steps trained are exactly those of the uninterrupted run.
    """
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not lambdas or not all(isinstance(f, WarmupCosine) for f in lambdas):
        return None
    planned = max(f.total for f in lambdas)
    if args.max_steps <= planned:
        return f"the learning-rate schedule keeps its horizon of {planned} steps; this run stops at MAX_STEPS"
    for f in lambdas:
        f.warmup, f.total = args.warmup_steps, args.max_steps
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    return f"the learning-rate schedule is extended from {planned} to MAX_STEPS={args.max_steps} steps"


class BatchStream:
    """Batches of a DataLoader over epochs (`set_epoch` each), counting the loader batches of each epoch."""

    def __init__(self, dataloader: Any, epoch: int = 0, batches_in_epoch: int = 0) -> None:
        self.dataloader = dataloader
        self.epoch = epoch
        self.batches_in_epoch = batches_in_epoch
        self._iterator: Optional[Iterator[Any]] = None

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # an exhausted epoch starts the next one; an empty one is an error
            if self._iterator is None:
                sampler = getattr(self.dataloader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epoch)
                self._iterator = iter(self.dataloader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.epoch += 1
                self.batches_in_epoch = 0
                continue
            self.batches_in_epoch += 1
            return batch
        raise RuntimeError("the dataloader yields no batch: the dataset is smaller than one batch per rank")


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (every rank must call)."""
    if not dist.is_initialized():
        return float(value)
    t = value.detach().to(adist.device(), torch.float64).reshape(1)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def build_meter(args: argparse.Namespace, flops: TransformerFlops, global_batch_size: int,
                compute_dtype: Optional[torch.dtype]) -> ThroughputMeter:
    """The throughput meter; rank 0 measures or looks up the device peak and says which it used."""
    device = adist.device()
    tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    peak = device_peak(device, dtype_name(compute_dtype, tf32), args.peak_tflops) if is_rank0() else None
    if peak is not None:
        peak_text = f"{peak.tflops:.4g} TFLOPs" if peak.tflops else "unknown"
        print_rank0(f"metrics: model FLOPs/token={flops.model_flops_per_token:.4g} (6N + attention, N="
                    f"{flops.matmul_params} matmul params, embeddings excluded), hardware FLOPs/token="
                    f"{flops.hardware_flops_per_token:.4g}; peak {peak_text} = {peak.source}; peak memory = "
                    f"{peak_memory_mb(device)[1]}")
    return ThroughputMeter(flops, global_batch_size, args.block_size, adist.world_size(),
                           peak or DevicePeak(None, "rank 0 reports"), device)


def train_loop(args: argparse.Namespace, run_step: Callable[[], torch.Tensor], meter: ThroughputMeter,
               start_step: int = 0, on_step_end: Optional[Callable[[int], None]] = None) -> List[StepMetrics]:
    """Run optimizer steps `start_step+1 .. max_steps`; print a metrics line every `log_steps` on rank 0.

    `run_step()` does one optimizer step and returns this rank's loss; `on_step_end(step)` runs
    after each step (checkpointing). Returns the metrics reported (rank 0; the others' are empty).
    """
    reported: List[StepMetrics] = []
    window: List[torch.Tensor] = []
    tracker = MetricsLogger(str(Path(args.output_dir) / "logs"), getattr(args, "log_with", None))
    bar = tqdm(total=args.max_steps, initial=start_step, desc="train", unit="step", disable=not is_rank0(),
               mininterval=5.0, file=sys.stderr)
    meter.start()
    try:
        for step in range(start_step + 1, args.max_steps + 1):
            window.append(run_step().detach().float().reshape(()))
            meter.step()
            bar.update(1)
            if step % args.log_steps == 0 or step == args.max_steps:
                loss = mean_over_ranks(torch.stack(window).mean())
                window.clear()
                metrics = meter.report(step, loss)
                if is_rank0():
                    print(metrics.format(), flush=True)
                    tracker.log(metrics, step)
                    bar.set_postfix_str(f"loss {loss:.4f}")
                    reported.append(metrics)
            if on_step_end is not None:
                with meter.paused():  # checkpoint saves are not training throughput
                    on_step_end(step)
    finally:
        bar.close()
        tracker.close()
    return reported


# -- Checkpoints ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, read before anything is loaded."""

    path: str
    step: int
    lora_enabled: bool
    """Whether it was trained with LoRA adapters (its tensors are then the adapted model's)."""
    data_position: Optional[dict] = None
    """meta.json's data position (JSON), checked against this run's global batch before anything loads."""


def _trained_with_lora(meta: dict) -> bool:
    names = [item if isinstance(item, str) else item[0] for item in meta.get("strategy") or []
             if isinstance(item, str) or (isinstance(item, list) and item)]
    model = meta.get("model") or {}
    return "lora" in names or bool(model.get("peft_adapter") or model.get("tp_lora"))


def locate_resume(args: argparse.Namespace) -> Optional[ResumePoint]:
    """The checkpoint `--resume` names (None: start from step 0), checked against this run's arguments.

    Reads only the checkpoint's manifest and meta.json, on every rank before the process group
    starts, so a wrong RESUME, a MAX_STEPS below the checkpoint's step or a LoRA mismatch is
    a one-line error instead of a failure after loading the model, the data and the checkpoint.
    """
    from atorch.checkpoint import manifest as mf

    if args.resume is None:
        return None
    try:
        if args.resume == "latest":
            directory = Path(args.output_dir) / "checkpoints"
            path = mf.read_latest(str(directory))
            if path is None:
                print_rank0(f"resume: no checkpoint in {directory} yet; starting from step 0")
                return None
        else:
            path = mf.resolve_checkpoint_dir(args.resume)
        meta = mf.read_json(path, "meta.json")
    except mf.CheckpointError as e:
        raise UsageError(f"RESUME (--resume)={args.resume!r}: {e}") from None
    step = int(meta.get("step") or 0) if isinstance(meta, dict) else 0
    position = meta.get("data_position") if isinstance(meta, dict) else None
    point = ResumePoint(path, step, isinstance(meta, dict) and _trained_with_lora(meta),
                        position if isinstance(position, dict) else None)
    if step > args.max_steps:
        raise UsageError(f"MAX_STEPS (--max_steps)={args.max_steps} is below the step {step} of the checkpoint "
                         f"{path}; MAX_STEPS counts every step, resumed ones included: give MAX_STEPS > {step} "
                         "to train further")
    if point.lora_enabled and not getattr(args, "use_lora", False):
        raise UsageError(f"the checkpoint {path} was trained with LoRA adapters but USE_LORA (--use_lora) is off; "
                         "resume with USE_LORA=1, or export it with `atorch merge` and start a new run from the "
                         "merged folder with MODEL_NAME_OR_PATH")
    if not point.lora_enabled and getattr(args, "use_lora", False):
        raise UsageError(f"the checkpoint {path} was trained without LoRA but USE_LORA (--use_lora) is on; a resume "
                         "continues the same training: resume with USE_LORA=0, or to fine-tune it with LoRA, export "
                         "it with `atorch merge` and start a new run from the merged folder with MODEL_NAME_OR_PATH")
    return point


def nothing_to_train(args: argparse.Namespace, point: Optional[ResumePoint]) -> bool:
    """True (and says so) when the checkpoint resumed is already at MAX_STEPS: the run trains and writes nothing.

    Saving again would only rewrite the same state; returning before the process group starts
    also skips loading the model and the data for no step.
    """
    if point is None or point.step < args.max_steps:
        return False
    print_rank0(f"resume: the checkpoint {point.path} is at step {point.step} = MAX_STEPS (--max_steps): nothing "
                "to train, no checkpoint written; raise MAX_STEPS to train further")
    return True


class Checkpointer:
    """`atorch.checkpoint` saves under OUTPUT_DIR/checkpoints/step_N every `save_steps` and at the end,
    keeping the newest `save_total_limit`; `resume()` restores the model, optimizer, scheduler, RNG and
    data position from `--resume`. `strict=False` lets each rank load only the tensors it holds of a
    checkpoint that has more (a pipeline stage); tensors the rank needs must still all be there.
    `tokenizer` is saved with every checkpoint, so the merged Hugging Face folder has it.
    """

    def __init__(self, args: argparse.Namespace, result: Any, strict: bool = True, tokenizer: Any = None,
                 resume_from: Optional[ResumePoint] = None) -> None:
        self.args = args
        self.result = result
        self.strict = strict
        self.tokenizer = tokenizer   # recorded with each checkpoint, so merge_checkpoint copies it
        self.resume_from = resume_from   # locate_resume's answer, checked before anything was loaded
        self.directory = Path(args.output_dir) / "checkpoints"
        self.stream: Optional[BatchStream] = None
        self.last_saved_step: Optional[int] = None
        self.state_step = 0
        """The step the training state is at: the only label a checkpoint of it may carry."""

    def resume(self) -> int:
        """Load `resume_from` (if any) and return the step to continue from; sets `self.stream`."""
        from atorch.checkpoint import load_checkpoint

        self.stream = BatchStream(self.result.dataloader)
        if self.resume_from is None:
            return 0
        self._check_data_position(self.resume_from)
        state = load_checkpoint(self.result, self.resume_from.path, strict=self.strict)
        step = int(state.step or 0)
        self.state_step = step
        schedule = follow_schedule(self.result.lr_scheduler, self.args)   # restored: the first run's horizon
        if Path(state.path).resolve().parent == self.directory.resolve():
            self.last_saved_step = step  # already on disk where this run saves: the final save skips it
        position = state.data_position
        if state.dataloader is not None and position is not None:
            self.stream = BatchStream(state.dataloader, position.epoch, position.batches_in_epoch)
        print_rank0(f"resume: loaded {state.path} at step {step} (data: epoch {position.epoch if position else 0}, "
                    f"{position.batches_in_epoch if position else 0} loader batches in)")
        if schedule is not None:
            print_rank0(f"resume: {schedule}")
        return step

    def _loader_batch(self) -> int:
        """Samples in one loader batch over every data-parallel rank: the unit of a saved data position."""
        return self.result.dataloader.batch_size * self.result.args["data_parallel_size"]

    def _check_data_position(self, point: ResumePoint) -> None:
        """A UsageError (on every rank: it depends only on the checkpoint and the batch) when the checkpoint stopped
        where this run's global batch cannot continue without repeating or skipping samples."""
        from atorch.checkpoint.state import DataPosition, convert_position

        if point.data_position:
            try:
                convert_position(DataPosition.from_json(point.data_position), self._loader_batch())
            except ValueError as e:
                raise UsageError(f"RESUME (--resume)={point.path!r}: {e}") from None

    def on_step_end(self, step: int) -> None:
        self.state_step = step
        if self.args.save_steps and step % self.args.save_steps == 0:
            self.save(step)

    def save_final(self) -> None:
        """Save the state where training stopped (skipped when that step is already saved here)."""
        self.save(self.state_step)

    def save(self, step: int) -> None:
        from atorch.checkpoint import DataPosition, save_checkpoint

        if step != self.state_step:
            # A checkpoint labelled step_N must hold the state after step N: resuming it repeats or skips steps.
            raise RuntimeError(f"save(step={step}) but the training state is at step {self.state_step}")
        if step == self.last_saved_step:
            return
        assert self.stream is not None, "resume() sets the stream before training"
        # The position counts loader batches; one spans every data-parallel rank (micro-batches under 3D).
        position = DataPosition(self.stream.epoch, self.stream.batches_in_epoch, self._loader_batch())
        path = save_checkpoint(self.result, str(self.directory / f"step_{step}"), step=step, data_position=position,
                               keep_last=self.args.save_total_limit, tokenizer=self.tokenizer)
        self.last_saved_step = step
        print_rank0(f"checkpoint: saved {path}")


def finish() -> None:
    """Barrier, then destroy the process group. Callers drop their wrapped model (`del result`) first:
    destroying the group under a live wrapped model hung about one run in two on gloo (measured)."""
    if dist.is_initialized():
        dist.barrier()
        adist.destroy_distributed()
