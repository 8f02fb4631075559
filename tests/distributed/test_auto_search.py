"""`auto_accelerate` with no strategy on the tiny Llama over 2 gloo ranks: search, apply, train, report.

One spawn: the automatic search completes and returns the same strategy on both ranks, that
strategy trains (the loss goes down), the trial table, the plot and the strategy JSON are
written, the saved strategy loads back (with its dry-run check), and excluded/included
restrict what the search tries.
"""

import json
import os

import pandas as pd
import pytest
import torch

from atorch.testing import run_distributed, tiny_llama

GLOBAL_BATCH, SEQ, STEPS = 8, 64, 6
SEARCH_ENV = {"BO_SG_MAX_IETR": "8", "MAX_PATIENCE": "5", "RANDOM_SAMPLE": "2",
              "ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_PROFILE_STEP": "2", "ATORCH_DRYRUN_TIMEOUT": "60"}


def _accelerate(**kwargs):
    from atorch.auto import auto_accelerate
    from atorch.testing.parity import TokenDataset

    return auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(n=64, seq_len=SEQ),
                           optim_args={"lr": 3e-3}, model_input_format="unpack_dict",
                           dataloader_args={"batch_size": GLOBAL_BATCH}, **kwargs)


def _train(result, steps):
    from atorch.auto import train_step

    losses = []
    batches = iter(result.dataloader)
    for _ in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(result.dataloader)
            batch = next(batches)
        losses.append(float(train_step(result, batch)))
    return losses


def _search_and_train(report_dir, strategy_file):
    import torch.distributed as dist

    out = {}
    status, result, strategy = _accelerate(report_path=report_dir, save_strategy_to_file=strategy_file)
    out["status"], out["strategy"] = status, strategy.to_json() if strategy is not None else None
    out["losses"] = _train(result, STEPS)
    out["report"] = result.args.get("search_report")
    out["reason"] = result.args.get("search_reason")
    del result
    dist.barrier()

    # The saved strategy loads back, passes its dry run and trains.
    status, result, loaded = _accelerate(load_strategy=strategy_file, ignore_dryrun_on_load_strategy=False)
    out["loaded_status"], out["loaded"] = status, loaded.to_json()
    out["loaded_losses"] = _train(result, 2)
    del result
    dist.barrier()

    # excluded / included restrict the space.
    status, result, restricted = _accelerate(excluded=["fsdp", "zero2", "tensor_parallel"], included=["checkpoint"],
                                             report_path=os.path.join(report_dir, "restricted"))
    out["restricted_status"] = status
    out["restricted"] = restricted.names()
    del result
    dist.barrier()
    return out


@pytest.mark.heavy
def test_auto_accelerate_searches_trains_and_reports(tmp_path):
    report_dir = str(tmp_path / "search")
    strategy_file = str(tmp_path / "strategy.json")
    rank0, rank1 = run_distributed(_search_and_train, 2, report_dir, strategy_file, env=SEARCH_ENV, timeout=600)

    assert rank0["status"] and rank1["status"]
    assert rank0["strategy"] == rank1["strategy"], "ranks chose different strategies"
    # The chosen strategy trains: finite losses, lower after a few steps at lr 3e-3.
    losses = rank0["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses

    # Report: trial table, plot, strategy JSON, one-line reason (rank 0 writes them).
    paths = rank0["report"]
    assert paths and rank1["report"] is None
    trials = pd.read_csv(paths["table"])
    assert 1 <= len(trials) <= 8 and (trials["status"] == "ok").any()
    assert trials["strategy"].is_unique                      # no strategy dry-run twice
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    chosen = json.loads(rank0["strategy"])
    with open(strategy_file) as f:
        assert json.load(f) == chosen
    best_row = trials.loc[trials["throughput"].idxmax()]
    from atorch.auto.strategy import Strategy

    assert best_row["strategy"] == Strategy.from_json(rank0["strategy"]).describe()
    assert rank0["reason"] and "\n" not in rank0["reason"] and rank0["reason"] == rank1["reason"]

    assert rank0["loaded_status"] and rank0["loaded"] == rank0["strategy"]
    assert all(torch.isfinite(torch.tensor(rank0["loaded_losses"])))

    assert rank0["restricted_status"] and rank0["restricted"] == rank1["restricted"]
    assert "checkpoint" in rank0["restricted"]
    assert not {"fsdp", "zero2", "tensor_parallel"} & set(rank0["restricted"])
    restricted = pd.read_csv(os.path.join(report_dir, "restricted", "trials.csv"))
    assert restricted["strategy"].str.contains("checkpoint").all()
    assert not restricted["strategy"].str.contains("fsdp|zero2|tensor").any()
