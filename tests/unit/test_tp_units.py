"""Tensor parallelism without processes: TPInfo, plan resolution and its errors, slicing, layers at
world size one, the vocabulary-parallel loss, the randomizer and the optimization's validation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from atorch.auto.opt_lib import ValidationContext, resolve_strategy
from atorch.auto.opt_lib.tensor_parallel import TensorParallelConfig, TensorParallelOptimization
from atorch.auto.strategy import Strategy
from atorch.modules.distributed_modules.cross_entropy import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from atorch.tensor_parallel.layers import (  # atorch's constructors (the old path has ATorch's)
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    shard_tensor,
    unshard_tensors,
)
from atorch.modules.distributed_modules.randomizer import (
    MultiDimParallelRandomizer,
    fork_module_rng,
    get_randomizer,
    init_randomizer,
)
from atorch.testing import tiny_gpt2, tiny_gpt2_config, tiny_llama, tiny_llama_config
from atorch.utils.manual_tp_utils import (
    COL,
    PARALLEL_DROP,
    REPLIC_DROP,
    ROW,
    VOCAB,
    TPInfo,
    gather_tp_state_dict,
    load_tp_state_dict,
    resolve_tp_plan,
    tp_manual_shard_custom_fn,
)
from atorch.utils.meta_model_utils import record_module_init
from atorch.utils.tp_presets import tpinfo_for_model


def _meta(cls, config):
    with record_module_init():
        return cls(config)


def _neox_config(**overrides):
    kwargs = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64)
    kwargs.update(overrides)
    return GPTNeoXConfig(**kwargs)


# -- TPInfo and plans ------------------------------------------------------------------

def test_tpinfo_builder_normalizes_and_round_trips_through_strategy_json():
    tpinfo = TPInfo()
    tpinfo.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc").shard_row("attn.c_proj", ".mlp.c_proj")
    tpinfo.shard_vocab("wte").replic_drop("resid_dropout", "drop").parallel_drop("attn_dropout")
    tpinfo.shrink({".attn": {"embed_dim", "split_size", "num_heads"}})
    assert tpinfo.col == {"attn.c_attn": {"stride": 3}, "mlp.c_fc": {}}
    assert "mlp.c_proj" in tpinfo.row and tpinfo.shrink_attrs == {"attn": ("embed_dim", "num_heads", "split_size")}
    strategy = Strategy([("parallel_mode", ([("tensor", 2)], None)), ("tensor_parallel", {"tpinfo": tpinfo})])
    again = Strategy.from_json(strategy.to_json())
    assert again.get("tensor_parallel").config["tpinfo"] == tpinfo


@pytest.mark.parametrize("call,match", [
    (lambda t: t.shard_col({"q": {"strde": 3}}), r"unknown option 'strde'; valid options are \['gather_output', "),
    (lambda t: t.shard_col({"q": {"stride": "3"}}), "stride='3' must be int"),
    (lambda t: t.shard_col({"q": {"stride": 0}}), "stride=0 must be >= 1"),
    (lambda t: t.shard_row(""), "must be a non-empty module-name suffix"),
    (lambda t: t.shrink({"attn": "num_heads"}), "must be a collection of attribute names"),
])
def test_tpinfo_rejects_bad_entries(call, match):
    with pytest.raises(ValueError, match=match):
        call(TPInfo())


@pytest.mark.parametrize("cls,config,tp,counts", [
    (LlamaForCausalLM, tiny_llama_config(), 4, {COL: 11, ROW: 4, VOCAB: 1, PARALLEL_DROP: 2}),
    (GPT2LMHeadModel, tiny_gpt2_config(), 2, {COL: 5, ROW: 4, VOCAB: 1, REPLIC_DROP: 5, PARALLEL_DROP: 2}),
    (GPTNeoXForCausalLM, _neox_config(), 4, {COL: 5, ROW: 4, VOCAB: 1, REPLIC_DROP: 5, PARALLEL_DROP: 2}),
], ids=["llama", "gpt2", "gpt_neox"])
def test_presets_match_every_module_they_name(cls, config, tp, counts):
    model = _meta(cls, config)
    plan = resolve_tp_plan(model, tpinfo_for_model(model), tp, world_size=8)
    found = {}
    for action in plan.actions.values():
        found[action.kind] = found.get(action.kind, 0) + 1
    assert found == counts
    head = plan.actions[plan.output_embedding]
    assert head.kind == COL and head.option("pad_vocab") and plan.vocab_parallel_loss
    if cls is GPT2LMHeadModel:
        assert plan.shrink["transformer.h.0.attn"] == {"embed_dim": 32, "split_size": 32, "num_heads": 2}
        assert plan.actions["transformer.h.1.attn.c_attn"].option("stride") == 3
    # Full logits are gathered after a loss computed from the slices; False keeps the slices everywhere.
    gathered = resolve_tp_plan(model, tpinfo_for_model(model), tp, gather_logits=True)
    assert gathered.vocab_parallel_loss and gathered.gather_logits
    assert not gathered.actions[plan.output_embedding].option("gather_output")
    assert not resolve_tp_plan(model, tpinfo_for_model(model), tp, gather_logits=False).gather_logits


def test_no_preset_for_unknown_model_type():
    with pytest.raises(ValueError, match=r"no tensor-parallel preset for model_type=None \(Linear\)"):
        tpinfo_for_model(nn.Linear(2, 2))


@pytest.mark.parametrize("overrides,tp,match", [
    (dict(num_attention_heads=4, num_key_value_heads=4), 8,
     r"tensor parallel size 8 does not divide num_attention_heads=4 of LlamaConfig: sharding "
     r"'model.layers.0.self_attn.q_proj'"),
    (dict(num_attention_heads=4, num_key_value_heads=2), 4,
     r"does not divide num_key_value_heads=2 of LlamaConfig: sharding 'model.layers.0.self_attn.k_proj' would "
     r"split it unevenly; use a tensor size that divides 2 \(2\)"),
    # Multi-query attention: one key/value head, which no tensor size splits.
    (dict(num_attention_heads=4, num_key_value_heads=1), 2,
     r"num_key_value_heads=1 .*'model.layers.0.self_attn.k_proj'.*; num_key_value_heads=1 cannot be split across "
     r"ranks \(atorch does not replicate heads\), so tensor parallelism does not apply to this model; use data "
     r"parallelism, FSDP or pipeline stages instead"),
    (dict(intermediate_size=130), 4, r"does not divide intermediate_size=130 of LlamaConfig: sharding "
                                     r"'model.layers.0.mlp.gate_proj'"),
], ids=["heads", "kv_heads", "one_kv_head", "intermediate"])
def test_indivisible_sizes_name_the_module_and_numbers(overrides, tp, match):
    model = _meta(LlamaForCausalLM, tiny_llama_config(**overrides))
    with pytest.raises(ValueError, match=match):
        resolve_tp_plan(model, tpinfo_for_model(model), tp)


def test_head_counts_are_required_only_where_the_heads_are_split():
    """3 heads on 2 ranks: refused (naming the query projection) only by a plan that splits the heads. One that
    leaves attention whole (DeepSeek-V3's MLA, GraniteMoE's experts-only plan) or gathers the projections'
    outputs (OLMo-3's) runs every head on every rank, logits exact; they were refused naming
    mlp.gate_proj or lm_head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _meta(LlamaForCausalLM, tiny_llama_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"does not divide num_attention_heads=3 of LlamaConfig: sharding "
                                         r"'model.layers.0.self_attn.q_proj' would split it unevenly"):
        resolve_tp_plan(model, tpinfo_for_model(model), 2)
    mlp_only = TPInfo().shard_col("mlp.gate_proj", "mlp.up_proj", "lm_head").shard_row("mlp.down_proj")
    assert resolve_tp_plan(model, mlp_only, 2).actions
    gathered = {"gather_output": True}
    olmo3_like = TPInfo().shard_col({"self_attn.q_proj": gathered, "self_attn.k_proj": gathered,
                                     "self_attn.v_proj": gathered}).shard_row({"self_attn.o_proj":
                                                                               {"input_is_parallel": False}})
    assert resolve_tp_plan(model, olmo3_like, 2).actions
    config = AutoConfig.for_model("granitemoe", vocab_size=128, hidden_size=48, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                                  num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)
    with record_module_init():
        granite = AutoModelForCausalLM.from_config(config)
    assert resolve_tp_plan(granite, tpinfo_for_model(granite), 2).actions


@pytest.mark.parametrize("heads,kv_heads,match", [
    (4, 1, r"num_kv_heads=1 of FalconConfig: sharding 'transformer.h.0.self_attention.query_key_value' .*"
           r"num_kv_heads=1 cannot be split across ranks"),
    (6, 3, r"num_kv_heads=3 of FalconConfig: sharding 'transformer.h.0.self_attention."
           r"query_key_value' would split it unevenly; use a tensor size that divides 3 \(3\)"),
])
def test_falcon_kv_heads_are_checked_from_its_config(heads, kv_heads, match):
    """Falcon calls its kv heads `num_kv_heads`: unread, the refusal came from the preset's shrink of an
    internal attribute ("TPInfo shrink: ...num_kv_heads=1"), which a user did not write."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=128, hidden_size=16 * heads, num_hidden_layers=1, num_attention_heads=heads,
                          num_kv_heads=kv_heads, new_decoder_architecture=True, alibi=False, bias=False)
    model = _meta(FalconForCausalLM, config)
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide " + match):
        resolve_tp_plan(model, tpinfo_for_model(model), 2)


def test_indivisible_hidden_size_of_a_custom_model():
    # HF configs already require hidden % heads == 0, so a custom model shows this check alone.
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"hidden_size": 66, "num_attention_heads": 8})()
            self.up = nn.Linear(66, 128)

    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide hidden_size=66 of Config: sharding "
                                         r"'up'"):
        resolve_tp_plan(Custom(), TPInfo().shard_col("up"), 4)


def test_plan_errors():
    model = _meta(GPT2LMHeadModel, tiny_gpt2_config())
    with pytest.raises(ValueError, match=r"TPInfo col suffix 'mlp.gate_proj' matches no module of GPT2LMHeadModel; "
                                         r"module names end in \["):
        resolve_tp_plan(model, TPInfo().shard_col("mlp.gate_proj"), 2)
    with pytest.raises(ValueError, match=r"TPInfo vocab suffix 'c_fc' matches 'transformer.h.0.mlp.c_fc', a Conv1D; "
                                         r"vocabulary-parallel sharding applies to nn.Embedding only"):
        resolve_tp_plan(model, TPInfo().shard_vocab("c_fc"), 2)
    with pytest.raises(ValueError, match=r"matches 'transformer.h.0.ln_1', a LayerNorm; column/row-parallel"):
        resolve_tp_plan(model, TPInfo().shard_row("ln_1"), 2)
    # The bare 'c_proj' matches modules of two shapes: refused first, naming them (issue 14).
    with pytest.raises(ValueError, match=r"TPInfo col suffix 'c_proj' is ambiguous: it matches modules of different "
                                         r"shapes .*'transformer.h.0.attn.c_proj'.*'transformer.h.0.mlp.c_proj'"):
        resolve_tp_plan(model, TPInfo().shard_col("c_proj").shard_row("mlp.c_proj"), 2)
    # Two roles for one module, with suffixes that are each unambiguous.
    with pytest.raises(ValueError, match=r"'transformer.h.0.mlp.c_proj' is matched by TPInfo col 'mlp.c_proj' and "
                                         r"by row 'h.0.mlp.c_proj'"):
        resolve_tp_plan(model, TPInfo().shard_col("mlp.c_proj").shard_row("h.0.mlp.c_proj"), 2)
    with pytest.raises(ValueError, match=r"tensor parallel size 8 must divide the world size 4"):
        resolve_tp_plan(model, TPInfo(), 8, world_size=4)
    with pytest.raises(ValueError, match=r"column-parallel 'transformer.h.0.attn.c_attn' \(Conv1D\) has 192 output "
                                         r"features, not divisible by tensor size 4 x stride 5 = 20"):
        resolve_tp_plan(model, TPInfo().shard_col({"attn.c_attn": {"stride": 5}}), 4)
    with pytest.raises(ValueError, match=r"shrink: 'transformer.h.0.attn' \(GPT2Attention\) has no integer "
                                         r"attribute 'heads'"):
        resolve_tp_plan(model, TPInfo().shrink({"attn": {"heads"}}), 2)
    with pytest.raises(ValueError, match=r"shrink: transformer.h.0.attn.num_heads=4 is not divisible by tensor "
                                         r"size 3"):
        resolve_tp_plan(model, TPInfo().shrink({"attn": {"num_heads"}}), 3)


def test_tensor_parallel_validation_is_pure():
    model = _meta(LlamaForCausalLM, tiny_llama_config())
    opt = TensorParallelOptimization()

    def validate(world, dims, **config):
        strategy = [("parallel_mode", (dims, None))] if dims else []
        ctx = ValidationContext(world_size=world, model=model, model_config=model.config)
        return resolve_strategy(Strategy(strategy + [("tensor_parallel", config or None)]), ctx)

    names = [r.name for r in validate(4, [("tensor", 2), ("data", 2)])]
    assert names == ["parallel_mode", "tensor_parallel", "ddp"]   # data=2: gradients averaged by DDP
    with pytest.raises(ValueError, match="needs a 'tensor' dimension in parallel_mode"):
        validate(4, None)
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        validate(8, [("tensor", 8)])
    with pytest.raises(ValueError, match="matches no module of LlamaForCausalLM"):
        validate(2, [("tensor", 2)], tpinfo=TPInfo().shard_col("c_attn"))
    with pytest.raises(ValueError, match="needs more than one process"):
        validate(1, [("tensor", 1)])
    with pytest.raises(ValueError, match="tensor parallel size 4 is larger than the world size 2"):
        opt.validate(TensorParallelConfig(), ValidationContext(
            world_size=2, configs={"parallel_mode": type("C", (), {"dims": (("tensor", 4),)})()}))
    with pytest.raises(ValueError, match="base_seed='1' must be an int"):
        opt.validate(TensorParallelConfig(base_seed="1"), ValidationContext(world_size=2))
    assert all(p.is_meta for p in model.parameters()), "validation must not materialize"


# -- slicing and layers (a group of one: no process group needed) ------------------------

@pytest.mark.parametrize("spec", [ShardSpec(0, 12, 2, stride=3), ShardSpec(1, 10, 4, padded_size=12),
                                  ShardSpec(0, 8, 4)])
def test_shard_unshard_round_trip(spec):
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    full = full.narrow(spec.dim, 0, spec.full_size).contiguous()
    shards = [shard_tensor(full, spec, r) for r in range(spec.world)]
    assert all(s.shape[spec.dim] == spec.local_size for s in shards)
    assert torch.equal(unshard_tensors(shards, spec), full)
    if spec.stride == 3:  # each rank holds its chunk of q, of k and of v
        assert shards[1][:, 0].tolist() == [20, 30, 60, 70, 100, 110]


def test_sharded_math_composes_to_the_full_layer():
    # Column slices concatenate to the full output; row slices' partial products sum to it.
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    x = torch.randn(3, 8)
    col = ShardSpec(0, 6, 2)
    cols = [F.linear(x, shard_tensor(lin.weight, col, r), shard_tensor(lin.bias, col, r)) for r in range(2)]
    assert torch.allclose(torch.cat(cols, -1), lin(x), atol=1e-6)
    row = ShardSpec(1, 8, 2)
    parts = [F.linear(x.chunk(2, -1)[r], shard_tensor(lin.weight, row, r)) for r in range(2)]
    assert torch.allclose(sum(parts) + lin.bias, lin(x), atol=1e-6)


def test_layers_at_world_size_one_match_the_modules_they_replace():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    lin, conv = nn.Linear(8, 12), Conv1D(12, 8)
    for full, layer in ((lin, ColumnParallelLinear.from_full(lin, None, stride=3, gather_output=True)),
                        (conv, ColumnParallelLinear.from_full(conv, None, stride=3)),
                        (lin, RowParallelLinear.from_full(lin, None)),
                        (conv, RowParallelLinear.from_full(conv, None))):
        assert torch.allclose(layer(x), full(x), atol=1e-6), type(layer).__name__
        assert layer.weight.shape == full.weight.shape
    emb = nn.Embedding(10, 4, padding_idx=3)
    vocab = VocabParallelEmbedding.from_full(emb, None, padded_num_embeddings=12)
    ids = torch.tensor([[0, 3, 9]])
    assert torch.equal(vocab(ids), emb(ids)) and vocab.weight.shape == (12, 4)
    vocab(ids).sum().backward()
    assert vocab.weight.grad[3].abs().sum() == 0, "padding_idx row gets no gradient"
    with pytest.raises(ValueError, match="does not support nn.Embedding options {'max_norm': 1.0}"):
        VocabParallelEmbedding.from_full(nn.Embedding(4, 2, max_norm=1.0), None)
    with pytest.raises(ValueError, match="size 10 is not divisible by tensor-parallel size 1 x stride 3"):
        ColumnParallelLinear(4, 10, stride=3)
    fresh = ColumnParallelLinear(4, 6, padded_out_features=8)  # constructed: full init, then sliced
    assert fresh.weight.shape == (8, 4) and torch.all(fresh.weight[6:] == 0)
    assert copy.deepcopy(fresh).group is fresh.group  # process groups are shared, not copied


def test_vocab_parallel_cross_entropy_refuses_a_target_no_slice_holds():
    """-1 (padding that is not the ignore index) or an id at or past the real vocabulary: no rank's slice owns it,
    so its target logit was 0 on every rank and the loss logsumexp, finite and wrong (torch's raises)."""
    logits = torch.randn(2, 6, 10)
    for bad in (-1, 7):
        target = torch.randint(0, 7, (2, 6))
        target[1, 3] = bad
        with pytest.raises(ValueError, match=rf"vocab_parallel_cross_entropy: target holds {bad}, outside the "
                                             r"vocabulary of 7 \(ignored positions must be -100\)"):
            vocab_parallel_cross_entropy(logits, target, group=None, vocab_size=7)


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10, requires_grad=True)
    target = torch.randint(0, 7, (2, 6))
    target[0, 0] = -100
    ref_logits = logits.detach().clone()[..., :7].requires_grad_()
    expected = F.cross_entropy(ref_logits.reshape(-1, 7), target.reshape(-1), ignore_index=-100)
    # Columns 7..9 are vocabulary padding (vocab_size=7): they must take no probability mass.
    actual = vocab_parallel_cross_entropy(logits, target, group=None, vocab_size=7, reduction="mean")
    assert torch.allclose(actual, expected, atol=1e-6)
    actual.backward()
    expected.backward()
    assert torch.allclose(logits.grad[..., :7], ref_logits.grad, atol=1e-6)
    assert logits.grad[..., 7:].abs().max() == 0 and logits.grad[0, 0].abs().max() == 0
    none = vocab_parallel_cross_entropy(logits, target, group=None, vocab_size=7)   # ATorch's default: per token
    assert none.shape == (2, 6) and none[0, 0] == 0
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="vocab_size=11 does not fit 1 slices of 10 logits: expected 1 to 10"):
        vocab_parallel_cross_entropy(logits, target, group=None, vocab_size=11)
    loss_fn = VocabParallelCausalLMLoss(None, 7)
    labels = torch.randint(0, 7, (2, 6))
    shifted = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert torch.allclose(loss_fn(logits, labels), shifted, atol=1e-6)
    # The shifted slices F.cross_entropy takes (not contiguous) on one process without padding.
    full = torch.randn(2, 6, 7)
    assert torch.allclose(vocab_parallel_cross_entropy(full[:, :-1], labels[:, 1:], reduction="mean"),
                          F.cross_entropy(full[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1)), atol=1e-6)


