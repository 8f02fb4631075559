"""The `make demo` job: let atorch search for the fastest strategy for the tiny Llama on 2 CPU processes, then train.

    python -m atorch.distributed.run --nproc_per_node 2 scripts/demo.py [--steps 30] [--report_dir atorch_search]

`auto_accelerate` is called without a strategy: it builds the default search space (mixed
precision, ZeRO/FSDP, module replacement, activation checkpointing, data/tensor splits),
predicts each candidate with the cost model, dry-runs the ones HEBO picks, and applies the
fastest. The demo prints the trial table, the chosen strategy with the one-line reason, and
where the plot is; then it trains on the bundled corpus with that strategy.
Search knobs (environment): BO_SG_MAX_IETR (trials, 10 here), MAX_PATIENCE, RANDOM_SAMPLE,
ATORCH_DRYRUN_WARMUP_STEP / ATORCH_DRYRUN_PROFILE_STEP, ATORCH_DEVICE_MEMORY_LIMIT.
"""

import argparse
import os
import time

import torch

import atorch
from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.assets import corpus_documents, load_tokenizer

# A few minutes on 2 cores: at most 10 dry runs of 1 warm-up + 2 timed steps each.
DEMO_SEARCH_DEFAULTS = {"BO_SG_MAX_IETR": "10", "MAX_PATIENCE": "6", "RANDOM_SAMPLE": "2",
                        "ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_PROFILE_STEP": "2"}


class CorpusBlocks(torch.utils.data.Dataset):
    """The bundled corpus, tokenized and cut into blocks of `seq_len` tokens."""

    def __init__(self, seq_len: int = 64, docs: int = 300):
        tok = load_tokenizer()
        ids = []
        for doc in corpus_documents(docs):
            ids.extend(tok(doc)["input_ids"] + [tok.eos_token_id])
        n = len(ids) // seq_len
        self.blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=16, help="global batch size")
    parser.add_argument("--report_dir", default=os.environ.get("ATORCH_SEARCH_REPORT_DIR", "atorch_search"))
    args = parser.parse_args()
    for key, value in DEMO_SEARCH_DEFAULTS.items():
        os.environ.setdefault(key, value)
    atorch.init_distributed()
    rank = atorch.distributed.rank()
    start = time.perf_counter()
    status, result, strategy = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=CorpusBlocks(), optim_args={"lr": 3e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": args.batch_size, "shuffle": True},
        report_path=args.report_dir, save_strategy_to_file=os.path.join(args.report_dir, "strategy.json"))
    if not status:
        raise SystemExit("auto_accelerate failed; see the log above")
    if rank == 0:
        from atorch.auto.search.report import trials_table

        search = result.args["search_result"]
        print(f"\nstrategy search on {atorch.distributed.world_size()} processes "
              f"({time.perf_counter() - start:.0f} s, {len(search.trials)} dry runs of {search.num_candidates} "
              f"valid candidates):\n{trials_table(search)}\n", flush=True)
        print(f"chosen strategy: {strategy.describe()}", flush=True)
        print(f"why: {search.reason}", flush=True)
        print(f"plot: {os.path.abspath(result.args['search_report']['plot'])}", flush=True)
        print(f"trial table: {os.path.abspath(result.args['search_report']['table'])}\n", flush=True)
    step, epoch, start = 0, 0, time.perf_counter()
    while step < args.steps:
        result.args["sampler"].set_epoch(epoch)
        epoch += 1
        for batch in result.dataloader:
            loss = train_step(result, batch)
            step += 1
            if rank == 0 and (step % 5 == 0 or step == 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f}s", flush=True)
            if step >= args.steps:
                break
    del result
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
