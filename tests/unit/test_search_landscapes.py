"""Failure modes found on landscape shapes the search was not tuned on (benchmarks/search.py,
families microbatch-3%, failing-3%, spikes-3%, flat-3%, needle-3%); each test in milliseconds."""

import math

from atorch.auto.search import SearchSpace
from atorch.auto.search.feasibility import Feasibility
from atorch.auto.search.space import memory_saving_ranks
from atorch.auto.search.stats import log_throughput_of_steps, t_quantile
from atorch.auto.step_timing import summarize


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


def test_a_load_spike_is_left_out_of_a_runs_variance_as_the_dry_runner_leaves_it_out_of_the_mean():
    """One step in ten at 2.5x: the dry runner's mean and interval leave it out; the search's
    variance of that run must describe the same mean, not be 5x wider."""
    steps = [1.0, 1.01, 0.99, 1.0, 2.5, 1.02, 0.98, 1.0, 1.01, 0.99]
    est = log_throughput_of_steps(steps)
    dry_runner = summarize(steps)
    assert dry_runner.outliers == 1
    assert est is not None and math.isclose(est.mean, -math.log(dry_runner.mean_s))
    half = t_quantile(0.95, est.df) * math.sqrt(est.var)
    assert math.isclose(half, dry_runner.relative_half_width, rel_tol=0.05)