def test_real_model_sharding_at_world_one_keeps_outputs_and_state_dict():
    for make in (tiny_llama, tiny_gpt2):
        ref, model = make(seed=0), make(seed=0)
        model = tp_manual_shard_custom_fn(model, tpinfo_for_model(model))
        ids = torch.randint(0, 1024, (2, 8))
        model.eval(), ref.eval()
        out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        assert torch.allclose(out.logits, expected.logits, atol=1e-5) and torch.allclose(out.loss, expected.loss)
        state = gather_tp_state_dict(model)
        assert list(state) == list(ref.state_dict())
        torch.manual_seed(5)
        other = make(seed=5)
        load_tp_state_dict(model, other.state_dict())
        assert torch.allclose(model(input_ids=ids).logits, other.eval()(input_ids=ids).logits, atol=1e-5)


# -- randomizer --------------------------------------------------------------------------

def test_randomizer_streams_follow_the_coordinates():
    def seed(coords, replicated):
        return MultiDimParallelRandomizer(7, coords).seed("tensor", replicated)

    # Replicated: same across tensor ranks, different across data ranks; parallel: different everywhere.
    assert seed({"tensor": 0, "data": 1}, True) == seed({"tensor": 1, "data": 1}, True)
    assert seed({"tensor": 0, "data": 0}, True) != seed({"tensor": 0, "data": 1}, True)
    assert seed({"tensor": 0, "data": 1}, False) != seed({"tensor": 1, "data": 1}, False)
    # Coordinate 0 of a dimension is the same as not having the dimension: one process can replay rank 0.
    assert seed({"tensor": 0, "data": 0}, False) == seed({}, False)
    assert seed({}, False) != seed({}, True) and seed({}, False) != MultiDimParallelRandomizer(8, {}).seed()
    with pytest.raises(ValueError, match="base_seed='x' must be an int"):
        MultiDimParallelRandomizer("x", {})


