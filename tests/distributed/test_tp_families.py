"""Tensor parallelism (TP=2, 2 gloo ranks) on every architecture family, against the unsharded model.

Families (atorch/testing/tp_families.py): llama, mistral, qwen2, qwen3, gemma, gemma2, phi3
and gpt_neox and the mixtures of experts mixtral and qwen3_moe (all from the plan transformers
ships), gpt2, opt, falcon and bloom (hand presets). Each rank also builds and trains the
unsharded model itself, so both sides see identical inputs. Checked per family:

- the returned logits (eval, fp32) are full-vocabulary plain tensors equal to the unsharded
  model's: relative L2 error <= 1e-5 (only the summation order of the row-parallel
  all-reduce differs; 0.9e-7 to 4.1e-7 measured across the families);
- 3 AdamW steps (lr 1e-3, dropout off): every rank's loss within rel 1e-4 of plain training
  (AdamW's normalization amplifies summation-order differences over the steps);
- parameters per rank of the transformer blocks <= 1.1 x unsharded / 2 (replicated norms,
  biases of row-parallel layers and routers are the excess);
- the gathered state dict has the unsharded model's keys and shapes, and its trained weights are
  plain training's within LR / 5 (a replicated weight whose gradient is not summed drifts by ~LR
  a step; Phi with `qk_layernorm`, whose per-head norms transformers' plan leaves out, is checked
  the same way).

With `gather_logits=False` (llama, and gemma whose vocabulary of 1001 is padded to 1002), the
model returns this rank's vocabulary slice and `vocab_parallel_cross_entropy` over the slices
equals the unsharded loss (rel 1e-5); its `generate` still gives the unsharded model's tokens.

More model types with a transformers plan (`MORE_PLAN_FAMILIES`: gemma3_text, olmo2, cohere,
starcoder2, phi, granite, qwen2_moe, olmoe, glm4, smollm3, gptj, ernie4_5, exaone4, helium, seed_oss,
nemotron, phimoe): the logits only, same bound, and the blocks hold less than unsharded.

Generation (llama, gpt2, mixtral): greedy, beam search (2 beams) and sampling with a seed,
all with the KV cache, give the unsharded model's tokens on every rank.

One spawn for everything: a spawn costs 5-20 s here.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from atorch.testing import run_distributed
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches
from atorch.testing.tp_families import FAMILIES, MORE_PLAN_FAMILIES, build_family, more_family_config

LOGITS_REL, LOSS_REL, BLOCK_BYTES_SLACK = 1e-5, 1e-4, 1.1
STEPS, BATCH, LR, TP = 3, 4, 1e-3, 2
# Trained weights vs plain training's, absolute: a weight whose gradient is not summed over the group drifts
# by about LR a step (3e-3 to 5e-3 after 3 steps); summation order alone moves most by ~1e-7, and weights whose
# true gradient is zero (a key norm's bias, which the softmax cancels) by Adam-normalized float noise: 6e-5.
PARAM_ABS = LR / 5
GENERATE_FAMILIES = ("llama", "gpt2", "mixtral")
SLICE_FAMILIES = ("llama", "gemma")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def _block_bytes(model: torch.nn.Module) -> int:
    from atorch.tensor_parallel import tp_param_bytes
    from atorch.utils.module_utils import find_transformer_block_classes, modules_of_classes

    blocks = modules_of_classes(model, find_transformer_block_classes(model))
    assert blocks, type(model).__name__
    return sum(tp_param_bytes(b) for b in blocks)


def _train(model: torch.nn.Module, vocab: int) -> List[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(TokenDataset(vocab_size=min(vocab, 1000)), BATCH, STEPS):
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _randomizer(group: Any) -> Any:
    import torch.distributed as dist

    from atorch.tensor_parallel import MultiDimParallelRandomizer

    return MultiDimParallelRandomizer(0, {"tensor": dist.get_rank(group)})


def _family(name: str, group: Any) -> Dict[str, Any]:
    from atorch.tensor_parallel import ColumnParallelLinear, gather_tp_state_dict, shard_model, tpinfo_for_model

    reference, config = build_family(name)
    model, _ = build_family(name)
    model = shard_model(model, tpinfo_for_model(model), group, randomizer=_randomizer(group))
    out: Dict[str, Any] = {"head_split": isinstance(model.get_output_embeddings(), ColumnParallelLinear)}
    ids = TokenDataset(n=2, seq_len=12, seed=5, vocab_size=min(config.vocab_size, 1000)).tokens
    for m in (model, reference):
        m.eval()
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    out["logits_type"] = type(logits).__name__
    # A view (the padding sliced off the gathered logits) returned by an FSDP2 root would lose
    # FSDP's pre-backward hook to an in-place op on it: the logits are a tensor of their own.
    out["logits_view"] = logits._base is not None
    out["logits_shape"], out["expected_shape"] = tuple(logits.shape), tuple(expected.shape)
    out["logits_err"] = _rel_err(logits, expected)
    out["block_bytes"], out["full_block_bytes"] = _block_bytes(model), _block_bytes(reference)
    for m in (model, reference):
        m.train()
    out["losses"], out["reference_losses"] = _train(model, config.vocab_size), _train(reference, config.vocab_size)
    merged, plain = gather_tp_state_dict(model), reference.state_dict()
    out["state_keys_match"] = list(merged) == list(plain)
    out["state_shapes_match"] = all(tuple(merged[k].shape) == tuple(v.shape) for k, v in plain.items() if k in merged)
    out["param_err"] = _max_param_err(merged, plain)
    return out


def _max_param_err(merged: Dict[str, torch.Tensor], plain: Dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of any trained weight from plain training's (a weight whose gradient
    missed its sum over the group drifts by about LR a step; summation order alone moves it ~1e-7)."""
    return max((merged[k].float() - v.float()).abs().max().item() for k, v in plain.items()
               if k in merged and v.is_floating_point())


