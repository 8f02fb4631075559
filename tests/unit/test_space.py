"""The automatic search space: dimensions declared by the optimizations, their validity, speed helpers.

No test here edits the global registry: custom optimizations go into a `Registry` of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import pytest
import torch

from atorch.auto.opt_lib import Optimization, Registry, ValidationContext, default_registry, resolve_strategy
from atorch.auto.opt_lib.base import UNDECLARED
from atorch.auto.search import SearchSpace
from atorch.auto.search import space as space_module
from atorch.auto.search.space import ValidationCache, choice_items, declared_dimensions
from atorch.auto.strategy import Strategy
from atorch.auto.train_step import split_batch
from atorch.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _names(strategy: Strategy) -> set:
    return set(strategy.names())


def _config(strategy: Strategy, name: str) -> Any:
    item = strategy.get(name)
    return None if item is None else item.config


# -- declarations ------------------------------------------------------------------------------

def test_every_registered_optimization_declares_its_search_dimension(model):
    registry = default_registry()
    context = ValidationContext(world_size=4, model=model, model_config=model.config, device_type="cuda",
                                global_batch_size=16)
    for opt in registry.classes():
        assert opt.search_dimension != UNDECLARED, f"{opt.name} ({opt.__name__}) declares no search_dimension"
        if opt.search_dimension is None:
            continue
        choices = opt.search_choices(context)
        assert any(c is not None for c in choices), f"{opt.name} offers nothing in {opt.search_dimension!r}"
        for choice in choices:
            names = {i.name for i in choice_items(choice)}
            assert choice is None or opt.name in names, (opt.name, choice)
    searched = {o.name for o in registry.classes() if o.search_dimension is not None}
    assert {"parallel_mode", "tensor_parallel", "pipeline_parallel", "gradient_accumulation", "amp_native", "zero1",
            "zero2", "fsdp", "checkpoint", "module_replace"} <= searched
    assert not searched & {"ddp", "half", "lora", "fp8", "deepspeed_3d_parallel"}


def test_undeclared_optimization_is_not_searched_and_warned(caplog):
    undeclared = type("Undeclared", (Optimization,), {"name": "t_undeclared"})
    registry = default_registry().with_optimizations(undeclared)
    context = ValidationContext(world_size=2)
    dims = declared_dimensions(registry, context)
    assert not any("t_undeclared" in {i.name for i in choice_items(c)} for cs in dims.values() for c in cs)
    assert "t_undeclared" in caplog.text and "declares no search_dimension" in caplog.text


# -- the default space -------------------------------------------------------------------------

def test_default_space_dimensions_on_cpu(model):
    space = SearchSpace.default_for(model, world_size=2, device_type="cpu", global_batch_size=8)
    labels = space.labels()
    assert list(labels) == ["parallel", "micro_batch", "module_replace", "checkpoint", "amp", "zero"]  # by order
    assert labels["parallel"] == ["parallel_mode(data=2)",
                                  "parallel_mode(data=1,pipeline=2)+pipeline_parallel(chunks=2)",
                                  "parallel_mode(data=1,pipeline=2)+pipeline_parallel(chunks=4)",
                                  "parallel_mode(tensor=2,data=1)+tensor_parallel"]
    assert labels["micro_batch"][0] == "none" and len(labels["micro_batch"]) > 1
    assert "zero2(deepspeed stage 2)" in labels["zero"] and "fsdp(deepspeed stage 3)" in labels["zero"]
    assert not any("cpu_offload" in label for label in labels["zero"])     # nothing to offload from on CPU
    cands = space.strategies()
    assert 100 < len(cands) < space.size
    ctx = space.validation_context()
    for s in cands:
        resolve_strategy(s, ctx)        # every candidate is one auto_accelerate accepts
        ga = _config(s, "gradient_accumulation")
        if ga is not None:
            pm = dict(_config(s, "parallel_mode")[0])
            per_rank = 8 // pm.get("data", 1)
            assert per_rank % ga["steps"] == 0, s.describe()
        zero = next((n for n in ("zero1", "zero2", "fsdp") if n in s), None)
        if zero and (_config(s, zero) or {}).get("use_ds_zero"):
            assert not _names(s) & {"tensor_parallel", "pipeline_parallel"}, s.describe()
    # The dimensions that matter are all present in some candidate.
    assert any("pipeline_parallel" in s for s in cands) and any("tensor_parallel" in s for s in cands)
    assert any(_config(s, "gradient_accumulation") == {"steps": 4} for s in cands)
    assert any((_config(s, "zero2") or {}).get("use_ds_zero") for s in cands)
    # steps=8 would leave a per-rank batch of 4 rows (data=2) split into 8: never a candidate there.
    assert not any(_config(s, "gradient_accumulation") == {"steps": 8} and
                   dict(_config(s, "parallel_mode")[0]).get("data") == 2 for s in cands)


@pytest.mark.parametrize("family", ["bloom", "gemma2"])
def test_module_replace_is_not_searched_where_it_would_replace_nothing(family, caplog):
    """BLOOM's and Gemma 2's attention cannot switch to sdpa and their norms are not Llama's RMSNorm:
    module_replace would change nothing, so the space does not double with candidates alike."""
    from atorch.testing.tp_families import build_family

    other, _ = build_family(family)
    with caplog.at_level("INFO", logger="atorch.auto.opt_lib.module_replace"):
        space = SearchSpace.default_for(other, world_size=2, device_type="cpu", global_batch_size=8)
    assert "module_replace" not in space.labels()
    assert not any("module_replace" in s for s in space.strategies())
    assert "module_replace: not searched, nothing to replace" in caplog.text
    # Named by the user, it is still accepted (and reports what it left, see test_module_replace).
    resolve_strategy(Strategy([("module_replace",)]), space.validation_context())


def test_module_replace_is_searched_where_it_replaces_something(model):
    from atorch.testing import tiny_gpt2

    gpt2 = tiny_gpt2()
    for m in (model, gpt2):
        space = SearchSpace.default_for(m, world_size=2, device_type="cpu", global_batch_size=8)
        assert space.labels()["module_replace"] == ["none", "module_replace"], type(m).__name__


def test_torch_sharding_over_one_data_rank_is_not_a_second_candidate(model):
    """ZeroRedundancyOptimizer over a data group of 1 rank is the plain optimizer: with tensor=2 on 2
    ranks the candidate would measure the same as the one without zero1, so only that one is kept.
    DeepSpeed's stage 1 stays (its engine also changes the precision regime)."""
    space = SearchSpace.default_for(model, world_size=2, device_type="cpu", global_batch_size=8)

    def data(s):
        return dict(_config(s, "parallel_mode")[0]).get("data", 1)

    cands = space.strategies()
    assert not [s.describe() for s in cands if "zero1" in s and data(s) == 1
                and not (_config(s, "zero1") or {}).get("use_ds_zero")]
    assert any("zero1" in s and data(s) == 2 for s in cands)
    assert any(data(s) == 1 and not _names(s) & {"zero1", "zero2", "fsdp"} for s in cands)
    why = [v for k, v in space.rejected.items() if "zero1" in k and "tensor=2" in k]
    assert why and all(v.startswith("the same as without it: zero1:") for v in why if "the same" in v)
    # torch FSDP2 over one data rank shards nothing either: without amp it trains as without it
    # (and only adds all-gather copies); with amp its mixed precision replaces autocast, so it stays.
    for name in ("zero2", "fsdp"):
        torch_one = [s for s in cands if name in s and data(s) == 1 and not (_config(s, name) or {}).get("use_ds_zero")]
        assert torch_one and all("amp_native" in s for s in torch_one), [s.describe() for s in torch_one]
        assert any(name in s and data(s) == 2 and "amp_native" not in s for s in cands)
    # Asked for by the user (included: no "not chosen" to fall back on), it stays.
    one = SearchSpace.default_for(model, world_size=1, device_type="cpu", global_batch_size=8)
    assert not any("zero1" in s and not (_config(s, "zero1") or {}).get("use_ds_zero") for s in one.strategies())
    assert one.restricted(included=["zero1"]).strategies()


