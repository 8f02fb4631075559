"""The tokenizer that travels with a checkpoint: recorded by `save_checkpoint(..., tokenizer=...)`
under `<checkpoint>/tokenizer/`, copied by `merge_checkpoint` into the Hugging Face folder.

A merged folder without a tokenizer fails fine-tuning with a misleading sentencepiece message,
so the tokenizer is kept next to the weights it was trained with. The files are written into
the checkpoint's staging directory before it is committed, so the manifest checksums them.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, List, Optional

RECORDED_DIR = "tokenizer"
"""Where a checkpoint keeps its tokenizer's files."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "chat_template.json", "chat_template.jinja")
"""The files of a tokenizer directory that are copied (a model directory holds weights too)."""


def tokenizer_files_in(directory: str) -> List[str]:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def check_tokenizer(tokenizer: Any) -> None:
    """Raise ValueError unless `tokenizer` is a tokenizer object or a directory with tokenizer files.

    Pure and cheap, so `save_checkpoint` runs it on every rank before any collective.
    """
    if hasattr(tokenizer, "save_pretrained"):
        return
    if not isinstance(tokenizer, (str, os.PathLike)) or not os.path.isdir(tokenizer):
        raise ValueError(f"tokenizer={tokenizer!r} must be a tokenizer object (with save_pretrained) or a directory "
                         "of tokenizer files")
    if not tokenizer_files_in(os.fspath(tokenizer)):
        raise ValueError(f"tokenizer directory {os.fspath(tokenizer)} has none of the tokenizer files "
                         f"{list(TOKENIZER_FILES)}")


def save_tokenizer(tokenizer: Any, out_dir: str) -> None:
    """Write `tokenizer` (an object: its `save_pretrained`; a directory: its tokenizer files) into `out_dir`."""
    check_tokenizer(tokenizer)
    os.makedirs(out_dir, exist_ok=True)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out_dir)
        return
    src = os.fspath(tokenizer)
    for name in tokenizer_files_in(src):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))


def record_tokenizer(tokenizer: Any, checkpoint_dir: str) -> None:
    """Save side (rank 0, into the staging directory): keep the tokenizer with the checkpoint."""
    save_tokenizer(tokenizer, os.path.join(checkpoint_dir, RECORDED_DIR))


def recorded_tokenizer(checkpoint_dir: str) -> Optional[str]:
    """The directory of the tokenizer a checkpoint recorded, or None."""
    path = os.path.join(checkpoint_dir, RECORDED_DIR)
    return path if os.path.isdir(path) and tokenizer_files_in(path) else None
