"""ATorch's auto_accelerate keywords and positional order, translated by `atorch.auto.compat` and wired in.

From ATorch (dlrover bfd04ef1, `atorch/auto/accelerate.py` and `model_context.py`): the
positional order; `sample_batch` with `batch_size`/`expand_sample_batch` stands in for a dataset
in dry runs (no dataloader is made from it; `batch_size` is global and each data rank gets its
share); `distributed_sampler_cls(dataset, shuffle=, num_replicas=, rank=, seed=sampler_seed)`;
`finetune_strategy` resets the configs of a loaded strategy's items but `parallel_mode`.
"""

import types

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from atorch.auto import auto_accelerate
from atorch.auto.compat import (
    ATORCH_POSITIONAL_ORDER,
    SampleBatchDataset,
    bind_atorch_positional,
    check_sampler_cls,
    finetune_strategy_items,
    translate_atorch_kwargs,
)
from atorch.auto.strategy import Strategy
from atorch.data import expand_batch_dim
from atorch.testing import run_distributed


def test_positional_order_is_atorchs():
    assert ATORCH_POSITIONAL_ORDER[:10] == ("model", "optim_func", "dataset", "loss_func", "prepare_input",
                                            "model_input_format", "optim_args", "optim_param_func",
                                            "dataloader_args", "distributed_sampler_cls")
    assert ATORCH_POSITIONAL_ORDER[10:] == ("excluded", "included", "load_strategy", "lr_scheduler_cls",
                                            "lr_scheduler_args", "finetune_strategy", "save_strategy_to_file")
    bound = bind_atorch_positional("m", torch.optim.SGD, None, None, None, "unpack_dict", {"lr": 1}, None,
                                   {"batch_size": 8}, None, None, None, ["fsdp"], load_strategy_extra=1)
    assert bound["load_strategy"] == ["fsdp"] and bound["model_input_format"] == "unpack_dict"
    assert bound["dataloader_args"] == {"batch_size": 8} and bound["load_strategy_extra"] == 1
    with pytest.raises(TypeError, match="multiple values for argument"):
        bind_atorch_positional("m", None, dataset=None, optim_func=None)
    with pytest.raises(TypeError, match="at most 17 positional arguments"):
        bind_atorch_positional(*range(18))


def test_sample_batch_arguments():
    out = translate_atorch_kwargs(sample_batch={"x": torch.ones(3)}, batch_size=4)
    stand_in = out.dry_run_dataset()
    assert isinstance(stand_in, SampleBatchDataset) and len(stand_in) == 4
    with pytest.raises(ValueError, match="dataset and sample_batch exclude each other"):
        translate_atorch_kwargs(dataset=[1], sample_batch=torch.ones(1), batch_size=1)
    with pytest.raises(ValueError, match=r"batch_size=8 sizes sample_batch, which is not given; .*dataloader_args"):
        translate_atorch_kwargs(batch_size=8)
    with pytest.raises(ValueError, match=r"sample_batch needs batch_size="):
        translate_atorch_kwargs(sample_batch=torch.ones(2))
    with pytest.raises(ValueError, match=r"batch_size=0 must be an integer >= 1"):
        translate_atorch_kwargs(sample_batch=torch.ones(2), batch_size=0)
    with pytest.raises(ValueError, match="share the leading \\(batch\\) dimension"):
        translate_atorch_kwargs(sample_batch={"a": torch.ones(2, 3), "b": torch.ones(3)}, batch_size=2,
                                expand_sample_batch=False)
    with pytest.raises(ValueError, match="sample_batch holds no tensor"):
        translate_atorch_kwargs(sample_batch="text", batch_size=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['sample_btach'\]"):
        translate_atorch_kwargs(sample_btach=1)
    assert translate_atorch_kwargs(meta_init_offload_name="x").ignored == {"meta_init_offload_name": "x"}


def test_sample_batch_dataset_rows_match_expand_batch_dim():
    sample = {"x": torch.arange(3.0), "y": torch.tensor(1)}
    one = DataLoader(SampleBatchDataset(sample, 6), batch_size=3)
    batches = list(one)
    assert len(batches) == 2
    expected = expand_batch_dim(sample, 3)
    assert all(torch.equal(b["x"], expected["x"]) and torch.equal(b["y"], expected["y"]) for b in batches)
    # A batch (expand_sample_batch=False): its rows, repeated up to the global row count.
    batch = torch.arange(6.0).view(2, 3)
    rows = [SampleBatchDataset(batch, 5, is_one_sample=False)[i] for i in range(5)]
    assert [int(r[0]) for r in rows] == [0, 3, 0, 3, 0]
    with pytest.raises(IndexError):
        SampleBatchDataset(batch, 5, is_one_sample=False)[5]


def test_sampler_seed_and_class_checks():
    assert translate_atorch_kwargs(sampler_seed=5).dataloader_args({"batch_size": 2}) == {"batch_size": 2, "seed": 5}
    assert translate_atorch_kwargs().dataloader_args({"seed": 3}) == {"seed": 3}
    with pytest.raises(ValueError, match=r"sampler_seed=5 and dataloader_args\['seed'\]=3 disagree"):
        translate_atorch_kwargs(sampler_seed=5).dataloader_args({"seed": 3})
    with pytest.raises(ValueError, match="sampler_seed='1' must be an int"):
        translate_atorch_kwargs(sampler_seed="1")

    class NoSeed:
        def __init__(self, dataset, num_replicas, rank, shuffle=True):
            pass

    class Wrong:
        def __init__(self, dataset):
            pass

    check_sampler_cls(NoSeed)
    check_sampler_cls(DistributedSampler)
    with pytest.raises(ValueError, match=r"Wrong takes no \['num_replicas', 'rank'\]"):
        check_sampler_cls(Wrong)
    with pytest.raises(ValueError, match="distributed_sampler_cls=3 must be a sampler class"):
        translate_atorch_kwargs(distributed_sampler_cls=3)


def test_finetune_strategy_resets_configs_but_parallel_mode():
    loaded = Strategy([("parallel_mode", ([("data", 2)], None), False), ("checkpoint", ("Block",), False),
                       ("amp_native", {"dtype": "fp16"}, True)])
    assert finetune_strategy_items(loaded).to_list() == [("parallel_mode", ([("data", 2)], None), False),
                                                         ("checkpoint", None, True), ("amp_native", None, True)]
    assert translate_atorch_kwargs(load_strategy=loaded, finetune_strategy=True).finetune_strategy is True
    with pytest.raises(ValueError, match="finetune_strategy=True tunes a loaded strategy; pass load_strategy"):
        translate_atorch_kwargs(finetune_strategy=True)


# -- wired into auto_accelerate (one process) ---------------------------------------------------

ROWS: list = []   # row counts of the batches every Recorder's forward saw (dry runs train copies of the model)


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x):
        ROWS.append(int(x.shape[0]))
        return self.fc(x).pow(2).mean()