def test_a_users_sharding_that_changes_nothing_is_applied_with_a_warning(caplog):
    """Named by the user on one process, zero1 is kept (e.g. a config shared with multi-GPU runs) and
    the log says it does nothing here; fsdp with amp changes the numerics, so no warning for it."""
    from atorch.auto import auto_accelerate, train_step
    from atorch.testing.parity import TokenDataset

    for strategy, idle in ((["zero1"], "zero1"), (["amp_native", "fsdp"], None)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="atorch.auto.accelerate"):
            status, result, _ = auto_accelerate(tiny_llama(), torch.optim.AdamW, TokenDataset(n=8, seq_len=8),
                                                dataloader_args={"batch_size": 4}, load_strategy=strategy)
        assert status and torch.isfinite(train_step(result, next(iter(result.dataloader))))
        warned = [r.getMessage() for r in caplog.records if "changes nothing here" in r.getMessage()]
        if idle is None:
            assert not warned, warned
        else:
            assert len(warned) == 1 and warned[0].startswith(f"{idle} changes nothing here, applied as asked: ")


def test_default_space_on_gpu_offers_cpu_offload_and_no_micro_batch_without_batch(model):
    space = SearchSpace.default_for(model, world_size=4, device_type="cuda")
    labels = space.labels()
    assert "micro_batch" not in labels          # the global batch is unknown: nothing to split
    assert "fsdp(cpu_offload=True)" in labels["zero"] and "zero2(cpu_offload=True)" in labels["zero"]
    # Only 2 layers: no pipeline of 4 stages.
    assert "parallel_mode(data=2,pipeline=2)+pipeline_parallel" in labels["parallel"]
    assert not any("pipeline=4" in label for label in labels["parallel"])


