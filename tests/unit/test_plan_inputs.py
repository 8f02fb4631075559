"""`atorch plan`'s model inputs: sequences longer than the model's positions, and models that are not causal LMs."""

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

import atorch.auto.search.cluster_plan as cluster_plan
from atorch.auto.arguments import check_sequence_length, position_limit
from atorch.auto.search.cluster_plan import check_causal_lm, check_seq_len, load_model_config, plan_cluster
from atorch.cli import main


def _no_planning(*args, **kwargs):
    raise AssertionError("plan_cluster was reached: the input should have been refused before any slow work")


@pytest.mark.parametrize("argv, text", [
    (["--model", "gpt2-xl", "--nproc", "3", "--global-batch", "12", "--seq", "1025"],
     "--seq=1025 is longer than the model's n_positions=1024"),
    (["--model", "llama2-7b", "--nproc", "8", "--device", "h100", "--global-batch", "16", "--seq", "16384"],
     "--seq=16384 is longer than the model's max_position_embeddings=4096"),
])
def test_plan_refuses_a_sequence_longer_than_the_models_positions(argv, text, capsys, monkeypatch):
    monkeypatch.setattr(cluster_plan, "plan_cluster", _no_planning)
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and text in err[-1] and "auto_accelerate refuses" in err[-1]
    # The API says it too, naming its own argument.
    with pytest.raises(ValueError, match="seq_len=1025 is longer than the model's n_positions=1024"):
        plan_cluster(load_model_config("gpt2-xl"), 3, "h100", global_batch=12, seq_len=1025)


def _auto_accelerate_refuses(config, seq_len: int) -> bool:
    try:
        check_sequence_length(SimpleNamespace(config=config), [{"input_ids": [0] * seq_len}])
    except ValueError:
        return True
    return False


def _plan_refuses(config, seq_len: int) -> bool:
    try:
        check_seq_len(config, seq_len)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("config", [
    load_model_config("gpt2-xl"),
    load_model_config("llama2-7b"),
    AutoConfig.for_model("llama", max_position_embeddings=2048, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4),      # ALiBi: no position limit
], ids=["gpt2", "llama", "llama-rope-scaled", "bloom"])
def test_plan_refuses_the_sequences_auto_accelerate_refuses(config):
    # The plan's rule is auto_accelerate's (check_sequence_length): the same limit, none where the config has none.
    limit = position_limit(config)
    for seq_len in (1, 1024, 1025, 2048, 2049, 4096, 4097, 16384):
        assert _plan_refuses(config, seq_len) == _auto_accelerate_refuses(config, seq_len), seq_len
        assert _plan_refuses(config, seq_len) == (limit is not None and seq_len > limit[1]), seq_len
    assert (limit is None) == (config.model_type == "bloom")


@pytest.mark.parametrize("model_type, values, why", [
    ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
     "encoder-only architecture with is_decoder=False"),
    ("roberta", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
     "encoder-only architecture with is_decoder=False"),
    ("t5", dict(d_model=64, num_layers=2, num_heads=4, d_ff=128), "encoder-decoder config"),
    ("bart", dict(d_model=64, encoder_layers=2, decoder_layers=2), "encoder-decoder config"),
    ("vit", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "has no causal-LM class for ViTConfig"),
])
def test_plan_refuses_models_that_are_not_causal_language_models(model_type, values, why, tmp_path, capsys,
                                                                   monkeypatch):
    config = AutoConfig.for_model(model_type, **values)
    with pytest.raises(ValueError, match=f"model_type '{model_type}'.* is not a causal language model") as info:
        check_causal_lm(config)
    assert why in str(info.value)
    with pytest.raises(ValueError, match="is not a causal language model"):
        plan_cluster(config, 2, "h100", global_batch=8, seq_len=128)
    with pytest.raises(ValueError, match="is not a causal language model"):
        cluster_plan.meta_model(config)
    # The command: one line naming --model, exit 2, before anything slow (plan_cluster is never reached).
    (tmp_path / "config.json").write_text(config.to_json_string())
    monkeypatch.setattr(cluster_plan, "plan_cluster", _no_planning)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(tmp_path), "--nproc", "2", "--global-batch", "8", "--seq", "128"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and last.startswith(f"atorch plan: error: --model '{tmp_path}': model_type")
    assert why in last and len(last) < 400


@pytest.mark.parametrize("model_type, values", [
    ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)),
    ("gpt2", dict(n_embd=64, n_layer=2, n_head=4)),
    ("gpt_neox", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)),
    ("bloom", dict(hidden_size=64, n_layer=2, n_head=4)),
    # An encoder architecture configured as a decoder is a causal LM (BertLMHeadModel with a causal mask).
    ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  is_decoder=True)),
])
def test_causal_language_models_are_planned(model_type, values):
    config = AutoConfig.for_model(model_type, **values)
    check_causal_lm(config)
    assert cluster_plan.meta_model(config).config.model_type == model_type