def test_fork_swaps_the_default_generator_and_continues_the_stream():
    r = MultiDimParallelRandomizer(3, {"tensor": 1})
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with r.fork("tensor"):
        a = torch.rand(4)
        with r.fork("tensor"):  # re-entering the active stream continues it
            b = torch.rand(4)
        with r.fork("tensor", replicated=True):
            c = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside), "the caller's stream is untouched"
    with r.fork("tensor"):
        d = torch.rand(4)
    g = torch.Generator().manual_seed(r.seed("tensor"))
    assert torch.equal(torch.cat([a, b, d]), torch.rand(12, generator=g))
    assert torch.equal(c, torch.rand(4, generator=torch.Generator().manual_seed(r.seed("tensor", True))))
    saved = r.get_states()
    with r.fork("tensor"):
        e = torch.rand(4)
    r.set_states(saved)
    with r.fork("tensor"):
        assert torch.equal(torch.rand(4), e)
    with pytest.raises(RuntimeError, match="exited out of order"):
        t1 = r.enter("tensor")
        r.enter("tensor", True)
        r.exit(t1)


def test_a_stream_active_further_out_is_continued_when_entered_again():
    # The model's forward runs in the replicated stream, the split attention in the per-rank one,
    # and GPT-2's replicated resid_dropout inside that attention: it must continue the replicated
    # stream (not draw from the per-rank one, not restart from the stored state).
    r = MultiDimParallelRandomizer(3, {"tensor": 1})
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with r.fork("tensor", replicated=True):
        a = torch.rand(2)
        with r.fork("tensor"):
            p1 = torch.rand(2)
            with r.fork("tensor", replicated=True):
                b = torch.rand(2)
            p2 = torch.rand(2)
        c = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), outside)
    replicated = torch.Generator().manual_seed(r.seed("tensor", True))
    assert torch.equal(torch.cat([a, b, c]), torch.rand(6, generator=replicated))
    parallel = torch.Generator().manual_seed(r.seed("tensor"))
    assert torch.equal(torch.cat([p1, p2]), torch.rand(4, generator=parallel))


