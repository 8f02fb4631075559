"""Failure modes found on landscape shapes the search was not tuned on (benchmarks/search.py,
families microbatch-3%, failing-3%, spikes-3%, flat-3%, needle-3%); each test in milliseconds."""

from atorch.auto.search import SearchSpace
from atorch.auto.search.feasibility import Feasibility
from atorch.auto.search.space import memory_saving_ranks


def micro_space() -> SearchSpace:
    return SearchSpace({"micro_batch": [None, ("gradient_accumulation", {"steps": 2}),
                                        ("gradient_accumulation", 4)],
                        "checkpoint": [None, "checkpoint"]}, world_size=2, global_batch_size=8)


def test_the_micro_batch_dimension_is_ordered_by_memory():
    """More micro-batches per step (fewer rows each) never need more memory: an out-of-memory run
    at a large micro-batch rules out the larger ones, and one that ran vouches for the smaller."""
    space = micro_space()
    assert memory_saving_ranks(space)[0] == [0.0, 1.0, 2.0]
    cands = space.candidates()
    index = {c.choices: i for i, c in enumerate(cands)}
    feas = Feasibility([c.choices for c in cands], memory_saving_ranks(space), limit=100.0)
    feas.observe(index[(1, 0)], "oom", None)           # 2 micro-batches of 4 rows ran out of memory
    feas.observe(index[(1, 1)], "ok", 90.0)            # ... and ran with checkpointing
    assert feas.probability(index[(0, 0)]).p == 0.0    # one micro-batch of 8 rows: no chance
    assert feas.probability(index[(2, 1)]).p == 1.0    # 4 micro-batches, checkpointed: fits
