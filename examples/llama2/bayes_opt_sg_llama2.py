"""Let atorch find the strategy: `auto_accelerate` with no strategy searches (Bayesian optimization over dry runs).

Launch with the entry script, which turns environment variables into the arguments below and
exports the search's own variables (BO_SG_MAX_IETR trials, RANDOM_SAMPLE random ones first):

    examples/llama2/bayes_opt_sg_llama2_entry.sh                          # tiny offline default
    BO_SG_MAX_IETR=20 MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf examples/llama2/bayes_opt_sg_llama2_entry.sh

The search writes its trial table and plot to OUTPUT_DIR/search/ (trials.csv, search.png) and the
winner to OUTPUT_DIR/best_strategy.json; training then continues with the winner. Reuse it later
with `auto_accelerate(..., load_strategy="OUTPUT_DIR/best_strategy.json")`: no second search.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import example_utils as eu
from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.utils.metrics import TransformerFlops


def check_search_settings() -> None:
    """BO_SG_MAX_IETR, RANDOM_SAMPLE, the search's other variables and the dry runs' (ATORCH_DRYRUN_*), read as
    the planner and the dry runner will read them.

    They read them inside auto_accelerate, after the model and the data are loaded;
    a bad value is a usage error now instead.
    """
    from atorch.auto.dry_runner import DryRunConfig
    from atorch.auto.search.auto_search import SearchSettings

    try:
        SearchSettings.from_env()
        DryRunConfig.from_env().validate()
    except ValueError as e:
        raise eu.UsageError(str(e)) from None


def main(args: argparse.Namespace) -> None:
    eu.validate_common_args(args)
    eu.check_fp8_supported(args.use_fp8)
    check_search_settings()
    resume_from = eu.locate_resume(args)   # a wrong RESUME or MAX_STEPS fails here, on every rank
    if eu.nothing_to_train(args, resume_from):
        return
    # Forced into every candidate the planner tries (the rest of the space is searched).
    included = [name for name, on in (("lora", args.use_lora), ("fp8", args.use_fp8)) if on]
    adist.init_distributed()
    eu.announce_launch()
    loaded = eu.load_model_and_tokenizer(args)
    # Fixed while the planner searches, so every candidate trains the same samples per step,
    # whatever data-parallel size it picks.
    global_batch = args.per_device_train_batch_size * adist.world_size()
    dataset = eu.load_train_dataset(args, loaded.tokenizer, global_batch, loaded.config.vocab_size)
    # Both counts now, on the unwrapped model; which one applies depends on the strategy found.
    flops_by_checkpointing = {enabled: TransformerFlops.from_model(loaded.model, args.block_size, enabled)
                              for enabled in (False, True)}
    lr = eu.learning_rate(args, loaded.mode)
    output_dir = Path(args.output_dir)
    best_path = output_dir / "best_strategy.json"
    # A resumed run keeps the strategy the first run found instead of searching again.
    load_strategy = str(best_path) if args.resume is not None and best_path.is_file() else None
    if load_strategy is None:
        how = (f"searching with BO_SG_MAX_IETR={os.environ.get('BO_SG_MAX_IETR', 'default')} "
               f"RANDOM_SAMPLE={os.environ.get('RANDOM_SAMPLE', 'default')}")
    else:
        how = f"resuming with the strategy found before, {best_path}"
    eu.print_rank0(f"model: {loaded.mode} ({loaded.source}); {how}; lr {lr}; global batch {global_batch} x "
                   f"{args.block_size} tokens")

    status, result, strategy = auto_accelerate(
        loaded.model, optim_func=torch.optim.AdamW, dataset=dataset,
        optim_args={"lr": lr, "weight_decay": args.weight_decay}, model_input_format="unpack_dict",
        dataloader_args={"batch_size": global_batch, "shuffle": True, "seed": args.seed},
        load_strategy=load_strategy, save_strategy_to_file=str(best_path),
        report_path=str(output_dir / "search"), included=included or None, **eu.lr_scheduler_args(args))
    if not status:
        raise SystemExit("auto_accelerate could not apply the strategy it found; the reason is logged above")
    tokenizer = loaded.tokenizer   # saved with each checkpoint
    del loaded
    if load_strategy is None:
        report = result.args.get("search_report") or {}
        eu.print_rank0(f"search: best strategy {strategy.describe()}; saved to {best_path}; trial plot "
                       f"{report.get('plot')}; trial table {report.get('table')}")
    lora = result.args.get("lora")
    eu.announce_parameters(result.model, lora)

    applied = result.args["strategy"]
    flops = flops_by_checkpointing["checkpoint" in applied]
    if lora is not None:
        flops = eu.with_lora_adapters(flops, lora)
    compute_dtype = result.args.get("autocast_dtype") or result.args.get("half_dtype")
    checkpointer = eu.Checkpointer(args, result, tokenizer=tokenizer, resume_from=resume_from)
    start_step = checkpointer.resume()
    meter = eu.build_meter(args, flops, global_batch, compute_dtype=compute_dtype)
    stream = checkpointer.stream
    eu.train_loop(args, lambda: train_step(result, next(stream)), meter, start_step,
                  on_step_end=checkpointer.on_step_end)
    checkpointer.save_final()
    del result, checkpointer, stream
    eu.finish()


def build_parser() -> argparse.ArgumentParser:
    parser = eu.common_parser(__doc__.splitlines()[0])
    eu.add_lora_fp8_args(parser)
    parser.set_defaults(output_dir="./outputs/bayes_opt_sg_llama2")
    return parser


if __name__ == "__main__":
    eu.run_main(main, build_parser())