def test_fork_module_rng_hooks_and_default_randomizer():
    drop = nn.Dropout(0.5)
    r = init_randomizer(11, {})
    assert get_randomizer() is r
    fork_module_rng(drop, None, "tensor", replicated=True)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    mask = drop(torch.ones(64)) != 0
    assert torch.equal(torch.get_rng_state(), outside)
    with MultiDimParallelRandomizer(11, {}).fork("tensor", replicated=True):  # a fresh copy of the stream
        expected = nn.Dropout(0.5)(torch.ones(64)) != 0
    assert torch.equal(mask, expected) and not torch.equal(mask, nn.Dropout(0.5)(torch.ones(64)) != 0)
    drop.eval()
    assert torch.equal(drop(torch.ones(3)), torch.ones(3))
    drop.train()
    still = nn.Dropout(0.0)
    fork_module_rng(still, r)
    before = r.get_states()
    still(torch.ones(3))
    assert all(torch.equal(before[k]["cpu"], v["cpu"]) for k, v in r.get_states().items())


def test_randomizer_snapshot_replays_streams_created_after_it():
    r = MultiDimParallelRandomizer(2, {})
    snapshot = r.get_states()  # taken before any stream exists (the first checkpointed forward)
    with r.fork("tensor", replicated=True):
        first = torch.rand(3)
    r.set_states(snapshot)
    with r.fork("tensor", replicated=True):
        assert torch.equal(torch.rand(3), first)


