"""The default space against the batch and the data: pipeline chunks, micro-batch sizes, the dataset's
keys and last batch, and the search's need for an optimizer. Pure logic, no processes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.base import DataSetup
from atorch.auto.opt_lib.gradient_accumulation import MAX_SEARCH_CHOICES, search_step_counts, search_steps
from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelOptimization, search_chunks
from atorch.auto.search import SearchSpace
from atorch.auto.search import auto_search
from atorch.auto.strategy import Strategy
from atorch.modules.pipeline.native import check_schedule_chunks
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.parity import TokenDataset


@pytest.fixture(scope="module")
def one_kv_head():
    """No tensor-parallel split of 2 (one kv head): a pipeline is the only way past data parallelism."""
    return tiny_llama(num_key_value_heads=1)


def _layout(strategy: Strategy) -> Dict[str, int]:
    return dict(strategy.get("parallel_mode").config[0])


def _chunks(strategy: Strategy) -> Optional[int]:
    item = strategy.get("pipeline_parallel")
    return None if item is None else item.config["chunks"]


def _steps(strategy: Strategy) -> int:
    item = strategy.get("gradient_accumulation")
    return 1 if item is None else item.config["steps"]


# -- pipeline chunks ---------------------------------------------------------------------------

def test_search_chunks_are_divisors_from_the_stage_count_up():
    assert search_chunks(3, 2) == [3]            # 3 rows over 2 stages: one chunk per row
    assert search_chunks(8, 2) == [2, 4]         # one per stage, and two per stage (a smaller bubble)
    assert search_chunks(12, 4) == [4, 12]       # no 8: the next divisor >= 2 x stages
    assert search_chunks(64, 8) == [8, 16]
    assert search_chunks(6, 4) == [6]
    assert search_chunks(1, 2) == [] and search_chunks(3, 4) == []    # fewer rows than stages
    for rows, stages in [(3, 2), (8, 2), (12, 4), (64, 8), (6, 4)]:
        for chunks in search_chunks(rows, stages):
            assert rows % chunks == 0
            check_schedule_chunks("1f1b", chunks, stages)     # also valid for 1F1B


@pytest.mark.parametrize("world, batch, data, chunks", [(2, 3, 1, [3]), (4, 6, 2, [3]), (4, 8, 2, [2, 4])])
def test_pipelines_are_offered_with_chunks_that_split_the_per_rank_batch(one_kv_head, world, batch, data, chunks):
    """Per-rank batches of 3 rows do not split into one chunk per stage (2); 3 chunks do, and train."""
    space = SearchSpace.default_for(one_kv_head, world, "cpu", global_batch_size=batch)
    pipelines = [c.strategy for c in space.candidates() if "pipeline_parallel" in c.strategy]
    assert pipelines, space.rejected
    assert sorted({_chunks(s) for s in pipelines}) == chunks
    assert all(_layout(s) == {"data": data, "pipeline": 2} for s in pipelines)
    context = space.validation_context()
    for s in pipelines:
        resolve_strategy(s, context)
        assert (batch // data) % (_chunks(s) * _steps(s)) == 0, s.describe()


def test_without_a_batch_size_a_pipeline_takes_its_default_chunks(one_kv_head):
    context = ValidationContext(world_size=4, model=one_kv_head, model_config=one_kv_head.config)
    assert PipelineParallelOptimization.search_choices(context) == [
        [("parallel_mode", ([("data", 2), ("pipeline", 2)], None)), "pipeline_parallel"]]
    context.global_batch_size = 2    # one row per data rank: no chunk count >= 2 stages
    assert PipelineParallelOptimization.search_choices(context) == []


# -- micro-batches -----------------------------------------------------------------------------

def test_search_steps_spread_from_the_mildest_split_to_one_row():
    assert search_steps(1) == [] and search_steps(3) == [3] and search_steps(8) == [2, 4, 8]
    for rows in (12, 48, 60, 64, 720, 1024):
        steps = search_steps(rows)
        assert len(steps) == 4 and steps[0] == 2 and steps[-1] == rows
        assert all(rows % k == 0 for k in steps)
    # Several layouts: each keeps its one-row micro-batches and its mildest split, within the bound
    # unless those alone exceed it.
    counts = search_step_counts([48, 24, 12, 6])
    assert {48, 24, 12, 6, 2} <= set(counts) and len(counts) <= MAX_SEARCH_CHOICES
    many = search_step_counts([2 ** k for k in range(2, 10)])
    assert set(many) == {2 ** k for k in range(1, 10)}


@pytest.mark.parametrize("world, batch", [(4, 48), (1, 64), (8, 64), (2, 60), (2, 8)])
def test_every_layout_is_offered_micro_batches_of_one_row(world, batch):
    """A model that fits only at micro-batch 1 must not look infeasible: every layout of the space has a
    candidate with one row per micro-batch (per chunk, in a pipeline), and every step count a candidate
    holds divides its rows."""
    space = SearchSpace.default_for(tiny_llama(), world, "cpu", global_batch_size=batch)
    smallest: Dict[Any, int] = {}
    for c in space.candidates():
        s = c.strategy
        rows = batch // _layout(s).get("data", 1) // (_chunks(s) or 1)
        assert rows % _steps(s) == 0, s.describe()
        key = (tuple(sorted(_layout(s).items())), _chunks(s))
        smallest[key] = min(smallest.get(key, rows), rows // _steps(s))
    assert smallest and set(smallest.values()) == {1}, smallest
    assert len(space.dimensions["micro_batch"]) <= MAX_SEARCH_CHOICES + 2


# -- the training data -------------------------------------------------------------------------

class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, keys: List[str]) -> None:
        self.n, self.keys = n, keys

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.arange(8) + 4
        return {k: ids for k in self.keys}


def test_no_pipeline_is_offered_for_a_dataset_the_pipeline_would_refuse():
    """GPT-2 samples with token_type_ids: pipeline_parallel's apply refuses them (the stages pass only
    input_ids, attention_mask and labels), so a search with that dataset offers no pipeline."""
    model = tiny_gpt2()

    def space(keys: List[str], **kw: Any) -> SearchSpace:
        data = DataSetup(dataset=_Samples(16, keys), global_batch_size=4, **kw)
        return SearchSpace.default_for(model, 2, "cpu", global_batch_size=4, data=data)

    assert any("pipeline_parallel" in s for s in space(["input_ids", "labels"]).strategies())
    refused = space(["input_ids", "labels", "token_type_ids"])
    assert refused.strategies() and not any("pipeline_parallel" in s for s in refused.strategies())
    assert not any("pipeline_parallel" in s for s in space(["input_ids"], model_input_format="unpack_sequence")
                   .strategies())
    # A collate_fn or prepare_input may reshape the samples: they are then left to apply's per-batch check.
    assert any("pipeline_parallel" in s for s in space(["input_ids", "token_type_ids"], reshapes_samples=True)
               .strategies())
    # A pipeline named in a space of one's own is refused by validation, with apply's reason.
    layout = [("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), "pipeline_parallel"]
    own = SearchSpace({"parallel": [layout]}, world_size=2, model=model, global_batch_size=4,
                      data=DataSetup(dataset=_Samples(16, ["input_ids", "token_type_ids"]), global_batch_size=4))
    assert not own.candidates()
    assert any("also has ['token_type_ids']" in why for why in own.rejected.values()), own.rejected


def test_pipelines_whose_chunks_the_last_batch_does_not_split_are_left_out():
    """drop_last=False, 10 samples in batches of 8 on one data rank: the last batch has 2 rows, which split
    into 2 chunks but not into 4, nor into 2 chunks x 2 accumulation steps."""
    model = tiny_llama(num_key_value_heads=1)
    data = DataSetup(dataset=TokenDataset(n=10), global_batch_size=8, drop_last=False)
    space = SearchSpace.default_for(model, 2, "cpu", global_batch_size=8, data=data)
    pipelines = [s for s in space.strategies() if "pipeline_parallel" in s]
    assert pipelines and {(_chunks(s), _steps(s)) for s in pipelines} == {(2, 1)}
    assert any("the last batch of each epoch has 2 rows" in why for why in space.rejected.values())
    kept = SearchSpace.default_for(model, 2, "cpu", global_batch_size=8,
                                   data=DataSetup(dataset=TokenDataset(n=16), global_batch_size=8, drop_last=False))
    assert {_chunks(s) for s in kept.strategies() if "pipeline_parallel" in s} == {2, 4}


def test_data_setup_reads_the_model_context():
    dataset = TokenDataset(n=4)
    ctx = ModelContext(model=tiny_llama(), dataset=dataset, model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 2, "drop_last": False, "collate_fn": list})
    data = DataSetup.of(ctx)
    assert (data.dataset, data.model_input_format, data.reshapes_samples, data.global_batch_size, data.drop_last,
            data.sampler_given) == (dataset, "unpack_dict", True, 2, False, False)
    plain = DataSetup.of(ModelContext(model=None))
    assert plain.drop_last and not plain.reshapes_samples and plain.global_batch_size is None


# -- the search's entry ------------------------------------------------------------------------

class _ReachedTheSearch(Exception):
    pass


def test_the_search_without_optim_func_is_refused_before_anything_runs(monkeypatch):
    """A search times optimizer steps: without optim_func every candidate would fail (DeepSpeed ones refused,
    the rest at `optim.step()` in the dry run). Refused up front, naming what to pass."""
    def reached(*args: Any, **kwargs: Any) -> None:
        raise _ReachedTheSearch()

    monkeypatch.setattr(auto_search.SearchSettings, "from_env", classmethod(reached))
    ctx = ModelContext(model=tiny_llama(), dataset=TokenDataset(n=8), dataloader_args={"batch_size": 4},
                       device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"optim_func=None, .*searches for a strategy.*pass optim_func.*load_strategy"):
        auto_search.search_for_context(ctx)
    ctx.optim_func = torch.optim.AdamW
    with pytest.raises(_ReachedTheSearch):
        auto_search.search_for_context(ctx)


def test_the_search_gives_its_space_the_training_data(monkeypatch):
    seen: Dict[str, Any] = {}

    def default_for(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _ReachedTheSearch()

    monkeypatch.setattr(auto_search.SearchSpace, "default_for", default_for)
    dataset = TokenDataset(n=8)
    ctx = ModelContext(model=tiny_llama(), optim_func=torch.optim.AdamW, dataset=dataset,
                       dataloader_args={"batch_size": 4, "drop_last": False}, device=torch.device("cpu"))
    with pytest.raises(_ReachedTheSearch):
        auto_search.search_for_context(ctx)
    data = seen["data"]
    assert isinstance(data, DataSetup) and data.dataset is dataset and not data.drop_last