def test_the_space_holds_only_layouts_the_global_batch_splits_over(model):
    """auto_accelerate refuses a global batch that does not split over the data ranks; the search
    must not offer such a layout (it would win a dry run and then be refused)."""
    space = SearchSpace.default_for(model, world_size=4, device_type="cpu", global_batch_size=6)
    layouts = {c.strategy.describe().split("+")[0] for c in space.candidates()}
    assert layouts and not [s for s in layouts if "data=4" in s]
    assert space.batch_refused and all("data=4" in s for s in space.batch_refused)
    assert all("not divisible by the data-parallel size 4" in why for why in space.batch_refused.values())
    assert set(space.batch_refused) <= set(space.rejected)
    assert not SearchSpace.default_for(model, world_size=4, device_type="cpu", global_batch_size=8).batch_refused


def test_a_users_loss_func_keeps_pipelines_out_of_the_space_and_is_refused_by_pipeline_parallel(model):
    """A pipeline computes the causal-LM loss from logits on its last stage: a loss_func(batch, output)
    would be silently ignored, so no pipeline candidate is offered and a named one is refused."""
    with_pipeline = SearchSpace.default_for(model, world_size=2, device_type="cpu", global_batch_size=8)
    assert any("pipeline_parallel" in s.names() for s in with_pipeline.strategies())
    space = SearchSpace.default_for(model, world_size=2, device_type="cpu", global_batch_size=8, loss_func_given=True)
    assert space.strategies() and not any("pipeline_parallel" in s.names() for s in space.strategies())
    assert not any("pipeline_parallel" in s.names() for s in space.restricted(excluded=["fsdp"]).strategies())
    context = ValidationContext(world_size=2, model=model, model_config=model.config, global_batch_size=8,
                                loss_func_given=True)
    with pytest.raises(ValueError, match="auto_accelerate's loss_func cannot be applied"):
        resolve_strategy(Strategy([("parallel_mode", ([("pipeline", 2)], None)), "pipeline_parallel"]), context)


