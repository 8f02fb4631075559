"""LoRA on a native pipeline stage trains exactly like single-process LoRA (2 gloo ranks, 2 stages).

A stage is a part of the model without its config: peft's default targets come from the user's
model's config (`ModelContext.model_config`). Reference: the same model with the same adapters
(`add_lora_adapters`, same seed) trained in one process on the same global batches. fp32, losses
rel 1e-5 (micro-batch gradient sums change the summation order only).

One spawn runs every case: untied and tied Llama (the tied embedding/head pair split over the two
stages), targets held by one stage only (each stage adapts those it holds), a stage holding no target
(refused), and a failure on one rank inside an optimization's apply and wrapper (every rank raises the
same error naming that step).
"""

from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, LR = 4, 4, 1e-2
PIPELINE_LORA = [("parallel_mode", ([("pipeline", 2)], None)), "pipeline_parallel"]
EDGE_TARGETS = ("q_proj", "lm_head", "embed_tokens")   # lm_head on the last stage, embed_tokens on the first
PEFT_PREFIX = "base_model.model."


def _model(tied: bool) -> torch.nn.Module:
    return tiny_llama(seed=0, tie_word_embeddings=tied)


def _accelerate(tied: bool, targets: Optional[Tuple[str, ...]] = None) -> Any:
    from atorch.auto import auto_accelerate

    lora: Any = "lora" if targets is None else ("lora", {"target_modules": list(targets)})
    return auto_accelerate(
        _model(tied), torch.optim.AdamW, TokenDataset(n=16, seq_len=16), optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
        load_strategy=[*PIPELINE_LORA, lora])


def _train(tied: bool, targets: Optional[Tuple[str, ...]] = None) -> Dict[str, Any]:
    """Losses, the adapters this stage trained, and this stage's side of the tied embedding/head weight."""
    from atorch.auto import train_step

    status, result, _ = _accelerate(tied, targets)
    assert status
    losses = [float(train_step(result, batch)) for _, batch in zip(range(STEPS), result.dataloader)]
    stage = result.pipeline_stage
    trained = {name[len(PEFT_PREFIX):]: p.detach().clone() for name, p in result.model.named_parameters()
               if p.requires_grad}
    tied_path = "model.embed_tokens" if stage == 0 else "lm_head"
    base = result.model.get_base_model() if hasattr(result.model, "get_base_model") else result.model
    return {"losses": losses, "targets": result.summaries["lora"]["target_modules"], "trained": trained,
            "tied_weight": base.get_submodule(tied_path).weight.detach().clone(), "stage": stage}


def _error(call: Any) -> Tuple[str, str]:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        return type(e).__name__, str(e)
    return "none", ""


def _failing_on(rank: int, cls: type, method: str, call: Any) -> Tuple[str, str]:
    """Run `call` with `cls.method` raising a ValueError on `rank` only, after the original ran (its collectives
    done): the other rank goes on to the next step of auto_accelerate."""
    import torch.distributed as dist

    original = getattr(cls, method)

    def fails(self: Any, *args: Any) -> None:
        original(self, *args)
        raise ValueError(f"{method} failed (simulated on rank {rank})")

    if dist.get_rank() == rank:
        setattr(cls, method, fails)
    try:
        return _error(call)
    finally:
        setattr(cls, method, original)


def _runs() -> Dict[str, Any]:
    from atorch.auto.opt_lib.lora import LoraOptimization
    from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelOptimization

    return {
        "untied": _train(tied=False),
        "tied": _train(tied=True),
        "edge_targets": _train(tied=True, targets=EDGE_TARGETS),
        "lm_head_only": _error(lambda: _accelerate(tied=True, targets=("lm_head",))),
        "wrapper_fails_on_rank_0": _failing_on(0, PipelineParallelOptimization, "apply_wrapper",
                                               lambda: _accelerate(tied=True)),
        "apply_fails_on_rank_1": _failing_on(1, LoraOptimization, "apply", lambda: _accelerate(tied=False)),
    }


