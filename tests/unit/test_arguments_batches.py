"""auto_accelerate's arguments that the dry runs and the saved strategy depend on, refused or normalized before
anything is built: the default global batch size, batches for the dry runs, a strategy file that can be written."""

from typing import List

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.auto.accelerate import default_batch_size
from atorch.auto.model_context import ModelContext
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_llama
from atorch.testing.fake_distributed import fake_process_group
from atorch.testing.parity import TokenDataset

QUICK_DRY_RUN = {"ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_PROFILE_STEP": "1", "ATORCH_DRYRUN_MAX_STEPS": "2"}


class RecordingOptimizer:
    """optim_func that records each call: a call means the strategy was being applied."""

    def __init__(self) -> None:
        self.calls: List[int] = []

    def __call__(self, params, lr=0.01):
        self.calls.append(1)
        return torch.optim.SGD(params, lr=lr)


# -- the default global batch size: one number for validation, the dry run and the result ------------

def test_a_missing_batch_size_is_the_default_of_1_in_the_result_and_the_dry_run(monkeypatch):
    for key, value in QUICK_DRY_RUN.items():
        monkeypatch.setenv(key, value)
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.1}, load_strategy=[])
    assert status and result.global_batch_size == 1
    assert next(iter(result.dataloader))["input_ids"].shape[0] == 1
    # The dry run counts the samples of its steps from the same number (it counted 0: a failed dry run).
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.1}, load_strategy=[], ignore_dryrun_on_load_strategy=False)
    assert status and result.global_batch_size == 1


def test_a_missing_batch_size_over_two_data_ranks_is_refused_before_anything_is_built():
    optim = RecordingOptimizer()
    with fake_process_group(0, 2):
        with pytest.raises(ValueError, match=r"dataloader_args\['batch_size'\]=1 \(the global batch size\) is not "
                                             r"divisible by the data-parallel size 2"):
            auto_accelerate(tiny_llama(), optim, TokenDataset(n=8, seq_len=8), load_strategy=["parallel_mode"])
    assert optim.calls == []


def test_default_batch_size_leaves_it_absent_without_a_dataloader_or_for_deepspeed_3d():
    def ctx(dataset=None, **args):
        return ModelContext(model=torch.nn.Linear(2, 2), dataset=dataset, dataloader_args=dict(args))

    with_data = ctx(TokenDataset(n=4))
    default_batch_size(with_data, Strategy(["fsdp"]))
    assert with_data.dataloader_args == {"batch_size": 1}
    given = ctx(TokenDataset(n=4), batch_size=4)
    default_batch_size(given, None)
    assert given.dataloader_args == {"batch_size": 4}
    no_data = ctx()       # no dataloader: DeepSpeed's ZeRO engines keep ds_config's batch keys
    default_batch_size(no_data, None)
    assert no_data.dataloader_args == {}
    ds3d = ctx(TokenDataset(n=4))   # its global batch is ds_config's when the dataloader gives none
    default_batch_size(ds3d, Strategy(["parallel_mode", "ds_3d_parallel"]))
    assert ds3d.dataloader_args == {}


# -- dry runs need batches ------------------------------------------------------------------------

def test_a_dry_run_without_a_dataset_is_refused_before_anything_is_built():
    optim = RecordingOptimizer()
    with pytest.raises(ValueError, match=r"ignore_dryrun_on_load_strategy=False dry-runs the loaded strategy on "
                                         r"batches of the dataset, but no dataset was given; pass dataset="):
        auto_accelerate(tiny_llama(), optim, load_strategy=["parallel_mode"], ignore_dryrun_on_load_strategy=False)
    assert optim.calls == []


def test_a_search_without_a_dataset_is_refused_before_anything_is_built():
    optim = RecordingOptimizer()
    with pytest.raises(ValueError, match=r"load_strategy=None searches for a strategy by dry-running candidates on "
                                         r"batches of the dataset, but no dataset was given"):
        auto_accelerate(tiny_llama(), optim)
    assert optim.calls == []
    with pytest.raises(TypeError, match="ignore_dryrun_on_load_strategy='no' must be True or False"):
        auto_accelerate(tiny_llama(), optim, load_strategy=[], ignore_dryrun_on_load_strategy="no")


# -- save_strategy_to_file: a strategy a file cannot hold is refused before it is applied -------------------

def test_save_strategy_to_file_refuses_a_callable_before_anything_is_built(tmp_path):
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig

    optim = RecordingOptimizer()
    path = str(tmp_path / "strategy.json")
    strategy = [("parallel_mode", None), ("deepspeed_3d_parallel", DeepSpeed3DParallelConfig(logit_helper=abs))]
    with pytest.raises(ValueError, match=r"save_strategy_to_file='.*strategy.json': the strategy's "
                                         r"deepspeed_3d_parallel.config.logit_helper holds builtin_function_or_method "
                                         r".*drop save_strategy_to_file") as raised:
        auto_accelerate(tiny_llama(), optim, load_strategy=strategy, save_strategy_to_file=path)
    assert "instead of a file" not in str(raised.value)   # the user did pass it in code
    assert optim.calls == [] and not (tmp_path / "strategy.json").exists()


def test_apply_strategy_without_a_batch_size_reports_the_dataloaders_default():
    from atorch import distributed as adist
    from atorch.auto.engine import apply_strategy

    adist.init_distributed()    # as auto_accelerate does: one process, a group of one
    ctx = ModelContext(model=tiny_llama(), optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                       dataset=TokenDataset(n=4, seq_len=8))
    result = apply_strategy(ctx, Strategy([]))
    assert result.global_batch_size == 1 and next(iter(result.dataloader))["input_ids"].shape[0] == 1
