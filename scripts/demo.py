"""The `make demo` job: train the tiny Llama on the bundled corpus with atorch on 2 CPU processes.

    python -m atorch.distributed.run --nproc_per_node 2 scripts/demo.py [--steps 30]

Plain data parallel (DDP over gloo) for now; it prints the loss every few steps.
"""

import argparse
import time

import torch

import atorch
from atorch.auto import auto_accelerate, train_step
from atorch.testing import tiny_llama
from atorch.testing.assets import corpus_documents, load_tokenizer


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
    args = parser.parse_args()
    atorch.init_distributed()
    rank = atorch.distributed.rank()
    status, result, strategy = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=CorpusBlocks(), optim_args={"lr": 3e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": args.batch_size, "shuffle": True},
        load_strategy=["parallel_mode"])
    if not status:
        raise SystemExit("auto_accelerate failed; see the log above")
    if rank == 0:
        print(f"strategy: {strategy.describe()} on {atorch.distributed.world_size()} processes", flush=True)
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