def test_excluding_ddp_keeps_only_candidates_where_something_else_reduces_gradients(model):
    space = SearchSpace.default_for(model, world_size=2, device_type="cpu", global_batch_size=8)
    assert any("ddp" in s.names() for s in space.strategies())
    no_ddp = space.restricted(excluded=["ddp"])
    assert no_ddp.strategies() and not any("ddp" in s.names() for s in no_ddp.strategies())
    assert any("resolution adds it" in why for why in no_ddp.rejected.values())
    with pytest.raises(ValueError, match="parallel_mode cannot be excluded"):
        space.restricted(excluded=["parallel_mode"])


# -- registry parameter ------------------------------------------------------------------------

@dataclass(frozen=True)
class _FlagConfig:
    on: bool = True


class _Fast(Optimization):
    name = "t_fast"
    order = 50
    Config = _FlagConfig
    search_dimension = "speed"

    @classmethod
    def search_choices(cls, context: ValidationContext) -> List[Any]:
        return [None, cls.name, (cls.name, {"on": False})]

    def validate(self, config: _FlagConfig, context: ValidationContext) -> None:
        if not config.on and "t_needs_on" in context.configs:
            raise ValueError("t_fast(on=False) and t_needs_on cannot be combined")


class _NeedsOn(Optimization):
    name = "t_needs_on"
    order = 60
    search_dimension = "other"


def test_space_with_its_own_registry():
    registry = default_registry().with_optimizations(_Fast, _NeedsOn)
    assert "t_fast" not in default_registry().names()      # the global registry is untouched
    only = Registry.of(default_registry().get("parallel_mode"), _Fast, _NeedsOn)
    space = SearchSpace.default_for(None, world_size=1, registry=only)
    assert space.labels() == {"parallel": ["parallel_mode(data=1)"], "speed": ["none", "t_fast",
                                                                               "t_fast{'on': False}"],
                              "other": ["none", "t_needs_on"]}
    cands = [frozenset(c.strategy.names()) for c in space.candidates()]
    assert len(cands) == 5 and "t_fast(on=False) and t_needs_on" in " ".join(space.rejected.values())
    # restricted() keeps the registry; the default registry does not know these names.
    assert len(space.restricted(excluded=["t_needs_on"]).candidates()) == 3
    assert SearchSpace({"x": [None, "t_fast"]}).strategies() == [Strategy(["parallel_mode"])]
    assert len(SearchSpace({"x": [None, "t_fast"]}, registry=registry).strategies()) == 2
    with pytest.raises(ValueError, match="registered twice"):
        registry.with_optimizations(_Fast)


class _Idle(Optimization):
    name = "t_idle"
    order = 50
    search_dimension = "idle"

    @classmethod
    def changes_nothing(cls, config: Any, context: ValidationContext) -> Any:
        return "it never does anything"


class _NeedsIdle(Optimization):
    name = "t_needs_idle"
    order = 60
    requires = frozenset({"t_idle"})
    search_dimension = "other"


def test_an_optimization_that_changes_nothing_is_dropped_only_where_the_space_has_the_one_without():
    only = Registry.of(default_registry().get("parallel_mode"), _Idle, _NeedsIdle)
    space = SearchSpace.default_for(None, world_size=1, registry=only)
    names = sorted(sorted(c.strategy.names()) for c in space.candidates())
    # t_idle alone measures as "none"; with t_needs_idle it is kept: nothing else reaches that one.
    assert names == [["parallel_mode"], ["parallel_mode", "t_idle", "t_needs_idle"]]
    assert "the same as without it: t_idle: it never does anything" in space.rejected.values()
    assert len(SearchSpace.default_for(None, world_size=1, registry=only).restricted(
        included=["t_idle"]).candidates()) == 2
    kept = SearchSpace(space.dimensions, world_size=1, registry=only, merge_idle=False)
    assert len(kept.candidates()) == 3