def _per_head_norms(group: Any) -> Dict[str, Any]:
    """Phi with `qk_layernorm`: its per-head norms are not in transformers' plan; trained, every weight
    (the norms' included) must follow plain training (they drifted apart per rank, losses within 4e-5)."""
    from transformers import AutoModelForCausalLM

    from atorch.tensor_parallel import gather_tp_state_dict, shard_model, tpinfo_for_model

    config = more_family_config("phi")
    config.qk_layernorm = True
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model = shard_model(model, tpinfo_for_model(model), group, randomizer=_randomizer(group))
    losses, reference_losses = _train(model, config.vocab_size), _train(reference, config.vocab_size)
    return {"losses": losses, "reference_losses": reference_losses,
            "param_err": _max_param_err(gather_tp_state_dict(model), reference.state_dict())}


def _generate(name: str, group: Any) -> Dict[str, Any]:
    from atorch.tensor_parallel import shard_model, tpinfo_for_model

    reference, config = build_family(name)
    model = shard_model(build_family(name)[0], tpinfo_for_model(reference), group, randomizer=_randomizer(group))
    prompt = TokenDataset(n=2, seq_len=6, seed=9, vocab_size=min(config.vocab_size, 1000)).tokens
    modes = {"greedy": dict(do_sample=False), "beam": dict(do_sample=False, num_beams=2),
             "sample": dict(do_sample=True, top_k=20, temperature=0.9)}
    out = {}
    for mode, kwargs in modes.items():
        tokens = []
        for m in (model, reference):
            m.eval()
            torch.manual_seed(1234)  # the same seed on every rank and for the reference: sampling must agree
            with torch.no_grad():
                tokens.append(m.generate(prompt, max_new_tokens=8, min_new_tokens=8, use_cache=True,
                                         pad_token_id=0, **kwargs))
        out[mode] = {"tp": tokens[0].tolist(), "plain": tokens[1].tolist()}
    return out


