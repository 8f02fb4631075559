"""Train the tiny Llama for a few steps with data parallelism, one process per rank started by Slurm.

    srun -N1 -n2 python examples/slurm/train.py --steps 3 [--out DIR]
    sbatch examples/slurm/train.sbatch

No launcher: `atorch.init_distributed()` reads each task's rank, the world size and the
rendezvous host from Slurm's variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the
step's first node; see atorch/distributed/slurm.py). Rank 0 prints the global loss of every step
(the mean of the ranks' losses). With `--out DIR` every rank also writes DIR/rank<R>.json: what it
was told by Slurm and atorch, its losses and a checksum of its trained weights, so a test can
check that the ranks were distinct and trained in step.
"""

import argparse
import json
import os
import socket
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

import atorch
from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (over as many epochs as they take)")
    parser.add_argument("--global_batch", type=int, default=8, help="samples per step over all ranks")
    parser.add_argument("--out", default="", help="directory for one JSON file per rank")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments, with the mistakes no world size fixes refused as usage errors (exit 2) on every rank."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--global_batch", args.global_batch)):
        if value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    if args.global_batch > len(TokenDataset()):
        parser.error(f"--global_batch={args.global_batch} exceeds the {len(TokenDataset())} samples of the dataset")
    return args


def batches(dataloader: Any, steps: int) -> Iterator[Any]:
    """`steps` batches of `dataloader`, over as many epochs as that takes (the sampler told each epoch).

    `zip(range(steps), dataloader)` would stop after one epoch and train fewer steps than asked.
    """
    epoch, given = 0, 0
    sampler = getattr(dataloader, "sampler", None)
    while given < steps:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)   # a distributed sampler reshuffles per epoch only when told
        before = given
        for batch in dataloader:
            yield batch
            given += 1
            if given == steps:
                return
        if given == before:
            raise RuntimeError("the dataloader yields no batch: the dataset is smaller than one batch per rank")
        epoch += 1


def main() -> None:
    args = parse_args()
    atorch.init_distributed("gloo")
    rank, world = atorch.rank(), atorch.world_size()
    if args.global_batch % world:
        build_parser().error(f"--global_batch={args.global_batch} must be a multiple of the {world} ranks")
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": args.global_batch},
        load_strategy=["parallel_mode"])
    if not status:
        raise SystemExit("auto_accelerate failed; see the log above")
    local_losses, global_losses = [], []
    for step, batch in enumerate(batches(result.dataloader, args.steps)):
        loss = train_step(result, batch).detach()
        local_losses.append(loss.item())
        dist.all_reduce(loss)                      # each rank's loss is over its share of the batch
        global_losses.append(loss.item() / world)
        if rank == 0:
            print(f"step {step + 1}  loss {global_losses[-1]:.6f}", flush=True)
    checksum = sum(float(p.detach().double().abs().sum()) for p in result.model.parameters())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                              "MASTER_PORT", "SLURM_PROCID", "SLURM_JOB_ID", "SLURM_STEP_ID")}
        record = {"rank": rank, "world_size": world, "local_rank": atorch.local_rank(), "env": env,
                  "host": socket.gethostname(), "cpus": sorted(os.sched_getaffinity(0)),
                  "torch_threads": torch.get_num_threads(), "local_losses": local_losses,
                  "global_losses": global_losses, "weights_checksum": checksum}
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f, indent=1)
    if rank == 0:
        print(f"done: {world} ranks, {args.steps} steps, weights checksum {checksum:.6f}", flush=True)
    del result
    dist.barrier()
    atorch.reset_distributed()


if __name__ == "__main__":
    main()