def _loss(batch, output):
    return output


def test_auto_accelerate_refuses_bad_atorch_keywords_before_anything():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['sample_btach'\]"):
        auto_accelerate(Recorder(), sample_btach=torch.ones(3))
    with pytest.raises(ValueError, match="sample_batch needs batch_size="):
        auto_accelerate(Recorder(), sample_batch=torch.ones(3), load_strategy=[])
    with pytest.raises(ValueError, match=r"takes no \['num_replicas', 'rank'\]"):
        auto_accelerate(Recorder(), distributed_sampler_cls=type("S", (), {"__init__": lambda self, d: None}))


def test_sample_batch_feeds_the_dry_run_of_a_loaded_strategy():
    ROWS.clear()
    status, result, _ = auto_accelerate(Recorder(), torch.optim.SGD, loss_func=_loss, optim_args={"lr": 0.1},
                                        load_strategy=[], ignore_dryrun_on_load_strategy=False,
                                        sample_batch=torch.ones(3), batch_size=4)
    assert status and result is not None
    assert result.dataloader is None          # as in ATorch: no dataloader from a sample batch
    assert ROWS and set(ROWS) == {4}          # the dry run's batches: the sample, expanded to batch_size
    # Without a dataset or a sample batch the dry run has nothing to run: refused before anything is built.
    with pytest.raises(ValueError, match="ignore_dryrun_on_load_strategy=False dry-runs the loaded strategy on "
                                         "batches of the dataset, but no dataset was given"):
        auto_accelerate(Recorder(), torch.optim.SGD, loss_func=_loss, optim_args={"lr": 0.1},
                        load_strategy=[], ignore_dryrun_on_load_strategy=False)


def test_sample_batch_is_the_search_dataset(monkeypatch):
    import atorch.auto.search.auto_search as auto_search

    seen = {}

    def fake_search(ctx, **kwargs):
        seen["dataset"], seen["args"] = ctx.dataset, dict(ctx.dataloader_args)
        return types.SimpleNamespace(strategy=Strategy([]), result=None, report=None, reason="fake")

    monkeypatch.setattr(auto_search, "search_for_context", fake_search)
    batch = torch.ones(2, 3)
    status, result, _ = auto_accelerate(Recorder(), torch.optim.SGD, loss_func=_loss, optim_args={"lr": 0.1},
                                        dataloader_args={"collate_fn": None, "num_workers": 0},
                                        sample_batch=batch, batch_size=6, expand_sample_batch=False)
    assert status and result.dataloader is None
    assert isinstance(seen["dataset"], SampleBatchDataset) and len(seen["dataset"]) == 6
    assert seen["args"] == {"batch_size": 6, "num_workers": 0}    # collate_fn dropped: the sample is model input


