"""Tensor parallelism through auto_accelerate matches plain single-process training of the same HF model.

What is compared, and why the tolerances:
- Forward logits (eval, fp32) of the sharded model, gathered over the vocabulary, against the
  unsharded model: relative L2 error <= 1e-5 (only the summation order of the row-parallel
  all-reduce differs).
- Five AdamW steps with dropout ON (every dropout of the model, p = 0.1): per-step loss within
  rel 1e-4 of a single-process reference that replays the same random streams. The reference
  forks, around every dropout the preset marks `replic_drop`, the stream the tensor group
  shares (`MultiDimParallelRandomizer` with this data shard's coordinates), and splits the
  attention heads into the tensor ranks' chunks, applying each chunk's attention dropout
  under that rank's `parallel_drop` stream; with data parallelism it accumulates the
  gradients of the data shards (each under its own streams), which is what DDP averages.
  Masks are then bitwise identical, so only float summation order differs; AdamW's
  normalization amplifies that over 5 steps, hence 1e-4 rather than 1e-5.
- The per-rank parameter bytes of the transformer blocks <= 1.1 x (unsharded / T).
- The gathered state dict has the plain model's keys and shapes, loads strictly into a plain
  `transformers` model, and that model reproduces the trained sharded model's logits.

Two spawns: 4 ranks run TP=4 and TP=2 x DP=2 for Llama and GPT-2 (the meta-device path for
two of the four, a real model for the others); 2 ranks run TP=2 for both, the other preset
families (Llama with grouped-query attention, Mistral, Qwen2, GPT-NeoX: logits before and
after one SGD step), the per-block materialization, and the input errors that must be raised
on every rank before any collective.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from atorch.auto import auto_accelerate, train_step
from atorch.modules.distributed_modules.randomizer import MultiDimParallelRandomizer, fork_module_rng
from atorch.testing import run_distributed, tiny_gpt2_config, tiny_llama_config
from atorch.testing.parity import TokenDataset, assert_close_losses, global_batches

STEPS, GLOBAL_BATCH, LR = 5, 8, 1e-3
# One seed for the weights (`torch.manual_seed(BASE_SEED); Model(config)`, which a meta model's
# materialization reproduces) and the dropout streams.
BASE_SEED = 1234
DROPOUT = 0.1
LOGITS_REL, LOSS_REL = 1e-5, 1e-4

# ---------------------------------------------------------------------------------------------
# models


def _config(kind: str, **overrides: Any):
    if kind == "llama":
        # Llama's only dropout is on the attention probabilities (a parallel_drop).
        return tiny_llama_config(attention_dropout=DROPOUT, **overrides)
    return tiny_gpt2_config(resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, **overrides)


def _model_class(kind: str):
    return LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel


def _build(kind: str, meta: bool) -> torch.nn.Module:
    """The model every run starts from: `torch.manual_seed(BASE_SEED); Model(config)`, or its meta recording."""
    if meta:
        from atorch.utils.meta_model_utils import record_module_init

        with record_module_init():
            return _model_class(kind)(_config(kind))
    torch.manual_seed(BASE_SEED)
    return _model_class(kind)(_config(kind))


def _blocks(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def _portable(value: Any) -> Any:
    """Tensors as numpy arrays: a tensor put on the result queue is shared by file descriptor, which
    breaks when the rank exits before the parent reads it."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return value


def _torch(value: Any) -> Any:
    if hasattr(value, "__array__") and not isinstance(value, (list, dict, float, int)):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_torch(v) for v in value]
    return value


def _probe() -> torch.Tensor:
    return global_batches(TokenDataset(), GLOBAL_BATCH, 1)[0]["input_ids"]


# ---------------------------------------------------------------------------------------------
# what each rank runs


def _eval_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    from atorch.utils.manual_tp_utils import gather_tp_logits

    model.eval()
    with torch.no_grad():
        logits = gather_tp_logits(model, model(input_ids=input_ids).logits)
    model.train()
    return logits


