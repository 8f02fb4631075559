"""The `atorch` command: `run` (the launcher), `plan` (strategies for a cluster), `merge`, `env`, `convert-strategy`,
`preprocess` (tokenize a corpus into Megatron .bin/.idx files).

    atorch run --nproc_per_node 8 train.py ARGS
    atorch plan --model llama2-7b --nproc 8 --nnodes 8 --device h100 --global-batch 512 --seq 4096
    atorch merge ckpt/step_1000 hf_model/ --tokenizer tok/
    atorch env
    atorch convert-strategy atorch_strategy.pkl strategy.json
    atorch preprocess --input web.jsonl --output-prefix data/web --tokenizer tok/ --workers 8
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import sys
from typing import Any, List, Optional


def _run(argv: List[str]) -> int:
    from atorch.distributed.run import run_help

    if not argv or argv[0] in ("-h", "--help"):
        # Asked for help: stdout, 0; no script to run is a usage error: stderr, 2 (as argparse does).
        print(run_help("atorch run"), file=sys.stdout if argv else sys.stderr)
        if not argv:
            print("atorch run: error: give the training script to launch", file=sys.stderr)
        return 0 if argv else 2
    from atorch.distributed.run import main as run_main

    run_main(argv)
    return 0


def _plan(argv: List[str]) -> int:
    from atorch.auto.devices import DEVICES
    from atorch.auto.search.cluster_plan import (MODEL_PRESETS, check_causal_lm, check_seq_len, load_model_config,
                                                 plan_cluster)

    parser = argparse.ArgumentParser(prog="atorch plan", description=(
        "Rank candidate strategies for a model on a cluster with the cost model: memory per device and predicted "
        "step time, and what does not fit. Builds the model on the meta device; needs no GPU. Exits 1 when no "
        "candidate fits in device memory."))
    parser.add_argument("--model", required=True,
                        help=f"a config.json, a model directory, or a preset: {', '.join(sorted(MODEL_PRESETS))}")
    parser.add_argument("--nproc", type=int, required=True, help="devices per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--device", default="h100", choices=sorted(DEVICES))
    parser.add_argument("--device-memory-gb", type=float, default=None, help="override the device's memory")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step, all devices")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sample")
    parser.add_argument("--top", type=int, default=15, help="rows shown")
    args = parser.parse_args(argv)
    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes), ("--global-batch", args.global_batch),
                        ("--seq", args.seq), ("--top", args.top)):
        if value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    gb = args.device_memory_gb
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        parser.error(f"--device-memory-gb={gb} must be a positive number of GB (unset: the device's own memory)")
    try:
        config = load_model_config(args.model)
        try:
            check_causal_lm(config)       # before anything slow: the model is built only for causal LMs
        except ValueError as e:
            raise ValueError(f"--model {args.model!r}: {e}") from None
        check_seq_len(config, args.seq, "--seq")
        memory = int(gb * 1e9) if gb is not None else None
        result = plan_cluster(config, args.nproc * args.nnodes, args.device, args.global_batch, args.seq,
                              nnodes=args.nnodes, device_memory_bytes=memory)
    except ValueError as e:
        parser.error(str(e))
    print(result.format(args.top))
    # Nothing fits: the answer is no, and a script calling this should see it in the exit code.
    return 1 if result.table.empty else 0


def _merge(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="atorch merge",
                                     description="Write an atorch checkpoint as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="a checkpoint directory (or its parent with a `latest` pointer)")
    parser.add_argument("out", help="the Hugging Face directory to write: new, or an existing one (an earlier "
                                    "model's config and weight files are replaced, other files are kept)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory to copy into OUT")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--lora", choices=("merge", "adapters"), default="merge")
    args = parser.parse_args(argv)
    from atorch.checkpoint import merge_checkpoint

    try:
        out = merge_checkpoint(args.checkpoint, args.out, tokenizer=args.tokenizer,
                               max_shard_size=args.max_shard_size, lora=args.lora)
    except (ValueError, TypeError, FileNotFoundError) as e:   # a bad path or option (CheckpointError included)
        parser.error(str(e))
    print(f"merged {args.checkpoint} -> {out}")
    return 0


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - report, do not fail
        return f"not available ({type(e).__name__})"


def _env(argv: List[str]) -> int:
    argparse.ArgumentParser(prog="atorch env", description="Versions, devices, backends, DeepSpeed ops.").parse_args(
        argv)
    import torch
    import torch.distributed as dist

    import atorch

    lines = [f"atorch {atorch.__version__}", f"python {platform.python_version()} ({sys.executable})",
             f"platform {platform.platform()}"]
    for name in ("torch", "transformers", "deepspeed", "peft", "hebo", "numpy", "pandas", "safetensors"):
        lines.append(f"{name} {_version(name)}")
    lines.append(f"cuda available: {torch.cuda.is_available()}"
                 + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
                    if torch.cuda.is_available() else ""))
    lines.append(f"cpu threads: {torch.get_num_threads()}, cores: {os.cpu_count()}")
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    lines.append(f"distributed backends: {', '.join(backends) or 'none'}")
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    built = sorted(os.listdir(ext)) if ext and os.path.isdir(ext) else []
    lines.append(f"DeepSpeed ops: {ext} ({', '.join(built) if built else 'none built'})")
    print("\n".join(lines))
    return 0


def _convert_strategy(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="atorch convert-strategy", description=(
        "Read a strategy file (ATorch's pickle, read without executing anything, or JSON) and write it as JSON."))
    parser.add_argument("src")
    parser.add_argument("dst", help="the JSON file to write (its folder must exist)")
    args = parser.parse_args(argv)
    from atorch.auto.strategy import Strategy

    problem = _destination_problem(args.dst)
    if problem:
        parser.error(f"dst {args.dst!r} {problem}")
    try:
        strategy = Strategy.load(args.src)
        _check_strategy_items(strategy)
        strategy.save(args.dst)
        print(strategy.describe())
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:   # what the checks above cannot foresee (permissions, a full disk)
        parser.error(f"writing dst {args.dst!r} failed: {e.strerror or e}")
    return 0


def _check_strategy_items(strategy: Any) -> None:
    """Every item names a registered optimization and its config parses (ValueError naming the item): a
    converted file that auto_accelerate would refuse is refused now, not at the start of a training job."""
    from atorch.auto.opt_lib import get_optimization

    for index, item in enumerate(strategy):
        optimization = get_optimization(item.name)       # ValueError naming the valid optimizations
        try:
            optimization.parse_config(item.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"item {index} ({item.name}): {e}") from None


def _destination_problem(dst: str) -> Optional[str]:
    """Why `dst` cannot be written as a file, or None; checked before reading the source."""
    if os.path.isdir(dst):
        return "is a directory; give the path of the JSON file to write, e.g. DIR/strategy.json"
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        return f"is in {parent}, which is not an existing directory; create it first"
    return None


def _preprocess(argv: List[str]) -> int:
    from atorch.data.preprocess import main as preprocess_main

    return preprocess_main(argv, prog="atorch preprocess")


COMMANDS = {"run": _run, "plan": _plan, "merge": _merge, "env": _env, "convert-strategy": _convert_strategy,
            "preprocess": _preprocess}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\natorch: unknown command {argv[0]!r}; commands are {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    except BrokenPipeError:
        # The reader went away (`atorch plan ... | head`): nothing more to say, and no traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
