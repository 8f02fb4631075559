"""The roll call's diagnosis of a timed-out collective, in one process: the other ranks' answers are written
into an in-memory store before this rank asks (milliseconds; the gloo path is in
tests/distributed/test_collective_mismatch.py).

Gloo cannot show every case for real: a size mismatch aborts a gloo rank or completes silently, where NCCL
hangs until the timeout. Here each case is a set of answers the ranks would give.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import pytest
import torch.distributed as dist

from atorch.distributed import timeouts

PG_ID, SEQ = "0", 7
ALL_REDUCE_1 = {"name": "gloo:all_reduce", "sizes": [[1]], "dtypes": ["Float"]}


def _diagnose(monkeypatch, me: Dict[str, Any], others: Dict[int, Optional[Dict[str, Any]]],
              error: str = "Timed out waiting 3000ms for recv") -> str:
    """Rank 0's message when it is in collective `me` and rank r answered `others[r]` (None: never arrived)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(timeouts.COLLECTIVE_TIMEOUT_ENV, "0.5")   # also the grace for a rank that never arrives
    ranks: List[int] = [0, *others]
    monkeypatch.setattr(timeouts, "_pending_collective", lambda: {
        **me, "seq": SEQ, "pg": "default_pg", "pg_id": PG_ID, "ranks": ranks})
    store = dist.HashStore()
    for r, answer in others.items():
        if answer is not None:
            store.set(f"atorch/timeout/{PG_ID}/{SEQ}/{r}", json.dumps(answer))
    return timeouts.describe_collective_timeout(RuntimeError(error), store)


def test_ranks_in_different_collectives_are_listed_with_the_likely_cause(monkeypatch):
    broadcast = {"name": "gloo:broadcast", "sizes": [[1000]], "dtypes": ["Float"]}
    message = _diagnose(monkeypatch, ALL_REDUCE_1, {1: broadcast, 2: broadcast, 3: broadcast})
    assert message.startswith("rank 0: collective gloo:all_reduce (sequence number 7 of process group "
                              "'default_pg', input sizes [[1]]) did not complete within "), message
    assert ("; the ranks were in different collectives at this sequence number: gloo:all_reduce (input sizes "
            "[[1]]) on rank(s) [0]; gloo:broadcast (input sizes [[1000]]) on rank(s) [1, 2, 3]. ") in message, message
    assert "behind `if rank == 0`" in message and "slow or lost" not in message, message


@pytest.mark.parametrize("field, other, shown", [
    ("sizes", [[4000]], "[[1]] on rank(s) [0]; [[4000]] on rank(s) [1]"),
    ("dtypes", ["Long"], "['Float'] on rank(s) [0]; ['Long'] on rank(s) [1]"),
])
def test_same_collective_with_different_inputs_names_the_difference(monkeypatch, field, other, shown):
    message = _diagnose(monkeypatch, ALL_REDUCE_1, {1: {**ALL_REDUCE_1, field: other}})
    assert f"; every rank of the group reached it but with different input tensor {field}: {shown}. " in message, \
        message
    assert "slow or lost" not in message, message


@pytest.mark.parametrize("me, other", [
    (ALL_REDUCE_1, ALL_REDUCE_1),                                    # the ranks agree: the network
    (ALL_REDUCE_1, {}),                                              # a rank without a flight recorder
    ({"name": "gloo:all_to_all", "sizes": [[3]], "dtypes": ["Float"]},   # uneven splits are legitimate
     {"name": "gloo:all_to_all", "sizes": [[5]], "dtypes": ["Float"]}),
])
def test_agreeing_ranks_still_point_at_the_transfer(monkeypatch, me, other):
    message = _diagnose(monkeypatch, me, {1: other})
    assert "; every rank of the group reached it (a slow or lost transfer) (original error: " in message, message


def test_a_rank_that_never_arrived_is_named_as_before(monkeypatch):
    message = _diagnose(monkeypatch, ALL_REDUCE_1, {1: {"name": "gloo:broadcast"}, 2: None})
    assert "; rank(s) [2] did not arrive (unknown node: ranks [2]) (original error: " in message, message


def test_a_lost_peer_is_waited_for_briefly(monkeypatch):
    """A peer that closed its connection will not answer: the survivors' roll call waits _LOST_PEER_GRACE_S, not
    the 30 s that a rank merely late to a timed-out collective gets (a job whose rank exited early took 34 s)."""
    graces = []
    real = timeouts.roll_call
    monkeypatch.setattr(timeouts, "roll_call", lambda *args: graces.append(args[4]) or real(*args))
    monkeypatch.setattr(timeouts, "_LOST_PEER_GRACE_S", 0.2)
    monkeypatch.setattr(timeouts, "_MAX_GRACE_S", 0.4)
    lost = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12197"
    message = _diagnose(monkeypatch, ALL_REDUCE_1, {1: None}, error=lost)
    assert "failed: a peer closed its connection; rank(s) [1] did not arrive" in message, message
    _diagnose(monkeypatch, ALL_REDUCE_1, {1: None})
    assert graces == [0.2, 0.4]
