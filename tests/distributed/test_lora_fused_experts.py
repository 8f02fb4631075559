"""LoRA on a mixture-of-experts model whose experts transformers 5 fuses (Qwen3-MoE), on a 2-stage pipeline.

peft rewrites the expert projection names (`gate_proj`, `up_proj`, `down_proj`) into `target_parameters` on
the fused expert weights when it wraps a whole transformers model, but not a pipeline stage (no config of its
own): the stages adapted the dense MLP of the mixed model instead (layer 1 here) and saved a checkpoint that
`merge_checkpoint` refused ("missing ...experts.base_layer.lora_A, unexpected ...layers.1.mlp.gate_proj").
atorch now applies peft's rewrite on every layout (`lora.convert_like_peft`). Checked: the stages adapt what
one process adapts, train like it (fp32, losses rel 1e-5, as test_pipeline_lora.py), and the checkpoint merges
(adapters folded into a model `from_pretrained` loads; the adapters alone as peft writes them).
"""

import os
from typing import Any, Dict, List

import pytest
import torch

from atorch.testing import run_distributed
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, LR, REL = 3, 4, 1e-2, 1e-5
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
STRATEGY = [("parallel_mode", ([("pipeline", 2)], None)), "pipeline_parallel", ("lora", {"target_modules": TARGETS})]


def _model() -> torch.nn.Module:
    from atorch.testing.tp_families import build_family

    return build_family("qwen3_moe")[0]      # layer 0 a mixture of experts, layer 1 a dense MLP


def _dataset() -> TokenDataset:
    return TokenDataset(n=STEPS * GLOBAL_BATCH, vocab_size=20)


def _adapted(model: torch.nn.Module) -> List[str]:
    """The module paths holding trainable parameters, without peft's and the wrappers' prefixes."""
    return sorted({n.split(".lora_")[0].replace("base_model.model.", "") for n, p in model.named_parameters()
                   if p.requires_grad})


def _job(root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from atorch.auto import auto_accelerate, train_step
    from atorch.checkpoint import merge_checkpoint, save_checkpoint

    status, result, _ = auto_accelerate(_model(), torch.optim.AdamW, _dataset(), optim_args={"lr": LR},
                                        dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=STRATEGY)
    assert status
    losses = [float(train_step(result, batch)) for _, batch in zip(range(STEPS), result.dataloader)]
    out = {"losses": losses, "adapted": _adapted(result.model), "summary": result.summaries["lora"]}
    path = save_checkpoint(result, os.path.join(root, "ckpt"))
    if dist.get_rank() == 0:
        merge_checkpoint(path, os.path.join(root, "merged"))
        merge_checkpoint(path, os.path.join(root, "adapters"), lora="adapters")
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_lora"))
    return root, run_distributed(_job, 2, root, timeout=300)


def _reference() -> Any:
    from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters

    return add_lora_adapters(_model(), LoraConfig(target_modules=tuple(TARGETS)))


def test_the_stages_adapt_the_fused_experts_and_train_like_one_process(runs):
    reference = _reference()
    expected = reference_losses(reference, global_batches(_dataset(), GLOBAL_BATCH, STEPS), lr=LR)
    one_process = _adapted(reference)
    assert "model.layers.0.mlp.experts" in one_process
    assert not any(".layers.1.mlp." in name for name in one_process), one_process
    _, outs = runs
    assert sorted(set(outs[0]["adapted"]) | set(outs[1]["adapted"])) == one_process
    for out in outs:
        assert out["summary"]["target_parameters"] == ["down_proj", "gate_up_proj"]
    # The last stage reports the loss.
    assert_close_losses(outs[1]["losses"], expected, rel=REL)


def test_the_pipeline_checkpoint_merges(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = runs
    merged, info = AutoModelForCausalLM.from_pretrained(os.path.join(root, "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    base = _model()
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(merged.get_parameter(experts), base.get_parameter(experts)), "the experts' adapters"
    with_adapters = PeftModel.from_pretrained(_model(), os.path.join(root, "adapters")).merge_and_unload()
    for name, p in merged.named_parameters():
        torch.testing.assert_close(p, with_adapters.get_parameter(name), rtol=1e-5, atol=1e-6)
