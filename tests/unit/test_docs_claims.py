"""What README.md, ARCHITECTURE.md and a few comments say, checked against the code (one process, seconds).

Each test names the claim it pins; where a claim is a snippet, the snippet's own calls are run.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from atorch.auto import Strategy, auto_accelerate, plan, train_step
from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.checkpoint import DataPosition, load_checkpoint, save_checkpoint
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
N_SAMPLES, BATCH = 32, 8


def _flat(text: str) -> str:
    """Markdown with its line breaks as spaces (claims wrap across lines)."""
    return re.sub(r"\s+", " ", text)


# -- "### Checkpoints": `state = load_checkpoint(result, ...)`, then the loop over result.dataloader ----------------

def _build(seed: int):
    status, result, _ = auto_accelerate(
        tiny_llama(seed=seed), torch.optim.AdamW, TokenDataset(n=N_SAMPLES, seq_len=8), optim_args={"lr": 1e-3},
        model_input_format="unpack_dict", dataloader_args={"batch_size": BATCH}, load_strategy=[])
    assert status
    return result


def _sample_index() -> Dict[tuple, int]:
    """Each sample's row of tokens -> its index in the dataset (rows tell TokenDataset's samples apart)."""
    return {tuple(row): i for i, row in enumerate(TokenDataset(n=N_SAMPLES, seq_len=8).tokens.tolist())}


def _indices(batch, key: Dict[tuple, int]) -> List[int]:
    return [key[tuple(row)] for row in batch["input_ids"].tolist()]


def test_readme_checkpoint_snippet_resumes_result_dataloader_at_the_next_sample(tmp_path):
    """README: `state = load_checkpoint(result, ...)` and a resume continues at the next sample of the epoch. A
    loop that goes on iterating `result.dataloader` (not `state.dataloader`) must get the batch after the saved
    position, not the epoch's first one; a second load into the same result resumes the original loader."""
    key = _sample_index()
    first = _build(0)
    batches = iter(first.dataloader)
    for step in (1, 2, 3):
        train_step(first, next(batches))
        save_checkpoint(first, str(tmp_path / f"step_{step}"), step=step)

    result = _build(1)
    state = load_checkpoint(result, str(tmp_path / "step_2"))
    assert state.data_position == DataPosition(0, 2, BATCH, sampler_epoch=0)
    assert _indices(next(iter(result.dataloader)), key) == list(range(16, 24))
    assert result.dataloader is state.dataloader
    assert [_indices(b, key)[0] for b in result.dataloader] == [16, 24]   # the rest of the epoch, once
    assert result[2] is result.dataloader   # the 7-tuple view follows the field

    # Loading again into the same result starts from the original loader, not from the resumed one.
    load_checkpoint(result, str(tmp_path / "step_3"))
    assert _indices(next(iter(result.dataloader)), key) == list(range(24, 32))
    # Then the next epoch is whole again once the sampler moves on (as the README's loop does).
    result.sampler.set_epoch(1)
    assert len(list(result.dataloader)) == N_SAMPLES // BATCH

    assert "for batch in result.dataloader:" in README.split("### Checkpoints", 1)[1].split("```", 2)[1]


# -- "Using it": plan returns the line (README and ARCHITECTURE.md said it printed it) -----------------------------

def test_plan_returns_the_line_the_docs_show(capsys):
    strategy = ["parallel_mode", ("amp_native", {"dtype": torch.bfloat16}), "fsdp", "checkpoint"]
    line = plan(strategy, world_size=2)
    assert isinstance(line, str) and capsys.readouterr().out == ""
    assert f"`{line}`" in README and f"`{line}`" in ARCHITECTURE
    assert "plan(strategy, world_size=N)` returns the stack" in _flat(README)
    assert "plan(strategy, world_size)` (`opt_lib/resolve.py`) returns the stack" in _flat(ARCHITECTURE)
    assert "prints the stack" not in README + ARCHITECTURE


# -- train_step's options are keyword-only, as the signature in the README shows ---------------------------------