# -- validation cache --------------------------------------------------------------------------

def test_validation_cache_replays_outcomes_only_when_what_was_read_agrees():
    calls = []

    class Reader(Optimization):
        name = "t_reader"

        def validate(self, config: Any, context: ValidationContext) -> None:
            calls.append(config)
            if context.configs.get("amp_native") is not None:
                raise ValueError("t_reader refuses amp")

    cache = ValidationCache()
    opt = Reader()
    for other in ({"zero1": 1}, {"zero2": 2}, {"fsdp": 3}):   # keys it never reads: one real call
        cache(opt, None, ValidationContext(world_size=2, configs=dict(other)))
    assert len(calls) == 1 and cache.hits == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="refuses amp"):
            cache(opt, None, ValidationContext(world_size=2, configs={"amp_native": "bf16"}))
    assert len(calls) == 2 and cache.hits == 3
    cache(opt, "another config", ValidationContext(world_size=2, configs={}))
    assert len(calls) == 3

    class Iterates(Reader):   # reads every config: never reused
        name = "t_iterates"

        def validate(self, config: Any, context: ValidationContext) -> None:
            calls.append(sorted(context.configs))

    for _ in range(2):
        cache(Iterates(), None, ValidationContext(world_size=2, configs={"zero1": 1}))
    assert len(calls) == 5


def test_cached_enumeration_equals_uncached(model, monkeypatch):
    cached = SearchSpace.default_for(model, world_size=2, global_batch_size=8)
    expected = cached.strategies()
    monkeypatch.setattr(space_module, "ValidationCache", lambda: None)
    plain = SearchSpace.default_for(model, world_size=2, global_batch_size=8)
    assert plain.strategies() == expected
    assert plain.rejected == cached.rejected


# -- gradient_accumulation ---------------------------------------------------------------------

