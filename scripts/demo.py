"""The `make demo` job: let atorch search for the fastest strategy for the tiny Llama on 2 CPU processes, then train.

    python -m atorch.distributed.run --nproc_per_node 2 scripts/demo.py [--steps 30] [--report_dir atorch_search]

`auto_accelerate` is called without a strategy: it builds the default search space (mixed
precision, ZeRO/FSDP, module replacement, activation checkpointing, data/tensor splits),
predicts each candidate with the cost model, dry-runs the ones HEBO picks, and applies the
fastest. Each dry run times steps until the 95% confidence interval of its step time is within
3% (or its step budget is spent). The demo prints the trial table, every measured throughput
with its interval, the chosen strategy with the search's one-line reason, and where the plot
is; then it trains on the bundled corpus with that strategy.

Measurements are remembered in <report_dir>/search_cache.json: run the demo again and the search
becomes one confirming dry run of the remembered winner (the reason line says so). To search
afresh, delete that file or set ATORCH_SEARCH_CACHE=off.
Search knobs (environment): BO_SG_MAX_IETR (trials, 10 here), MAX_PATIENCE, RANDOM_SAMPLE,
ATORCH_DRYRUN_WARMUP_STEP, ATORCH_DRYRUN_PROFILE_STEP (minimum timed samples),
ATORCH_DRYRUN_MAX_STEPS (step budget), ATORCH_DRYRUN_TARGET_CI, ATORCH_DEVICE_MEMORY_LIMIT.
"""

import argparse
import json
import os
import time

import torch

import atorch
from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.assets import corpus_documents, load_tokenizer

# Under a minute on 2 cores: at most 10 dry runs of 2 warm-up steps and 8 (the default pilot whose
# spread fixes the interval) to 20 timed steps each.
DEMO_SEARCH_DEFAULTS = {"BO_SG_MAX_IETR": "10", "MAX_PATIENCE": "6", "RANDOM_SAMPLE": "2",
                        "ATORCH_DRYRUN_WARMUP_STEP": "2", "ATORCH_DRYRUN_MAX_STEPS": "20"}


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


def measured_intervals(report_dir: str) -> str:
    """Every dry run's throughput with its 95% confidence interval, from the search's results cache
    (where the search keeps it: $ATORCH_SEARCH_CACHE, else search_cache.json in the report directory)."""
    from atorch.auto.search.auto_search import SearchSettings
    from atorch.auto.search.cache import CACHE_FILE_NAME
    from atorch.auto.strategy import Strategy

    settings = SearchSettings.from_env()
    path = settings.cache_path or os.path.join(report_dir, CACHE_FILE_NAME)
    if not settings.cache_enabled or not os.path.exists(path):
        return "(no results cache: the trial table above holds this search's intervals)"
    with open(path) as f:
        results = json.load(f)["results"]
    lines = ["measured throughput (samples/s) with 95% confidence interval:"]
    rows = sorted(results.items(), key=lambda kv: -kv[1]["throughput"])
    for key, r in rows:
        name = Strategy.from_json(key).describe()
        if r["error"]:
            lines.append(f"  {name:<60} {r['error'][:60]}")
        elif r["throughput_ci"]:
            low, high = r["throughput_ci"]
            lines.append(f"  {name:<60} {r['throughput']:8.1f}  [{low:.1f}, {high:.1f}]  "
                         f"+-{(high - low) / 2 / r['throughput']:.1%}  ({len(r['step_times_s'])} samples)")
        else:
            lines.append(f"  {name:<60} {r['throughput']:8.1f}  (too few samples for an interval)")
    return "\n".join(lines) + "\n"


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
        confirmed = "source" in search.trials and (search.trials["source"] == "cache-confirm").any()
        runs = "1 confirming dry run of the remembered winner" if confirmed else f"{len(search.trials)} dry runs"
        print(f"\nstrategy search on {atorch.distributed.world_size()} processes "
              f"({time.perf_counter() - start:.0f} s, {runs}, {search.num_candidates} valid candidates):\n"
              f"{trials_table(search)}\n", flush=True)
        print(measured_intervals(args.report_dir), flush=True)
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