def test_train_step_options_are_keyword_only_as_documented():
    params = inspect.signature(train_step).parameters
    kinds = {name: p.kind for name, p in params.items()}
    assert kinds["result"] == kinds["batch"] == inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert kinds["gradient_accumulation_steps"] == kinds["max_grad_norm"] == inspect.Parameter.KEYWORD_ONLY
    documented = "train_step(result, batch, *, gradient_accumulation_steps=None, max_grad_norm=None)"
    assert README.count(documented) == 2
    assert "train_step(result, batch, gradient_accumulation_steps" not in README


# -- "Errors": a first sample unpack_dict cannot unpack is a TypeError --------------------------------------------

def test_a_first_sample_unpack_dict_cannot_unpack_is_a_type_error_as_documented():
    from atorch.auto.arguments import check_sample_format

    with pytest.raises(TypeError, match="unpack_dict"):
        check_sample_format([(torch.zeros(3), torch.zeros(3))], "unpack_dict", {}, None)
    with pytest.raises(TypeError, match="unpack_sequence"):
        check_sample_format([{"input_ids": torch.zeros(3)}], "unpack_sequence", {}, None)
    errors = _flat(README.split("**Errors vs `status=False`.**", 1)[1].split("`ValueError` for a wrong value", 1)[0])
    assert "`TypeError` for a wrong kind of object" in errors
    assert 'a first sample that `model_input_format` cannot unpack: not a dict for `"unpack_dict"`' in errors


# -- ds_config gradient_clipping: only 0 is accepted; clipping is train_step's max_grad_norm ----------------------

@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_ds_config_gradient_clipping_is_refused_unless_zero_as_documented(clip):
    strategy = Strategy([("zero2", {"use_ds_zero": True, "ds_config": {"gradient_clipping": clip}})])
    context = ValidationContext(world_size=2, global_batch_size=8)
    if clip:
        with pytest.raises(ValueError, match="gradient_clipping=1.0.*max_grad_norm=1.0"):
            resolve_strategy(strategy, context)
    else:
        resolve_strategy(strategy, context)
    flat = _flat(README)
    assert "`gradient_clipping` may only be absent or 0" in flat
    assert "`gradient_clipping` may repeat" not in flat and "and `gradient_clipping` may repeat" not in flat


# -- the bundled tokenizer's size, as the comments give it --------------------------------------------------------

def test_the_tokenizer_size_in_the_comments_is_the_tokenizer_s():
    import atorch.testing.models as models
    from atorch.testing.assets import load_tokenizer

    tokenizer = load_tokenizer()
    size = len(tokenizer)
    assert max(tokenizer.get_vocab().values()) == size - 1 < models.TINY_VOCAB_SIZE
    assert f"only {size} entries" in inspect.getsource(models)
    script = (REPO / "scripts" / "train_tokenizer.py").read_text(encoding="utf-8")
    assert f"merges at {size} entries" in _flat(script)
    assert "with 1024 entries" not in script


# -- examples/llama2: --help gives the LoRA learning rate the tiny default uses -----------------------------------

def test_llama2_learning_rate_help_names_the_tiny_lora_default():
    sys.path.insert(0, str(REPO / "examples" / "llama2"))
    try:
        import example_utils as eu
    finally:
        sys.path.remove(str(REPO / "examples" / "llama2"))
    parser = eu.common_parser("x")
    eu.add_lora_fp8_args(parser)
    help_text = _flat(parser.format_help())
    args = parser.parse_args(["--use_lora"])
    assert eu.learning_rate(args, eu.MODE_TINY) == eu.TINY_LORA_LEARNING_RATE
    assert eu.learning_rate(args, eu.MODE_PRETRAINING) == eu.LORA_LEARNING_RATE
    assert f"({eu.MODE_TINY}: {eu.TINY_LORA_LEARNING_RATE})" in help_text
    assert f"--use_lora {eu.LORA_LEARNING_RATE}" in help_text