def test_gradient_accumulation_validation():
    def resolve(strategy, batch=8, world=2):
        return resolve_strategy(Strategy(strategy), ValidationContext(world_size=world, global_batch_size=batch))

    resolved = resolve([("gradient_accumulation", 4)])
    assert [r.name for r in resolved] == ["parallel_mode", "gradient_accumulation", "ddp"]
    assert resolved[1].config.steps == 4
    with pytest.raises(ValueError, match=r"steps=3 does not divide the per-rank batch 4 \(global batch 8"):
        resolve([("gradient_accumulation", {"steps": 3})])
    with pytest.raises(ValueError, match="needs its number of micro-batches"):
        resolve(["gradient_accumulation"])
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        resolve([("gradient_accumulation", 0)])
    with pytest.raises(ValueError, match="cannot be combined"):
        resolve([("gradient_accumulation", 2), "deepspeed_3d_parallel"])
    # Pipeline chunks split each micro-batch further: 8 rows / 2 steps = 4 rows into 2 chunks is fine, 4 steps not.
    pp = [("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), "pipeline_parallel"]
    resolve([("gradient_accumulation", 2), *pp])
    with pytest.raises(ValueError, match="do not split into the pipeline's 2 chunks"):
        resolve([("gradient_accumulation", 8), *pp])
    resolve([("gradient_accumulation", 3)], batch=None)       # unknown batch: checked when applied


@pytest.mark.parametrize("strategy, error", [
    ([("zero2", {"use_ds_zero": True})], r"does not apply to DeepSpeed's ZeRO engine \(zero2 with use_ds_zero=True\)"),
    ([("fsdp", {"use_ds_zero": True})], r"\(fsdp with use_ds_zero=True\), which decides when it reduces"),
    ([("zero1", {"use_ds_zero": True})], "zero1 with use_ds_zero=True"),
])
@pytest.mark.parametrize("sync", [True, False])
def test_accumulation_sync_is_refused_where_deepspeed_decides_it(strategy, error, sync):
    context = ValidationContext(world_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match=f"sync_each_micro_step={sync} .*{error}"):
        resolve_strategy(Strategy([("gradient_accumulation", {"steps": 2, "sync_each_micro_step": sync}),
                                   *strategy]), context)
    resolve_strategy(Strategy([("gradient_accumulation", 2), *strategy]), context)      # unset: DeepSpeed's way


def test_accumulation_sync_choices_elsewhere():
    context = ValidationContext(world_size=2, global_batch_size=8)
    pp = [("parallel_mode", ([("data", 1), ("pipeline", 2)], None)), "pipeline_parallel"]
    with pytest.raises(ValueError, match="sync_each_micro_step=False is not possible with pipeline_parallel"):
        resolve_strategy(Strategy([("gradient_accumulation", {"steps": 2, "sync_each_micro_step": False}), *pp]),
                         context)
    for sync in (True, False):
        for strategy in ([], ["fsdp"], ["zero2"], ["zero1"]):
            resolved = resolve_strategy(Strategy([("gradient_accumulation", {"steps": 2, "sync_each_micro_step": sync}),
                                                  *strategy]), context)
            assert resolved[1].config.sync_each_micro_step is sync
    resolve_strategy(Strategy([("gradient_accumulation", {"steps": 2, "sync_each_micro_step": True}), *pp]), context)
    with pytest.raises(ValueError, match="sync_each_micro_step='yes' must be True, False or None"):
        resolve_strategy(Strategy([("gradient_accumulation", {"steps": 2, "sync_each_micro_step": "yes"})]), context)


# -- micro-batch splitting ---------------------------------------------------------------------

def test_split_batch_shapes():
    ids = torch.arange(12).reshape(6, 2)
    parts = split_batch({"input_ids": ids, "labels": ids + 1, "scale": torch.tensor(2.0), "tag": "x"}, 3)
    assert len(parts) == 3
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert all(p["scale"].item() == 2.0 and p["tag"] == "x" and p["labels"].shape == (2, 2) for p in parts)
    a, b = split_batch((ids, [ids, ids]), 2)
    assert a[0].shape == (3, 2) and isinstance(a[1], list) and torch.equal(b[1][1], ids[3:])
    assert split_batch(ids, 1)[0] is ids
    with pytest.raises(ValueError, match="6 rows does not split into gradient_accumulation_steps=4"):
        split_batch(ids, 4)
    with pytest.raises(ValueError, match="needs a batch of tensors"):
        split_batch({"tag": "x"}, 2)


def test_a_smaller_last_batch_splits_into_row_weighted_micro_batches():
    from atorch.auto.result import AutoAccelerateResult
    from atorch.auto.train_step import micro_batches

    result = AutoAccelerateResult(model=torch.nn.Linear(1, 1), optim=None, dataloader=None, loss_func=None,
                                  prepare_input=None, global_batch_size=16, data_parallel_size=2)   # 8 rows a rank
    ids = torch.arange(14).reshape(7, 2)
    parts, weights = micro_batches(result, {"input_ids": ids}, 4)             # 7 rows: 2 + 2 + 2 + 1
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2, 1] and weights == [2 / 7, 2 / 7, 2 / 7, 1 / 7]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    parts, weights = micro_batches(result, ids[:3], 4)                        # fewer rows than micro-batches
    assert len(parts) == 3 and weights == [1 / 3] * 3
    parts, weights = micro_batches(result, ids[:4], 4)                        # splits evenly: no weights
    assert len(parts) == 4 and weights is None
    with pytest.raises(ValueError, match="10 rows does not split into gradient_accumulation_steps=4"):
        micro_batches(result, torch.zeros(10, 2), 4)                          # not a smaller last batch
    assert micro_batches(result, ids, 1) == ([ids], None)
