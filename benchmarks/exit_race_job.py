"""The smallest job that shows the exit race: 2 gloo ranks, 20 rounds of collectives, then exit.

`python -m atorch.distributed.run --nproc_per_node 2 benchmarks/exit_race_job.py {torch,torch-destroy,atorch}`:
`torch` initializes with `dist.init_process_group` and never destroys the group (a common script),
`torch-destroy` destroys it at the end, `atorch` initializes with `atorch.init_distributed` and leaves
the teardown to atorch's exit handler. See benchmarks/RESULTS.md "Clean exit".
"""

import sys

import torch
import torch.distributed as dist

mode = sys.argv[1] if len(sys.argv) > 1 else "atorch"
torch.set_num_threads(1)
if mode == "atorch":
    import atorch

    atorch.init_distributed("gloo")
else:
    dist.init_process_group("gloo")
param = torch.nn.Parameter(torch.ones(64))
for i in range(20):
    dist.all_reduce(torch.ones(1000))
    dist.broadcast(param.data, 0)
    dist.broadcast(param, 0)
    dist.all_gather_object([None] * dist.get_world_size(), {"round": i})
dist.barrier()
if mode == "torch-destroy":
    dist.destroy_process_group()
print(f"rank {dist.get_rank()} done", flush=True)
