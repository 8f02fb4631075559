"""What the pipeline's helpers in atorch/utils leave behind: the disk-offloaded meta initialization removes
the temporary directory it created (on an error at once, its files once reloaded), and the peak-memory
tracker gives torch's `UntypedStorage.resize_` back when the last tracker exits."""

import gc
import glob
import os
import tempfile

import pytest
import torch
from torch import nn

from atorch.utils.meta_model_utils import init_empty_weights_with_disk_offload, reload_meta_module
from atorch.utils.peak_memory import PeakMemoryTracker


def _offload_dirs():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "atorch_meta_offload_*")))


def test_a_temporary_offload_directory_is_removed_after_reload_and_on_error():
    before = _offload_dirs()
    torch.manual_seed(0)
    with init_empty_weights_with_disk_offload():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    directory = os.path.dirname(model[0].weight.checkpoint_name)
    assert len(os.listdir(directory)) == 4
    reload_meta_module(model[0])                 # a sub-module alone: its files go, the others stay
    gc.collect()
    assert len(os.listdir(directory)) == 2
    reload_meta_module(model)
    gc.collect()
    assert not os.path.exists(directory)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)                 # the initial values came back before the files went

    with pytest.raises(RuntimeError, match="user code fails"):
        with init_empty_weights_with_disk_offload():
            nn.Linear(8, 8)
            raise RuntimeError("user code fails inside the block")
    with init_empty_weights_with_disk_offload():
        pass                                     # nothing built: nothing to keep
    assert _offload_dirs() == before


def test_offloaded_files_stay_while_a_tensor_names_them_and_in_a_given_directory(tmp_path):
    with init_empty_weights_with_disk_offload():
        model = nn.Linear(4, 4)
    directory = os.path.dirname(model.weight.checkpoint_name)
    reload_meta_module(model, delete_ckpt_name=False)      # the loaded tensors keep naming their files
    gc.collect()
    assert sorted(os.listdir(directory)) == ["0.pt", "1.pt"]
    weight = model.weight
    del model
    gc.collect()
    assert os.listdir(directory) == [weight.checkpoint_name.rsplit(os.sep, 1)[1]]
    del weight
    gc.collect()
    assert not os.path.exists(directory)

    with init_empty_weights_with_disk_offload(offload_path=str(tmp_path)):
        given = nn.Linear(4, 4)
    reload_meta_module(given)
    gc.collect()
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "1.pt"]     # the caller's directory: left alone


def test_the_peak_memory_tracker_restores_storage_resize():
    original = torch.UntypedStorage.resize_
    with PeakMemoryTracker(torch.device("cpu")) as outer:
        assert torch.UntypedStorage.resize_ is not original      # counting while a tracker is active
        with PeakMemoryTracker(torch.device("cpu")):
            pass
        assert torch.UntypedStorage.resize_ is not original      # the outer one still counts
        x = torch.ones(1024)
        x.untyped_storage().resize_(0)
        assert outer.live_bytes == 0                              # the resize was counted
    assert torch.UntypedStorage.resize_ is original
    with pytest.raises(torch.OutOfMemoryError):
        with PeakMemoryTracker(torch.device("cpu"), memory_limit_bytes=1024):
            torch.ones(1024)
    assert torch.UntypedStorage.resize_ is original               # also when the block raised
