"""Checkpoints: sharded save, load at any parallel layout, exact resume, crash safety, merge to Hugging Face.

    save_checkpoint(result, "ckpt/step_100", step=100)   # every rank its own shard
    state = load_checkpoint(result, "ckpt/step_100")     # into the current (possibly different) layout
    merge_checkpoint("ckpt/step_100", "hf_model/")       # offline, one process -> from_pretrained
    save_checkpoint(result, "ckpt/step_200", step=200, async_save=True)  # blocks only to copy to host
    wait_for_checkpoint()                                # before exit / destroy_process_group
"""

from atorch.checkpoint.async_save import wait_for_checkpoint
from atorch.checkpoint.manifest import CheckpointError
from atorch.checkpoint.merge import merge_checkpoint
from atorch.checkpoint.model_methods import attach_checkpoint_methods
from atorch.checkpoint.save_load import CheckpointState, load_checkpoint, save_checkpoint, verify_checkpoint
from atorch.checkpoint.state import DataPosition, resume_dataloader

__all__ = ["CheckpointError", "CheckpointState", "DataPosition", "attach_checkpoint_methods", "load_checkpoint",
           "merge_checkpoint", "resume_dataloader", "save_checkpoint", "verify_checkpoint",
           "wait_for_checkpoint"]
