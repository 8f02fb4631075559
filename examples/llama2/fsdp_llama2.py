"""Train Llama 2 with FSDP (ZeRO-3), bf16 autocast and activation checkpointing through `auto_accelerate`.

Launch with the entry script, which turns environment variables into the arguments below:

    examples/llama2/fsdp_llama2_entry.sh                                  # tiny offline default
    MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf DATASET_PATH=/data/c.jsonl examples/llama2/fsdp_llama2_entry.sh

or directly: `python -m atorch.distributed.run --nproc_per_node 2 examples/llama2/fsdp_llama2.py --max_steps 20`.
`--use_lora` trains LoRA adapters only; `--use_fp8` adds float8 linears (FP8 GPUs only).
"""

from __future__ import annotations

import argparse
from typing import Any, List

import torch

import example_utils as eu
from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.utils.metrics import TransformerFlops


def build_strategy(args: argparse.Namespace) -> List[Any]:
    """The optimizations, in the order they apply (auto_accelerate sorts them the same way)."""
    strategy: List[Any] = ["parallel_mode"]                 # every rank data-parallel: FSDP shards over all
    if args.use_lora:
        strategy.append("lora")                            # rank-8 adapters first, so checkpoint/FSDP wrap them
    strategy.append("checkpoint")                          # recompute each decoder layer in backward
    strategy.append(("amp_native", {"dtype": "bf16"}))     # bf16 compute, fp32 master weights
    if args.use_fp8:
        strategy.append("fp8")                             # float8 matmuls in the decoder linears
    strategy.append("fsdp")                                # FSDP2, one unit per decoder layer
    return strategy


def main(args: argparse.Namespace) -> None:
    eu.validate_common_args(args)
    eu.check_fp8_supported(args.use_fp8)   # before loading anything: a CPU or pre-Hopper machine fails now
    resume_from = eu.locate_resume(args)   # a wrong RESUME or MAX_STEPS fails here, on every rank
    if eu.nothing_to_train(args, resume_from):
        return
    adist.init_distributed()
    eu.announce_launch()
    loaded = eu.load_model_and_tokenizer(args)
    # FSDP makes every rank a data-parallel rank: the global batch is per-device x world size.
    global_batch = args.per_device_train_batch_size * adist.world_size()
    dataset = eu.load_train_dataset(args, loaded.tokenizer, global_batch, loaded.config.vocab_size)
    # Counted on the unwrapped model: FSDP replaces parameters with shards.
    flops = TransformerFlops.from_model(loaded.model, seq_len=args.block_size, checkpointing_enabled=True)
    lr = eu.learning_rate(args, loaded.mode)
    eu.print_rank0(f"model: {loaded.mode} ({loaded.source}); strategy {build_strategy(args)}; lr {lr}; "
                   f"global batch {global_batch} x {args.block_size} tokens")

    status, result, _ = auto_accelerate(
        loaded.model, optim_func=torch.optim.AdamW, dataset=dataset,
        optim_args={"lr": lr, "weight_decay": args.weight_decay}, model_input_format="unpack_dict",
        dataloader_args={"batch_size": global_batch, "shuffle": True, "seed": args.seed},
        load_strategy=build_strategy(args), **eu.lr_scheduler_args(args))
    if not status:
        raise SystemExit("auto_accelerate could not apply the strategy; the reason is logged above")
    tokenizer = loaded.tokenizer   # saved with each checkpoint
    del loaded
    lora = result.args.get("lora")
    if lora is not None:
        flops = eu.with_lora_adapters(flops, lora)
    eu.announce_parameters(result.model, lora)

    checkpointer = eu.Checkpointer(args, result, tokenizer=tokenizer, resume_from=resume_from)
    start_step = checkpointer.resume()
    meter = eu.build_meter(args, flops, global_batch, compute_dtype=torch.bfloat16)
    stream = checkpointer.stream
    eu.train_loop(args, lambda: train_step(result, next(stream)), meter, start_step,
                  on_step_end=checkpointer.on_step_end)
    checkpointer.save_final()
    del result, checkpointer, stream
    eu.finish()


def build_parser() -> argparse.ArgumentParser:
    parser = eu.common_parser(__doc__.splitlines()[0])
    eu.add_lora_fp8_args(parser)
    parser.set_defaults(output_dir="./outputs/fsdp_llama2")
    return parser


if __name__ == "__main__":
    eu.run_main(main, build_parser())