def test_tensor_parallel_dropout_under_activation_checkpointing_gets_the_same_gradients():
    # Recomputation must redraw the forward's dropout masks from the forked streams; the
    # checkpoint optimization snapshots the default randomizer for that.
    from atorch.auto.model_context import ModelContext
    from atorch.auto.opt_lib import get_optimization

    grads = []
    for checkpointed in (False, True):
        model = tiny_gpt2(seed=0, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
        randomizer = init_randomizer(4, {})
        model = tp_manual_shard_custom_fn(model, tpinfo_for_model(model), randomizer=randomizer)
        if checkpointed:
            opt = get_optimization("checkpoint")()
            config = opt.parse_config(None)
            opt.validate(config, ValidationContext(world_size=1, model=model))
            ctx = ModelContext(model=model)
            opt.apply(ctx, config)
            model = ctx.model
        ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, atol=1e-6), name


def test_presets_fit_base_models_without_a_head():
    from transformers import GPT2Model, LlamaModel

    for model in (_meta(LlamaModel, tiny_llama_config()), _meta(GPT2Model, tiny_gpt2_config())):
        plan = resolve_tp_plan(model, tpinfo_for_model(model), 2)
        assert plan.output_embedding is None and not plan.vocab_parallel_loss
        assert sum(a.kind == VOCAB for a in plan.actions.values()) == 1


def test_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary_like_nn_embedding():
    """Split over 2 ranks, an id past the vocabulary (or in its padding) would look up a zero row on
    every rank without a word; the unsharded nn.Embedding raises, and so does the split one."""
    from atorch.testing.fake_distributed import fake_process_group

    with fake_process_group(0, 2):
        vocab = VocabParallelEmbedding(1001, 4, group=torch.distributed.group.WORLD)   # padded to 1002
        assert vocab.tp_size == 2 and vocab(torch.tensor([[0, 1000]])).shape == (1, 2, 4)
        for bad in (1001, 1023, -1):
            with pytest.raises(RuntimeError, match=r"token id is outside the vocabulary \[0, 1001\)"):
                vocab(torch.tensor([[0, bad]]))