def _slices(name: str, group: Any) -> Dict[str, Any]:
    from atorch.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

    reference, config = build_family(name)
    model = apply_tensor_parallel(build_family(name)[0], group, gather_logits=False).model
    ids = TokenDataset(n=2, seq_len=12, seed=5, vocab_size=min(config.vocab_size, 1000)).tokens
    with torch.no_grad():
        out, expected = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
        loss = vocab_parallel_cross_entropy(out.logits[:, :-1], ids[:, 1:], group=group, vocab_size=config.vocab_size,
                                            reduction="mean")
        # generate() gathers for itself: a slice's argmax was another token on each rank (and rank 0 stopped at
        # an eos that rank 1 never picked, leaving its collectives unmatched).
        tokens = [m.eval().generate(ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
                  for m in (model, reference)]
        after = model(input_ids=ids).logits.shape    # slices again once generate is over
    return {"shape": tuple(out.logits.shape), "loss": loss.item(), "model_loss": out.loss.item(),
            "expected_loss": expected.loss.item(), "vocab": config.vocab_size, "generated": tokens,
            "shape_after_generate": tuple(after)}


def _more(model_type: str, group: Any) -> Dict[str, Any]:
    """Logits of one more family's plan (eval, fp32) against the unsharded model, and the block bytes."""
    from transformers import AutoModelForCausalLM

    from atorch.tensor_parallel import shard_model, tpinfo_for_model

    config = more_family_config(model_type)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model = shard_model(model, tpinfo_for_model(model), group, randomizer=_randomizer(group))
    ids = TokenDataset(n=2, seq_len=12, seed=5, vocab_size=1000).tokens
    for m in (model, reference):
        m.eval()
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    return {"logits_err": _rel_err(logits, expected), "block_bytes": _block_bytes(model),
            "full_block_bytes": _block_bytes(reference)}


def _run() -> Dict[str, Any]:
    from atorch.distributed import create_parallel_group, parallel_group

    create_parallel_group(([("tensor", TP)], None))
    group = parallel_group("tensor")
    return {"families": {name: _family(name, group) for name in FAMILIES},
            "generate": {name: _generate(name, group) for name in GENERATE_FAMILIES},
            "slices": {name: _slices(name, group) for name in SLICE_FAMILIES},
            "more": {name: _more(name, group) for name in MORE_PLAN_FAMILIES},
            "per_head_norms": _per_head_norms(group)}


def test_every_family_matches_the_unsharded_model_and_generates_its_tokens():
    results = run_distributed(_run, TP, timeout=900)
    for rank, result in enumerate(results):
        for name, r in result["families"].items():
            what = f"{name} rank {rank}"
            assert r["head_split"], what
            assert r["logits_type"] == "Tensor" and r["logits_shape"] == r["expected_shape"], (what, r)
            assert not r["logits_view"], (what, r)
            assert r["logits_err"] <= LOGITS_REL, (what, r["logits_err"])
            assert_close_losses(r["losses"], r["reference_losses"], rel=LOSS_REL, what=what)
            assert r["block_bytes"] <= BLOCK_BYTES_SLACK * r["full_block_bytes"] / TP, (
                what, r["block_bytes"], r["full_block_bytes"])
            assert r["state_keys_match"] and r["state_shapes_match"], what
            assert r["param_err"] <= PARAM_ABS, (what, r["param_err"])
        for name, modes in result["generate"].items():
            for mode, tokens in modes.items():
                assert tokens["tp"] == tokens["plain"], (name, mode, rank, tokens)
                assert len(tokens["tp"][0]) == 6 + 8, (name, mode, tokens)
        for name, r in result["slices"].items():
            assert r["shape"] == r["shape_after_generate"] == (2, 12, -(-r["vocab"] // TP)), (name, r)
            assert r["generated"][0] == r["generated"][1], (name, rank, r["generated"])
            for loss in (r["loss"], r["model_loss"]):
                assert abs(loss - r["expected_loss"]) <= LOGITS_REL * r["expected_loss"], (name, rank, r)
        for name, r in result["more"].items():
            # Every block holds less than the unsharded one (PhiMoE's plan splits only its experts).
            assert r["logits_err"] <= LOGITS_REL and r["block_bytes"] < r["full_block_bytes"], (name, rank, r)
        norms = result["per_head_norms"]
        assert_close_losses(norms["losses"], norms["reference_losses"], rel=LOSS_REL, what=f"phi qk_layernorm {rank}")
        assert norms["param_err"] <= PARAM_ABS, (rank, norms["param_err"])
    # The ranks agree with each other too (they each matched the reference, but say it).
    assert results[0]["generate"] == results[1]["generate"]
