"""Pipeline parallelism on the decoders laid out as Llama, against single-process training (2 gloo ranks).

Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE, Gemma, Gemma-2, Granite (its embedding multiplier
and logits scaling set), Qwen2-MoE and Gemma-3 text (`get_llama_layout_patcher`), each built from its tiny config
(`atorch/testing/tp_families.py`, 4 layers): native
`pipeline_parallel` with 2 stages and 2 micro-batches, and for Qwen2 and Mixtral also DeepSpeed's
pipeline engine (`deepspeed_3d_parallel`, pipeline 2), through `auto_accelerate` + `train_step`, 4
AdamW steps. Every loss within rel 1e-5 of plain training on the same global batches (fp32: only
the micro-batch gradient sums change the summation order; a wrong piece or a missing gradient moves
the loss by 1e-3 or more).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from atorch.testing import run_distributed
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches, reference_losses

STEPS, GLOBAL_BATCH, LAYERS, SEED, LR, REL = 4, 4, 4, 1234, 1e-3, 1e-5
NATIVE = ("mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma", "gemma2", "granite", "qwen2_moe",
          "gemma3_text")
DEEPSPEED = ("qwen2", "mixtral")
# Granite's scalars outside the blocks (the patcher applies them), away from their default of 1.
OVERRIDES = {"granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5)}


def _model(name: str) -> torch.nn.Module:
    import transformers

    from atorch.testing.tp_families import FAMILIES, more_family_config

    config = FAMILIES[name]() if name in FAMILIES else more_family_config(name)
    values = config.to_dict()
    for key in ("layer_types", "mlp_only_layers"):    # per-layer lists: derived again for 4 layers
        values.pop(key, None)
    values["num_hidden_layers"] = LAYERS
    values.update(OVERRIDES.get(name, {}))
    config = type(config).from_dict(values)
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _dataset(model: torch.nn.Module) -> TokenDataset:
    return TokenDataset(vocab_size=min(int(model.config.vocab_size), 1000))


def _train(cases: List[Tuple[str, str]]) -> List[Dict[str, Any]]:
    from atorch import distributed as adist
    from atorch.auto import auto_accelerate, train_step
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig

    out = []
    for name, engine in cases:
        model = _model(name)
        if engine == "native":
            strategy: List[Any] = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"chunks": 2})]
            args: Dict[str, Any] = {"dataloader_args": {"batch_size": GLOBAL_BATCH}}
        else:
            ds = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_accumulation_steps": 2,
                  "steps_per_print": 10 ** 9, "torch_adam": True}
            strategy = [("parallel_mode", ([("pipeline", 2)], None)),
                        ("deepspeed_3d_parallel", DeepSpeed3DParallelConfig(ds_config=ds))]
            args = {}
        status, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                            dataset=_dataset(model), load_strategy=strategy, **args)
        assert status, (name, engine)
        batches = iter(result.dataloader)
        if engine == "native":
            losses = [train_step(result, next(batches)).item() for _ in range(STEPS)]
        else:   # one global batch = 2 micro-batches
            losses = [train_step(result, [next(batches) for _ in range(2)]).item() for _ in range(STEPS)]
        stage = adist.parallel_rank_or_zero("pipeline")
        out.append({"name": name, "engine": engine, "losses": losses, "stage": stage})
        del result, batches, model
        dist.barrier()
    return out


@pytest.mark.heavy
def test_llama_layout_families_train_like_one_process_in_a_pipeline():
    cases = [(name, "native") for name in NATIVE] + [(name, "deepspeed") for name in DEEPSPEED]
    results = run_distributed(_train, 2, cases, timeout=600)
    for i, (name, engine) in enumerate(cases):
        model = _model(name)
        expected = reference_losses(model, global_batches(_dataset(model), GLOBAL_BATCH, STEPS), lr=LR)
        last = next(r[i] for r in results if r[i]["stage"] == 1)      # the last stage computes the loss
        assert_close_losses(last["losses"], expected, rel=REL, what=f"{name} {engine}")