def test_finetune_strategy_applies_defaults():
    loaded = [("amp_native", {"dtype": "fp16"})]
    status, result, strategy = auto_accelerate(Recorder(), torch.optim.SGD, loss_func=_loss,
                                               optim_args={"lr": 0.1}, load_strategy=loaded,
                                               finetune_strategy=True)
    assert status and result.autocast_dtype == torch.bfloat16     # atorch's amp_native default
    # parallel_mode is always added (documented); the loaded item is marked tunable, as ATorch's reset_config did.
    assert [(i.name, i.tunable) for i in strategy if i.name != "parallel_mode"] == [("amp_native", True)]
    status, result, _ = auto_accelerate(Recorder(), torch.optim.SGD, loss_func=_loss, optim_args={"lr": 0.1},
                                        load_strategy=loaded)
    assert result.autocast_dtype == torch.float16


# -- two gloo ranks: sampler class and seed, sample batch split over data ranks -----------------

class SeededSampler(DistributedSampler):
    """A user's sampler class with DistributedSampler's constructor; records what it was built with."""

    built: list = []

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        SeededSampler.built.append((num_replicas, rank, shuffle, seed))


class Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3,), float(i))


def _two_ranks() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    strategy = [("parallel_mode", ([("data", 2)], None))]
    status, result, _ = auto_accelerate(Recorder(), torch.optim.SGD, Indexed(), _loss, None, None, {"lr": 0.1},
                                        None, {"batch_size": 4, "shuffle": True}, SeededSampler,
                                        load_strategy=strategy, sampler_seed=7)
    assert status
    seen = [int(x) for b in result.dataloader for x in b[:, 0]]
    expected = list(DistributedSampler(Indexed(), num_replicas=2, rank=rank, shuffle=True, seed=7))
    ROWS.clear()
    status2, result2, _ = auto_accelerate(Recorder(), torch.optim.SGD, None, _loss, None, None, {"lr": 0.1},
                                          load_strategy=strategy, ignore_dryrun_on_load_strategy=False,
                                          sample_batch=torch.ones(3), batch_size=6)
    out = {"built": SeededSampler.built[-1], "seen": seen, "expected": expected, "sample_status": status2,
           "sample_rows": sorted(set(ROWS)), "loader": result2.dataloader is None}
    del result, result2
    dist.barrier()
    return out


@pytest.mark.distributed
@pytest.mark.heavy   # one spawn of 2 ranks: 40-60 s on the shared 2-core machine
def test_two_ranks_sampler_class_seed_and_sample_batch():
    outs = run_distributed(_two_ranks, 2)
    for rank, out in enumerate(outs):
        assert out["built"] == (2, rank, True, 7)
        assert out["seen"] == out["expected"] and len(out["seen"]) == 8
        assert out["sample_status"] and out["loader"]
        assert out["sample_rows"] == [3]        # global batch_size=6 over 2 data ranks
    assert sorted(outs[0]["seen"] + outs[1]["seen"]) == list(range(16))


def test_a_sample_batch_the_model_cannot_take_is_refused_before_any_dry_run():
    """Each of these ended every dry run with status=False and the reason only in the log."""
    from atorch.testing import tiny_llama

    ids = torch.randint(4, 100, (2, 16))

    def accelerate(sample_batch, expand=True):
        return auto_accelerate(tiny_llama(), torch.optim.AdamW, sample_batch=sample_batch, batch_size=2,
                               expand_sample_batch=expand, model_input_format="unpack_dict",
                               load_strategy=["parallel_mode"], ignore_dryrun_on_load_strategy=False)

    with pytest.raises(ValueError, match=r"sample_batch\['input_ids'\] has shape \(2, 16\), a batch; with "
                                         r"expand_sample_batch=True \(ATorch's default\) sample_batch is one sample"):
        accelerate({"input_ids": ids, "labels": ids})
    with pytest.raises(ValueError, match=r"sample_batch\['labels'\] has shape \(2, 8\) but sample_batch\['input_ids'\] "
                                         r"has shape \(2, 16\)"):
        accelerate({"input_ids": ids, "labels": ids[:, :8]}, expand=False)
    with pytest.raises(ValueError, match=r"sample_batch\['input_ids'\] is a float32 tensor"):
        accelerate({"input_ids": ids.float(), "labels": ids}, expand=False)
    with pytest.raises(ValueError, match=r"sample_batch\['input_ids'\] holds token id \d+, outside LlamaForCausalLM's "
                                         r"vocabulary"):
        accelerate({"input_ids": ids + 5000, "labels": ids}, expand=False)
    with pytest.raises(TypeError, match=r"calls model\(\*\*batch\), but sample_batch \(the dry runs' dataset\[0\]\) "
                                        r"is tuple"):
        accelerate((ids[0], ids[0]))
    status, _, _ = accelerate({"input_ids": ids[0], "labels": ids[0]})
    assert status
