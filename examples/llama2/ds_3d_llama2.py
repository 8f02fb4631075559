"""Train Llama 2 with DeepSpeed 3D parallelism (tensor x pipeline x data) through `auto_accelerate`.

Launch with the entry script, which turns environment variables into the arguments below:

    examples/llama2/ds_3d_llama2_entry.sh                                          # tiny default: 2 stages
    NPROC_PER_NODE=4 PIPELINE_PARALLEL_SIZE=2 examples/llama2/ds_3d_llama2_entry.sh  # (tensor 1, pipeline 2, data 2)

Pretraining and the tiny default build the model under `record_module_init`: nothing is allocated
until the pipeline keeps only this rank's stage (and tensor-parallel slice). Fine-tuning loads the
checkpoint on every rank first (host memory: one full fp32 model per process), then slices it.
One optimizer step = ACCU_STEPS micro-batches of MICRO_BATCH_SIZE per data-parallel rank.
"""

from __future__ import annotations

import argparse
from typing import Any, List

import torch

import example_utils as eu
from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.auto.opt_lib.ds_3d_parallel_optimization import (
    DeepSpeed3DParallelConfig,
    get_custom_patcher,
    get_tpinfo,
)
from atorch.utils.meta_model_utils import record_module_init
from atorch.utils.metrics import TransformerFlops


def parallel_sizes(args: argparse.Namespace, world_size: int) -> tuple:
    """(tensor, data, pipeline) for this world, or a UsageError with the numbers."""
    tp, pp = args.model_parallel_size, args.pipeline_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise eu.UsageError(f"the world size {world_size} is not divisible by MODEL_PARALLEL_SIZE={tp} x "
                            f"PIPELINE_PARALLEL_SIZE={pp}; the data-parallel size is world / (tensor x pipeline)")
    return tp, world_size // (tp * pp), pp


def build_strategy(args: argparse.Namespace, model_config: Any, tp: int, dp: int, pp: int) -> List[Any]:
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.accu_steps,
        # bf16 compute on GPUs; on CPU, fp32 (DeepSpeed's bf16 optimizer wrapper targets accelerators).
        "bf16": {"enabled": torch.cuda.is_available()},
        # Optimizer state sharded over the data-parallel ranks (the pipeline engine allows ZeRO 0 or 1).
        "zero_optimization": {"stage": 1},
        "steps_per_print": 2 ** 31 - 1,   # the example prints its own metrics line
    }
    config = DeepSpeed3DParallelConfig(
        base_seed=args.seed,                          # weights of a meta model: seeded, identical on every rank
        tpinfo=get_tpinfo(model_config),              # which linears split how inside a stage (Llama preset)
        custom_patcher=get_custom_patcher(model_config),  # the model's pieces in forward order (Llama preset)
        ds_config=ds_config)
    # tensor varies fastest, then data, then pipeline: DeepSpeed's own (model, data, pipe) rank order.
    return [("parallel_mode", ([("tensor", tp), ("data", dp), ("pipeline", pp)], None)),
            ("deepspeed_3d_parallel", config)]


def main(args: argparse.Namespace) -> None:
    eu.validate_common_args(args)
    for name in ("micro_batch_size", "accu_steps", "model_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) < 1:
            raise eu.UsageError(f"{name.upper()} (--{name})={getattr(args, name)} must be >= 1")
    resume_from = eu.locate_resume(args)   # a wrong RESUME or MAX_STEPS fails here, on every rank
    if eu.nothing_to_train(args, resume_from):
        return
    adist.init_distributed()
    eu.announce_launch()
    tp, dp, pp = parallel_sizes(args, adist.world_size())
    loaded = eu.load_model_and_tokenizer(args, build_model=args.model_name_or_path is not None)
    model = loaded.model
    if model is None:
        from transformers import AutoModelForCausalLM

        with record_module_init():   # meta tensors + the recipe to rebuild each piece where it lands
            model = AutoModelForCausalLM.from_config(loaded.config)
    global_batch = args.micro_batch_size * args.accu_steps * dp
    dataset = eu.load_train_dataset(args, loaded.tokenizer, global_batch, loaded.config.vocab_size)
    # Counted on the whole (meta or real) model: the pipeline keeps one stage per rank.
    flops = TransformerFlops.from_model(model, seq_len=args.block_size)
    lr = eu.learning_rate(args, loaded.mode)
    eu.print_rank0(f"model: {loaded.mode} ({loaded.source}); layout tensor={tp} data={dp} pipeline={pp}; lr {lr}; "
                   f"global batch {global_batch} = micro {args.micro_batch_size} x accu {args.accu_steps} x data "
                   f"{dp}, {args.block_size} tokens each")

    status, result, _ = auto_accelerate(
        model, optim_func=torch.optim.AdamW, dataset=dataset,
        optim_args={"lr": lr, "weight_decay": args.weight_decay}, model_input_format="unpack_dict",
        dataloader_args={"batch_size": global_batch, "shuffle": True, "seed": args.seed},
        load_strategy=build_strategy(args, loaded.config, tp, dp, pp), **eu.lr_scheduler_args(args))
    if not status:
        raise SystemExit("auto_accelerate could not apply the strategy; the reason is logged above")
    tokenizer = loaded.tokenizer   # saved with each checkpoint
    del loaded, model
    eu.announce_parameters(result.model)

    checkpointer = eu.Checkpointer(args, result, tokenizer=tokenizer, resume_from=resume_from)
    start_step = checkpointer.resume()
    meter = eu.build_meter(args, flops, global_batch,
                           compute_dtype=torch.bfloat16 if torch.cuda.is_available() else None)
    stream = checkpointer.stream
    # Each step hands the engine ACCU_STEPS micro-batches (the dataloader yields micro-batches).
    eu.train_loop(args, lambda: train_step(result, [next(stream) for _ in range(args.accu_steps)]), meter,
                  start_step, on_step_end=checkpointer.on_step_end)
    checkpointer.save_final()
    del result, checkpointer, stream
    eu.finish()


def build_parser() -> argparse.ArgumentParser:
    parser = eu.common_parser(__doc__.splitlines()[0], per_device_batch=False)
    group = parser.add_argument_group("3D parallelism")
    group.add_argument("--model_parallel_size", type=int, default=1, help="tensor-parallel degree")
    group.add_argument("--pipeline_parallel_size", type=int, default=2, help="pipeline stages")
    group.add_argument("--micro_batch_size", type=int, default=2, help="samples per micro-batch per data rank")
    group.add_argument("--accu_steps", type=int, default=4, help="micro-batches per optimizer step")
    parser.set_defaults(output_dir="./outputs/ds_3d_llama2")
    return parser


if __name__ == "__main__":
    eu.run_main(main, build_parser())