def _train_one(kind: str, dims: List[Tuple[str, int]], meta: bool, **tp_config: Any) -> Dict[str, Any]:
    from atorch.tensor_parallel.layers import ColumnParallelLinear
    from atorch.utils.manual_tp_utils import gather_tp_state_dict, tp_param_bytes

    strategy = [("parallel_mode", (dims, None)), ("tensor_parallel", {"base_seed": BASE_SEED, **tp_config})]
    status, result, chosen = auto_accelerate(
        _build(kind, meta), optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy)
    assert status, f"auto_accelerate failed for {kind} {dims}"
    inner = result.model.module if hasattr(result.model, "module") else result.model
    assert isinstance(inner.lm_head, ColumnParallelLinear), type(inner.lm_head)
    out: Dict[str, Any] = {"logits0": _eval_logits(inner, _probe()), "block_bytes": tp_param_bytes(_blocks(inner)),
                           "strategy": chosen.names(), "summary": result.summaries.get("tensor_parallel")}
    losses = []
    for _, batch in zip(range(STEPS), result.dataloader):
        loss = train_step(result, batch)
        # Tensor ranks hold the same loss; the mean over all ranks is the mean over data shards.
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    out["losses"] = losses
    out["logits1"] = _eval_logits(inner, _probe())
    merged = gather_tp_state_dict(result.model)
    if dist.get_rank() != 0:  # rank 0 reports the large tensors; the others only what they all must agree on
        out = {"losses": losses, "block_bytes": out["block_bytes"], "strategy": out["strategy"], "summary": out["summary"]}
    else:
        out["merged"] = merged
    del result, inner, merged
    dist.barrier()
    return out


CONFIGS_4 = [  # (model, dims, build on meta)
    ("llama", [("tensor", 4)], True),
    ("llama", [("tensor", 2), ("data", 2)], False),
    ("gpt2", [("tensor", 4)], False),
    ("gpt2", [("tensor", 2), ("data", 2)], True),
]
CONFIGS_2 = [("llama", [("tensor", 2)], False), ("gpt2", [("tensor", 2)], True)]


def _run_4_ranks() -> List[Dict[str, Any]]:
    return _portable([_train_one(kind, dims, meta) for kind, dims, meta in CONFIGS_4])


def _expect_value_error(strategy: list, model: torch.nn.Module) -> str:
    try:
        auto_accelerate(model, optim_func=torch.optim.AdamW, load_strategy=strategy)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"no ValueError for {strategy}")


def _run_2_ranks() -> Dict[str, Any]:
    from atorch.utils.manual_tp_utils import TPInfo, gather_tp_state_dict, materialize_tp_module, \
        tp_manual_shard_custom_fn
    from atorch.utils.meta_model_utils import record_module_init
    from atorch.utils.tp_presets import tpinfo_for_model

    out: Dict[str, Any] = {"configs": [_train_one(kind, dims, meta) for kind, dims, meta in CONFIGS_2]}
    out["families"] = _run_families()
    out["whole_dropout_diffs"] = _whole_module_dropout_diffs()

    # Bad input: the same ValueError on every rank, raised before any collective (the barrier
    # below would hang if one rank had gone on into a collective).
    errors = {}
    pm = ("parallel_mode", ([("tensor", 2)], None))
    errors["heads"] = _expect_value_error([pm, "tensor_parallel"], _build_heads(3))
    errors["suffix"] = _expect_value_error(
        [pm, ("tensor_parallel", {"tpinfo": TPInfo().shard_col("mlp.no_such_proj")})], _build("llama", False))
    errors["type"] = _expect_value_error(
        [pm, ("tensor_parallel", {"tpinfo": TPInfo().shard_col("embed_tokens")})], _build("llama", False))
    errors["tensor_dim"] = _expect_value_error(["parallel_mode", "tensor_parallel"], _build("llama", False))
    dist.barrier()
    out["errors"] = errors
    # A real model that differs across the tensor group cannot be sliced consistently: every rank
    # detects it (one checksum each) and raises the same ValueError (a mistake in the user's
    # model, not a failure of the strategy: issue 14).
    torch.manual_seed(dist.get_rank())
    try:
        auto_accelerate(LlamaForCausalLM(_config("llama")), optim_func=torch.optim.AdamW,
                        load_strategy=[pm, "tensor_parallel"])
        out["mismatch_error"] = None
    except ValueError as e:
        out["mismatch_error"] = str(e)

    # Per-block materialization: one block at full size at a time; the gathered weights must be
    # those of the unsharded per-block build (checked by the caller), i.e. independent of T.
    from atorch.distributed import create_parallel_group

    create_parallel_group(([("tensor", 2)], None))
    with record_module_init():
        meta = GPT2LMHeadModel(_config("gpt2"))
    tp_manual_shard_custom_fn(meta, tpinfo_for_model(meta))
    per_block = materialize_tp_module(meta, BASE_SEED, per_block=True)
    ids = _probe()
    out["per_block_logits"] = _eval_logits(per_block, ids)
    merged = gather_tp_state_dict(per_block)
    out["per_block_merged"] = merged if dist.get_rank() == 0 else None
    out["per_block_tied"] = per_block.lm_head.weight is per_block.transformer.wte.weight
    # ATorch's documented flow builds the marked meta model with build_recorded_module: it must
    # give this rank's shards (as materialize_tp_module does), never the full unsharded model.
    from atorch.utils.meta_model_utils import build_recorded_module

    replayed = build_recorded_module(meta, seed=BASE_SEED)
    expected = materialize_tp_module(meta, BASE_SEED)
    out["atorch_flow_shapes"] = {k: list(v.shape) for k, v in replayed.state_dict().items()}
    out["atorch_flow_equal"] = all(torch.equal(v, expected.state_dict()[k]) for k, v in replayed.state_dict().items())
    dist.barrier()
    return _portable(out)