@pytest.fixture(scope="module")
def runs() -> list:
    return run_distributed(_runs, 2, timeout=300)


def _reference(tied: bool, targets: Optional[Tuple[str, ...]] = None
               ) -> Tuple[list, Dict[str, torch.Tensor], torch.Tensor]:
    """Single-process LoRA: losses, the trained model's parameters (without peft's prefix) and its embedding."""
    from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters

    model: Any = add_lora_adapters(_model(tied), LoraConfig(target_modules=targets))
    losses = reference_losses(model, global_batches(TokenDataset(n=16, seq_len=16), GLOBAL_BATCH, STEPS), lr=LR)
    params = {name[len(PEFT_PREFIX):]: p.detach() for name, p in model.named_parameters()}
    return losses, params, model.get_base_model().get_submodule("model.embed_tokens").weight.detach()


@pytest.mark.parametrize("case, tied, targets", [("untied", False, None), ("tied", True, None),
                                                 ("edge_targets", True, EDGE_TARGETS)])
def test_lora_on_pipeline_stages_matches_single_process_lora(runs, case, tied, targets):
    expected, params, embedding = _reference(tied, targets)
    assert expected[-1] < expected[0]      # the adapters learn: the comparison is not of a constant
    for rank, run in enumerate(r[case] for r in runs):
        assert run["stage"] == rank
        assert run["targets"] == sorted(targets or ("q_proj", "v_proj"))    # every stage's peft config names all
        assert_close_losses(run["losses"], expected, rel=1e-5, what=f"pipeline + lora {case} (rank {rank})")
        # each stage trained exactly its own layers' adapters, to the reference's values (fp32 sums in another order)
        assert run["trained"], f"{case}: stage {rank} trains nothing"
        for name, value in run["trained"].items():
            assert "lora_" in name, name
            torch.testing.assert_close(value, params[name], rtol=1e-4, atol=1e-6, msg=f"{case} stage {rank} {name}")
    if targets is not None:     # each adapter of a one-stage target sits on the stage that holds the layer
        stage_of = {0: "model.embed_tokens.lora_embedding", 1: "lm_head.lora_"}
        for rank, prefix in stage_of.items():
            assert any(n.startswith(prefix) for n in runs[rank][case]["trained"]), (rank, prefix)
            assert not any(n.startswith(prefix) for n in runs[1 - rank][case]["trained"]), (rank, prefix)
        reference_adapters = {n for n in params if "lora_" in n}
        assert set(runs[0][case]["trained"]) | set(runs[1][case]["trained"]) == reference_adapters
    if tied:    # the frozen tied weight: one value on both stages, the reference's
        first, last = runs[0][case]["tied_weight"], runs[1][case]["tied_weight"]
        assert torch.equal(first, last)
        assert torch.equal(first, embedding)


def test_a_stage_holding_no_lora_target_is_refused_on_every_rank(runs):
    kinds = [r["lm_head_only"] for r in runs]
    assert kinds[0] == kinds[1], kinds
    kind, message = kinds[0]
    assert kind == "ValueError", message
    assert "pipeline_parallel: stage 0 of 2 (" in message and "holds none of lora's target_modules ['lm_head']" \
           in message, message


@pytest.mark.parametrize("case, step, rank", [
    ("wrapper_fails_on_rank_0", "wrapping the model with pipeline_parallel (after optim_func)", 0),
    ("apply_fails_on_rank_1", "applying lora", 1)])
def test_a_step_failing_on_one_rank_raises_the_same_error_everywhere(runs, case, step, rank):
    errors = [r[case] for r in runs]
    assert errors[0] == errors[1], f"{case}: the ranks raised different errors: {errors}"
    kind, message = errors[0]
    assert kind == "ValueError", message
    assert f"auto_accelerate: {step} failed on rank [{rank}]: " in message, message
    assert f"(simulated on rank {rank})" in message, message
