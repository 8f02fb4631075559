"""`compile`: per-block (default) or whole-model torch.compile with the eager model's losses.

Tolerances: fp32 rel 1e-5 (inductor fuses elementwise ops and may reorder reductions; the
matmuls are the same ATen kernels on CPU), bf16 2e-2 (one rounding of bf16 per fused op differs).
"""

import pytest
import torch

from atorch.auto import auto_accelerate, train_step
from atorch.auto.opt_lib.compile import CompileConfig, is_compiled
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset

pytestmark = pytest.mark.heavy   # inductor compiles C++ on CPU: tens of seconds


def _losses(strategy, steps=3):
    torch.manual_seed(0)
    status, result, _ = auto_accelerate(tiny_llama(seed=1), torch.optim.AdamW, TokenDataset(n=16, seq_len=16),
                                        optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 4},
                                        load_strategy=strategy)
    assert status
    batches = iter(result.dataloader)
    return result, [float(train_step(result, next(batches))) for _ in range(steps)]


def test_compiled_blocks_train_like_eager_and_keep_their_keys():
    _, eager = _losses([])
    result, compiled = _losses(["checkpoint", "compile"])
    assert compiled == pytest.approx(eager, rel=1e-5)
    layers = result.model.model.layers
    assert all(is_compiled(layer) for layer in layers) and not is_compiled(result.model)
    assert result.summaries["compile"] == {"scope": "block", "modules": 2, "classes": ["LlamaDecoderLayer"],
                                          "mode": "default"}
    assert not any("_orig_mod" in k for k in result.model.state_dict())
    # tiny_llama keeps Hugging Face's use_cache=True: with checkpointing, the recompute would append
    # to the cache the forward filled (a shape error), so compile turns the training cache off.
    assert result.model.config.use_cache is False


def test_whole_model_bf16():
    _, eager = _losses([("amp_native", torch.bfloat16)])
    result, compiled = _losses([("amp_native", torch.bfloat16), ("compile", {"scope": "model"})])
    assert compiled == pytest.approx(eager, rel=2e-2)
    assert is_compiled(result.model)


def test_config_errors():
    with pytest.raises(ValueError, match="compile: scope='layer'; valid scopes are"):
        CompileConfig(scope="layer")
    with pytest.raises(ValueError, match="compile: mode='fast'; valid modes are"):
        CompileConfig(mode="fast")
    with pytest.raises(ValueError, match="wrap_cls applies to scope='block' only"):
        CompileConfig(scope="model", wrap_cls=("LlamaDecoderLayer",))