def _whole_module_dropout_diffs() -> Dict[str, float]:
    """Max |difference| from rank 0, per gathered weight, after 2 AdamW steps with functional dropout in a
    module the plan leaves whole (Llama's attention dropout; only the MLPs are split), each rank seeding its
    default generator differently after the build and between steps (as scripts seeding seed + rank do).

    The attention's dropout sees the replicated activation, so its mask must be the same on both ranks: drawn
    from each rank's own default generator, the attention weights drifted apart (6e-3 after 3 steps)."""
    from atorch.utils.manual_tp_utils import TPInfo, gather_tp_state_dict

    torch.manual_seed(BASE_SEED)
    model = LlamaForCausalLM(tiny_llama_config(attention_dropout=0.3))
    tpinfo = TPInfo().shard_col("mlp.gate_proj", "mlp.up_proj").shard_row("mlp.down_proj")
    torch.manual_seed(100 + dist.get_rank())
    status, result, _ = auto_accelerate(
        model, optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": LR},
        model_input_format="unpack_dict", dataloader_args={"batch_size": 4},
        load_strategy=[("parallel_mode", ([("tensor", 2)], None)), ("tensor_parallel", {"tpinfo": tpinfo})])
    assert status
    for _, batch in zip(range(2), result.dataloader):
        train_step(result, batch)
        torch.manual_seed(200 + dist.get_rank())
    diffs = {}
    for key, value in gather_tp_state_dict(result.model).items():
        rank0 = value.clone()
        dist.broadcast(rank0, src=0)
        diffs[key] = (value - rank0).abs().max().item()
    del result
    dist.barrier()
    return diffs


FAMILIES = ("llama_gqa", "mistral", "qwen2", "gpt_neox")


def _build_family(kind: str) -> torch.nn.Module:
    """Tiny models of the other preset families; GQA with 2 kv heads for 4 query heads (kv heads get split)."""
    from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    torch.manual_seed(BASE_SEED)
    if kind == "llama_gqa":
        return LlamaForCausalLM(tiny_llama_config(num_key_value_heads=2))
    if kind == "mistral":
        config = MistralConfig(num_key_value_heads=2, **common)
        model_cls = MistralForCausalLM
    elif kind == "qwen2":  # q/k/v carry biases
        config = Qwen2Config(num_key_value_heads=2, **common)
        model_cls = Qwen2ForCausalLM
    else:  # fused query_key_value laid out head by head
        config = GPTNeoXConfig(**common)
        model_cls = GPTNeoXForCausalLM
    config._attn_implementation = "eager"
    return model_cls(config)


