"""LoRA on tensor-parallel linears (TP=2, 2 gloo ranks) against peft's LoRA in one process.

`parallel_mode(tensor 2) + tensor_parallel + lora` on a tiny Llama, adapters on q_proj, v_proj
(column-parallel) and o_proj, down_proj (row-parallel). Each rank builds the single-process
reference itself: the same base model under peft through atorch's own single-process LoRA
(`add_lora_adapters`, what `auto_accelerate(load_strategy=["lora"])` applies in one process),
nothing copied from the TP model, trained on the same batches. Checked:
- the TP model's initial adapters, gathered, equal the single-process ones exactly (both are
  seeded by the layer's path, `atorch.utils.lora_init`);
- only the adapters require gradients, and the gathered base weights do not change;
- 3 AdamW steps: losses within rel 1e-4 of the peft run (summation order only; B starts at
  zero, so the first step is the base model's loss, the next ones test the adapter gradients);
- the trained adapters, gathered, equal peft's within rel 1e-4.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from atorch.testing import run_distributed, tiny_llama
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches

STEPS, BATCH, LR, REL = 3, 4, 1e-2, 1e-4
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
R, ALPHA = 4, 8


def _adapters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    adapters = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and isinstance(module.lora_A, torch.nn.ModuleDict):
            key = name.replace("base_model.model.", "")
            adapters[f"{key}.lora_A"] = module.lora_A["default"].weight.detach().clone()
            adapters[f"{key}.lora_B"] = module.lora_B["default"].weight.detach().clone()
    return adapters


def _single_process_reference() -> Dict[str, Any]:
    from atorch.auto.opt_lib.lora import LoraConfig, add_lora_adapters

    model = add_lora_adapters(tiny_llama(seed=0), LoraConfig(r=R, alpha=ALPHA, target_modules=TARGETS))
    initial = _adapters(model)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in global_batches(TokenDataset(), BATCH, STEPS):
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "initial": initial, "adapters": _adapters(model)}


def _run() -> Dict[str, Any]:
    from atorch.auto import auto_accelerate, train_step
    from atorch.tensor_parallel import gather_tp_state_dict

    strategy = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel",
                ("lora", {"r": R, "alpha": ALPHA, "target_modules": list(TARGETS)})]
    status, result, _ = auto_accelerate(tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": LR},
                                        model_input_format="unpack_dict", load_strategy=strategy)
    assert status
    trainable = sorted(n for n, p in result.model.named_parameters() if p.requires_grad)
    before = gather_tp_state_dict(result.model)
    losses = [train_step(result, batch).item() for batch in global_batches(TokenDataset(), BATCH, STEPS)]
    after = gather_tp_state_dict(result.model)
    reference = _single_process_reference()
    same_start = sorted(reference["initial"]) == sorted(k for k in before if "lora_" in k) and all(
        torch.equal(before[k], v) for k, v in reference["initial"].items())
    base_unchanged = all(torch.equal(before[k], after[k]) for k in before if "lora_" not in k)
    adapter_err = max(((after[k] - v).norm() / v.norm().clamp_min(1e-12)).item()
                      for k, v in reference["adapters"].items())
    return {"trainable": trainable, "losses": losses, "reference_losses": reference["losses"],
            "base_unchanged": base_unchanged, "adapter_err": adapter_err, "same_start": same_start,
            "adapters": sorted(reference["adapters"]) == sorted(k for k in after if "lora_" in k)}


def test_lora_on_sharded_linears_trains_like_single_process_lora():
    for rank, r in enumerate(run_distributed(_run, 2, timeout=400)):
        assert r["trainable"] and all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"]), r["trainable"]
        assert len(r["trainable"]) == 2 * len(TARGETS) * 2, r["trainable"]  # 2 layers
        assert r["adapters"] and r["base_unchanged"], (rank, r)
        assert r["same_start"], f"rank {rank}: the TP adapters do not start from single-process LoRA's"
        assert_close_losses(r["losses"], r["reference_losses"], rel=REL, what=f"lora+tp rank {rank}")
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["adapter_err"] <= REL, (rank, r["adapter_err"])
