"""What auto_accelerate returns after dry runs is usable like what it returns without them (2 gloo ranks).

Each dry run builds its candidate over process groups of its own and retires them afterwards. DTensor caches
sharding propagation by spec, and a spec's DeviceMesh compares equal to one of the same ranks over another
group: the FSDP2 model returned after a dry run got parameters naming the destroyed group, and gradient
clipping, `full_tensor()` and a full state dict raised "Could not resolve the process group registered under
the name 1" (an outside probe, session 30). Checked here on the dry-run-checked load of an FSDP2 strategy.
"""

import torch

from atorch.testing import run_distributed, tiny_llama

DRY_RUN_ENV = {"ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_PROFILE_STEP": "3", "ATORCH_DRYRUN_MAX_STEPS": "4",
               "ATORCH_SEARCH_CACHE": "off"}


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 100
        return {"input_ids": ids, "labels": ids}


def _fsdp_after_a_dry_run(report_dir):
    import os

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from atorch.auto import auto_accelerate, train_step

    os.environ["ATORCH_SEARCH_REPORT_DIR"] = report_dir
    status, result, strategy = auto_accelerate(
        tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=_Tokens(), optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8}, load_strategy=["parallel_mode", "fsdp"],
        ignore_dryrun_on_load_strategy=False)
    assert status, "the dry-run-checked load failed"
    batch = next(iter(result.dataloader))
    sharded = [p for p in result.model.parameters() if isinstance(p, DTensor)]
    groups = {p.device_mesh.get_group().group_name for p in sharded}      # raised for a destroyed group
    losses = [float(train_step(result, batch, max_grad_norm=1.0)) for _ in range(2)]
    full = sharded[0].full_tensor()
    state = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))
    return {"groups": sorted(groups), "data_group": result.parallel.mesh.get_group().group_name,
            "losses": losses, "full": tuple(full.shape), "state": len(state)}


def test_an_fsdp2_model_returned_after_a_dry_run_uses_the_live_groups(tmp_path):
    out = run_distributed(_fsdp_after_a_dry_run, 2, str(tmp_path), env=DRY_RUN_ENV, timeout=300)
    for rank in out:
        assert rank["groups"] == [rank["data_group"]], rank
        assert all(torch.isfinite(torch.tensor(rank["losses"]))) and rank["state"] > 0
        assert rank["full"] == out[0]["full"]
