"""The job `exit_stress.py` repeats: 2 ranks train a tiny Llama a few steps, save a checkpoint, exit.

Run under the launcher: `python -m atorch.distributed.run --nproc_per_node 2 benchmarks/exit_stress_job.py OUT
[STRATEGY]`, STRATEGY one of `fsdp` (default), `ddp`, `tp`. It ends the way a user's script ends
(no explicit teardown unless `ATORCH_STRESS_TEARDOWN=1`), so its exit status is that of a real job.
"""

import os
import sys

import torch

from atorch import distributed as adist
from atorch.auto import auto_accelerate, train_step
from atorch.checkpoint import save_checkpoint
from atorch.testing import tiny_llama
from atorch.testing.parity import TokenDataset

STRATEGIES = {"fsdp": ["parallel_mode", "fsdp"], "ddp": ["parallel_mode"],
              "tp": [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]}


def main(out_dir: str, strategy: str) -> None:
    torch.set_num_threads(1)
    adist.init_distributed()
    status, result, _ = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(n=32), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4, "num_workers": 1},
        load_strategy=STRATEGIES[strategy])
    assert status
    for step, batch in enumerate(result.dataloader, start=1):
        train_step(result, batch)
        if step == 3:
            break
    save_checkpoint(result, os.path.join(out_dir, "step_3"), step=3, keep_last=1)
    if os.environ.get("ATORCH_STRESS_TEARDOWN") == "1":
        del result
        adist.destroy_distributed()
    print(f"rank {adist.rank()} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fsdp")