def _forward_and_one_step(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Logits before and after one SGD step on the probe batch (the second checks the gradients)."""
    ids = _probe()
    before = _eval_logits(model, ids)
    model.eval()  # no dropout: the step is deterministic
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    after = _eval_logits(model, ids)
    return {"before": before, "after": after}


def _run_families() -> Dict[str, Any]:
    from atorch.distributed import create_parallel_group
    from atorch.utils.manual_tp_utils import tp_manual_shard_custom_fn
    from atorch.utils.tp_presets import tpinfo_for_model

    create_parallel_group(([("tensor", dist.get_world_size())], None))
    out = {}
    for kind in FAMILIES:
        model = _build_family(kind)
        model = tp_manual_shard_custom_fn(model, tpinfo_for_model(model))
        out[kind] = _forward_and_one_step(model)
    dist.barrier()
    return out


def _build_heads(num_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(hidden_size=48, num_attention_heads=num_heads,
                                              num_key_value_heads=num_heads))


# ---------------------------------------------------------------------------------------------
# the single-process reference that replays the ranks' random streams


class _Switch:
    """Randomizer stand-in whose target the reference switches per data shard."""

    def __init__(self) -> None:
        self.target: Optional[MultiDimParallelRandomizer] = None

    def enter(self, group: str, replicated: bool):
        return self.target.enter(group, replicated)

    def exit(self, token) -> None:
        self.target.exit(token)


@contextlib.contextmanager
def _emulated_parallel_attention(kind: str, tp: int, streams: Callable[[], List[MultiDimParallelRandomizer]]
                                 ) -> Iterator[None]:
    """Run the eager attention head chunk by chunk, each chunk's dropout under that tensor rank's stream."""
    module = modeling_llama if kind == "llama" else modeling_gpt2
    original = module.eager_attention_forward

    def chunked(attn, query, key, value, attention_mask, **kwargs):
        outputs, weights = [], []
        for rank, (q, k, v) in enumerate(zip(query.chunk(tp, 1), key.chunk(tp, 1), value.chunk(tp, 1))):
            with streams()[rank].fork("tensor"):
                o, w = original(attn, q, k, v, attention_mask, **kwargs)
            outputs.append(o)
            weights.append(w)
        return torch.cat(outputs, dim=2), torch.cat(weights, dim=1)

    module.eager_attention_forward = chunked
    try:
        yield
    finally:
        module.eager_attention_forward = original


def _reference(kind: str, tp: int, dp: int) -> Dict[str, Any]:
    from atorch.utils.tp_presets import tpinfo_for_model

    model = _build(kind, meta=False)
    switch = _Switch()
    tpinfo = tpinfo_for_model(model)
    for name, module in model.named_modules():
        if any(name == s or name.endswith("." + s) for s in tpinfo.replic):
            fork_module_rng(module, switch, "tensor", replicated=True)
    replicated = [MultiDimParallelRandomizer(BASE_SEED, {"data": d}) for d in range(dp)]
    parallel = [[MultiDimParallelRandomizer(BASE_SEED, {"tensor": t, "data": d}) for t in range(tp)]
                for d in range(dp)]
    shard = {"d": 0}
    out: Dict[str, Any] = {"logits0": _eval_logits(model, _probe())}
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    with _emulated_parallel_attention(kind, tp, lambda: parallel[shard["d"]]):
        for batch in global_batches(TokenDataset(), GLOBAL_BATCH, STEPS):
            total = 0.0
            for d in range(dp):  # DistributedSampler without shuffle gives data rank d samples d, d+dp, ...
                shard["d"] = d
                switch.target = replicated[d]
                part = {k: v[d::dp] for k, v in batch.items()}
                loss = model(**part).loss
                (loss / dp).backward()
                total += loss.item() / dp
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(total)
    out["losses"] = losses
    return out


def _check_config(kind: str, dims: List[Tuple[str, int]], results: List[Dict[str, Any]]) -> None:
    sizes = dict(dims)
    tp, dp = sizes["tensor"], sizes.get("data", 1)
    what = f"{kind} tensor={tp} data={dp}"
    expected = _reference(kind, tp, dp)
    rank0 = results[0]
    # With a data dimension, resolve_strategy adds ddp (nothing else syncs gradients over "data").
    expected_names = ["parallel_mode", "tensor_parallel"] + (["ddp"] if dp > 1 else [])
    assert rank0["strategy"] == expected_names, rank0["strategy"]
    for r in results:  # what tensor parallelism did, in result.summaries like every optimization
        summary = r["summary"]
        assert summary["size"] == tp and summary["logits"] == "gathered", (what, summary)
        layers = _config(kind).num_hidden_layers   # per block: 2 row-parallel linears, 2 (gpt2) or 5 column
        assert summary["modules"]["vocab"] == 1 and summary["modules"]["col"] >= 2 * layers + 1, (what, summary)
        assert summary["modules"]["row"] == 2 * layers, (what, summary)
    assert _rel_err(rank0["logits0"], expected["logits0"]) <= LOGITS_REL, (what, _rel_err(rank0["logits0"],
                                                                                           expected["logits0"]))
    for r in results:
        assert_close_losses(r["losses"], expected["losses"], rel=LOSS_REL, what=what)

    plain = _model_class(kind)(_config(kind))
    unsharded = sum(p.numel() * p.element_size() for p in _blocks(plain).parameters())
    for r in results:
        assert r["block_bytes"] <= 1.1 * unsharded / tp, (what, r["block_bytes"], unsharded, tp)

    merged = rank0["merged"]
    reference_state = plain.state_dict()
    assert list(merged) == list(reference_state), what
    assert {k: tuple(v.shape) for k, v in merged.items()} == {k: tuple(v.shape) for k, v in reference_state.items()}
    plain.load_state_dict(merged, strict=True)
    assert _rel_err(_eval_logits(plain, _probe()), rank0["logits1"]) <= LOGITS_REL, what


@pytest.mark.heavy
def test_tp4_and_tp2_dp2_match_single_process():
    results = _torch(run_distributed(_run_4_ranks, 4, timeout=600))
    for index, (kind, dims, _) in enumerate(CONFIGS_4):
        _check_config(kind, dims, [rank_results[index] for rank_results in results])


def test_tp2_parity_errors_and_per_block_materialization():
    from atorch.utils.meta_model_utils import materialize_module, record_module_init

    results = _torch(run_distributed(_run_2_ranks, 2, timeout=400))
    for index, (kind, dims, _) in enumerate(CONFIGS_2):
        _check_config(kind, dims, [r["configs"][index] for r in results])

    for kind in FAMILIES:
        expected = _forward_and_one_step(_build_family(kind))
        for r in results:
            for when in ("before", "after"):
                err = _rel_err(r["families"][kind][when], expected[when])
                assert err <= LOGITS_REL, (kind, when, err)

    for r in results:
        drifted = {k: d for k, d in r["whole_dropout_diffs"].items() if d != 0}
        assert len(r["whole_dropout_diffs"]) > 10 and not drifted, drifted
        errors = r["errors"]
        assert "num_attention_heads=3" in errors["heads"] and "tensor parallel size 2" in errors["heads"], errors
        assert "'mlp.no_such_proj' matches no module of LlamaForCausalLM" in errors["suffix"], errors
        assert "'model.embed_tokens'" in errors["type"] and "Embedding" in errors["type"], errors
        assert "needs a 'tensor' dimension" in errors["tensor_dim"], errors
        assert r["mismatch_error"] and "tensor_parallel: the model's weights differ across ranks: model." in r["mismatch_error"]
        assert r["per_block_tied"]
        assert r["atorch_flow_equal"]
        shapes = r["atorch_flow_shapes"]   # the fused q|k|v projection split over 2 ranks
        assert shapes["transformer.h.0.attn.c_attn.weight"][1] == 3 * _config("gpt2").n_embd // 2, shapes

    # Per-block weights do not depend on the tensor size: TP=2 gathered == unsharded per-block build.
    with record_module_init():
        meta = GPT2LMHeadModel(_config("gpt2"))
    full = materialize_module(meta, BASE_SEED, per_block=True, block_classes=(modeling_gpt2.GPT2Block,))
    merged = results[0]["per_block_merged"]
    assert list(merged) == list(full.state_dict())
    for key, value in full.state_dict().items():
        assert torch.equal(merged[key], value), key
    assert _rel_err(results[0]["per_block_logits"], _eval_logits(full, _probe())) <= LOGITS_REL
    assert torch.equal(results[0]["per_block_logits"], results[1]["per_block_logits"])
