"""A collective timeout where the ranks reached the same sequence number in different collectives.

Before, the roll call compared only the process group and the sequence number, so a collective run on
some ranks only (`if rank == 0: save_checkpoint(...)`) was reported as "every rank of the group reached
it (a slow or lost transfer)". Now each rank tells the roll call which collective it was in, and the
message lists each rank's collective and points at code that runs one on some ranks only. The other
outcomes (different tensor sizes, a slow transfer, a rank that never arrived) are in
tests/unit/test_collective_roll_call.py: with gloo a size mismatch aborts a rank or completes silently.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.distributed as dist

from atorch.distributed import timeouts
from atorch.testing import run_distributed

pytestmark = pytest.mark.distributed

# Short, so the case costs seconds; the roll call's grace is as long (min(timeout, 30 s)) but ends as soon
# as both ranks have answered, and both time out: their collectives can never match.
TIMEOUT_S = 3


def _rank_zero_only_collective() -> List[str]:
    """Rank 0 reduces a metric the others never reduce; they are already in their next collective."""
    rank = dist.get_rank()
    try:
        with timeouts.diagnose_collective_timeouts():
            if rank == 0:
                dist.all_reduce(torch.ones(1))
            else:
                dist.broadcast(torch.ones(1000), src=1)
    except timeouts.CollectiveTimeoutError as e:
        return [str(e)]
    return ["completed"]


def test_ranks_in_different_collectives_are_named_instead_of_the_network():
    results = run_distributed(_rank_zero_only_collective, 2, timeout=120,
                              env={"ATORCH_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)})
    ops = {0: "gloo:all_reduce (sequence number 1 of process group 'default_pg', input sizes [[1]])",
           1: "gloo:broadcast (sequence number 1 of process group 'default_pg', input sizes [[1000]])"}
    # A rank whose timeout fires first may finish and exit before the other's fires: that one then reports its
    # peer's closed connection instead of its own timeout, with the same roll call (seen under load).
    endings = (" did not complete within ATORCH_COLLECTIVE_TIMEOUT=3 s; ", " failed: a peer closed its connection; ")
    for rank, (message,) in enumerate(results):
        # Each rank reports its own collective, then the same roll call: both ranks, each in its collective.
        assert any(message.startswith(f"rank {rank}: collective {ops[rank]}{end}") for end in endings), message
        assert "; the ranks were in different collectives at this sequence number: " \
               "gloo:all_reduce (input sizes [[1]]) on rank(s) [0]; " \
               "gloo:broadcast (input sizes [[1000]]) on rank(s) [1]. " in message, message
        assert "behind `if rank == 0`" in message, message
        assert "slow or lost transfer" not in message and "did not arrive" not in message, message
