"""merge_checkpoint -> a directory plain transformers / peft load with no missing or unexpected keys and the
same logits; save_parallelized / from_parallelized. Single process: a world of one is a layout too.

Logits are compared exactly where the loaded model runs the same arithmetic as the saved one (eager
attention on both sides), and to 1e-5 where LoRA is merged (W + B A differs from W x + B (A x) in the
last bits).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from atorch.checkpoint import CheckpointError, attach_checkpoint_methods, merge_checkpoint, save_checkpoint
from atorch.checkpoint.merge import parse_size
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.assets import TOKENIZER_DIR
from atorch.testing.tp_families import FAMILIES, build_family

X = torch.randint(4, 1000, (2, 10), generator=torch.Generator().manual_seed(0))


def _train_one_step(model):
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(X, labels=X).loss.backward()
    optim.step()
    return model


def _load_hf(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(X).logits


@pytest.mark.parametrize("make", [lambda: tiny_llama(seed=0, tie_word_embeddings=True), lambda: tiny_gpt2(seed=0)],
                         ids=["llama_tied", "gpt2"])
def test_merge_tied_models_round_trip_through_from_pretrained(tmp_path, make):
    model = _train_one_step(make()).eval()
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    out = merge_checkpoint(ckpt, str(tmp_path / "hf"))
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors" in files
    keys = set(load_file(os.path.join(out, "model.safetensors")))
    assert "lm_head.weight" not in keys  # tied: saved once, as save_pretrained does
    assert keys == set(model.state_dict()) - {"lm_head.weight"}
    assert torch.equal(_logits(_load_hf(out)), _logits(model))


def test_merge_shards_large_models_with_an_index_and_copies_the_tokenizer(tmp_path):
    model = _train_one_step(tiny_llama(seed=0)).eval()
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="lora='adapters' but the checkpoint .* has no LoRA adapters"):
        merge_checkpoint(ckpt, str(tmp_path / "adapters"), lora="adapters")     # it wrote the whole model
    assert not os.path.exists(tmp_path / "adapters")
    out = merge_checkpoint(ckpt, str(tmp_path / "hf"), max_shard_size="300KB", tokenizer=str(TOKENIZER_DIR))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.isfile(os.path.join(out, s)) for s in shards)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert torch.equal(_logits(_load_hf(out)), _logits(model))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world")["input_ids"] == AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))(
        "hello world")["input_ids"]
    assert not [e for e in os.listdir(tmp_path) if ".tmp-" in e]  # the output was published atomically


def _lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_llama(seed=0), config)


def test_lora_merged_and_adapters_only(tmp_path):
    from peft import PeftModel

    peft_model = _train_one_step(_lora_model()).eval()
    ckpt = save_checkpoint(peft_model, str(tmp_path / "ckpt"))
    assert os.path.isfile(os.path.join(ckpt, "adapter_config.json"))
    expected = _logits(peft_model)

    merged = merge_checkpoint(ckpt, str(tmp_path / "merged"), lora="merge")
    plain = _load_hf(merged)
    assert set(plain.state_dict()) == set(tiny_llama().state_dict())
    assert torch.allclose(_logits(plain), expected, rtol=1e-5, atol=1e-5)

    adapters = merge_checkpoint(ckpt, str(tmp_path / "adapters"), lora="adapters")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapters))
    assert all("lora_" in k for k in load_file(os.path.join(adapters, "adapter_model.safetensors")))
    reloaded = PeftModel.from_pretrained(tiny_llama(seed=0).eval(), adapters).eval()
    assert torch.equal(_logits(reloaded), expected)


def _tied_lora_model(target):
    """A tied tiny Llama with peft LoRA on one side of the tie (and on q_proj), B != 0 from the start."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", target], init_lora_weights=False)
    return get_peft_model(tiny_llama(seed=0, tie_word_embeddings=True), config)


class _DuckLoraHead(nn.Linear):
    """An output layer with an adapter kept as plain parameters, as tensor-parallel LoRA keeps it
    (`lora_A` [r, in], `lora_B` [out, r], `lora_scaling`): what `fold_adapters` folds on merge."""

    def __init__(self, weight: nn.Parameter, r: int = 4, scaling: float = 2.0) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight = weight     # the embedding's own parameter: the tie of the model
        self.lora_A = nn.Parameter(torch.randn(r, weight.shape[1]) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(weight.shape[0], r) * 0.1)
        self.lora_scaling = scaling

    def forward(self, x):
        return super().forward(x) + self.lora_scaling * nn.functional.linear(nn.functional.linear(x, self.lora_A),
                                                                             self.lora_B)


@pytest.mark.parametrize("kind", ["peft_lm_head", "peft_embed_tokens", "folded_lm_head"])
def test_lora_on_one_side_of_a_tied_embedding_merges_untied(tmp_path, kind, caplog):
    """A tied model shares one base weight between embed_tokens and lm_head, but LoRA adds its delta on one side
    only. The merge used to crash in transformers' tie_weights (peft on lm_head) or re-tie the folded weights,
    dropping the delta or applying it to both sides (peft on embed_tokens: relative error ~1; a tensor-parallel
    adapter on lm_head). The merged model is now untied and computes the trained model's logits; the adapters
    alone, loaded by peft onto the tied base, too. Tolerance 1e-6 relative: a folded W + s B A rounds once in fp32.
    """
    if kind == "folded_lm_head":
        model = tiny_llama(seed=0, tie_word_embeddings=True)
        torch.manual_seed(1)
        model.lm_head = _DuckLoraHead(model.model.embed_tokens.weight)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)     # LoRA trains the adapters only
        model = _train_one_step(model).eval()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = _train_one_step(_tied_lora_model(kind[len("peft_"):])).eval()
    expected = _logits(model)
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    with caplog.at_level("WARNING", logger="atorch.checkpoint.merge"):
        merged_dir = merge_checkpoint(ckpt, str(tmp_path / "merged"))
    assert "the merged model is written untied" in caplog.text
    assert json.load(open(os.path.join(merged_dir, "config.json")))["tie_word_embeddings"] is False
    merged = _load_hf(merged_dir)
    assert merged.lm_head.weight is not merged.model.embed_tokens.weight
    assert ((_logits(merged) - expected).norm() / expected.norm()).item() < 1e-6

    adapters_dir = merge_checkpoint(ckpt, str(tmp_path / "adapters"), lora="adapters")
    if kind == "folded_lm_head":
        from atorch.checkpoint.tp_lora import ADAPTER_WEIGHTS_NAME

        assert set(load_file(os.path.join(adapters_dir, ADAPTER_WEIGHTS_NAME))) == {
            "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"}
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(tiny_llama(seed=0, tie_word_embeddings=True), adapters_dir).eval()
    assert ((_logits(reloaded) - expected).norm() / expected.norm()).item() < 1e-6


def test_lora_beside_a_tied_embedding_keeps_the_merged_model_tied(tmp_path):
    """Adapters elsewhere leave the tied pair equal: the merged model stays tied (saved once)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(seed=0, tie_word_embeddings=True),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model = _train_one_step(model).eval()
    out = merge_checkpoint(save_checkpoint(model, str(tmp_path / "ckpt")), str(tmp_path / "merged"))
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
    merged = _load_hf(out)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert torch.allclose(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)


def test_plain_module_becomes_safetensors_under_module_names(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    out = merge_checkpoint(ckpt, str(tmp_path / "out"))
    assert os.listdir(out) == ["model.safetensors"]
    loaded = load_file(os.path.join(out, "model.safetensors"))
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_merge_input_errors(tmp_path):
    ckpt = save_checkpoint(tiny_llama(seed=0), str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="lora='both'; valid values are"):
        merge_checkpoint(ckpt, str(tmp_path / "o"), lora="both")
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        merge_checkpoint(ckpt, str(tmp_path / "o"), max_shard_size="lots")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        merge_checkpoint(str(tmp_path / "ckpt" / "dcp"), str(tmp_path / "o"))
    # A class of another architecture: a ValueError naming both (it was AttributeError: 'LlamaConfig' object has
    # no attribute 'embd_pdrop' from inside transformers), before any output exists.
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM

    for cls, wants in ((GPT2LMHeadModel, "GPT2Config"), (Qwen2ForCausalLM, "Qwen2Config")):
        with pytest.raises(ValueError, match=rf"model_class={cls.__name__} is built from a {wants}, but the "
                                             rf"checkpoint .* holds a LlamaConfig .*pass model_class=None"):
            merge_checkpoint(ckpt, str(tmp_path / "o"), model_class=cls)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "latest"]     # nothing written
    # Under a regular file: NotADirectoryError naming the merge's internal staging directory (sub.tmp-...) before.
    (tmp_path / "a_file").write_text("x")
    for out in (tmp_path / "a_file" / "sub", tmp_path / "a_file" / "deeper" / "sub"):
        with pytest.raises(ValueError, match=rf"^out_dir='{out}' cannot be created: '{tmp_path / 'a_file'}' is an "
                                             r"existing file, not a directory"):
            merge_checkpoint(ckpt, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ckpt", "latest"]
    (tmp_path / "a_file").unlink()

    class MyLlama(LlamaForCausalLM):      # a custom class of the same architecture is taken
        pass

    assert _load_hf(merge_checkpoint(ckpt, str(tmp_path / "mine"), model_class=MyLlama))
    # A root of checkpoints without `latest`: the checkpoints are named, and which one to give.
    root = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(tiny_llama(seed=0), str(root / f"step_{step}"), step=step)
    (root / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"directory of checkpoints \['step_1', 'step_2'\] without a 'latest' "
                                              rf"pointer; give the one to merge, e.g. the newest: {root / 'step_2'}"):
        merge_checkpoint(str(root), str(tmp_path / "o"))
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1MiB") == 2**20 and parse_size(123) == 123
    # Units without B read as with it (they raised KeyError, a traceback from `atorch merge`).
    assert parse_size("2G") == 2 * 10**9 and parse_size("512k") == 512_000 and parse_size("1Gi") == 2**30
    for bad in ("1I", "2GB2", True, 0):
        with pytest.raises(ValueError, match="max_shard_size="):
            parse_size(bad)


def test_save_parallelized_and_from_parallelized(tmp_path):
    model = _train_one_step(tiny_llama(seed=0)).eval()
    attach_checkpoint_methods(model)
    model.save_parallelized(str(tmp_path / "sharded"))
    other = attach_checkpoint_methods(tiny_llama(seed=3)).eval()
    other.from_parallelized(str(tmp_path / "sharded"))
    assert torch.equal(_logits(other), _logits(model))
    model.save_parallelized(str(tmp_path / "hf"), merge_checkpoints=True, tokenizer=str(TOKENIZER_DIR))
    assert torch.equal(_logits(_load_hf(str(tmp_path / "hf"))), _logits(model))
    assert sorted(os.listdir(tmp_path)) == ["hf", "sharded"]  # the temporary sharded copy is gone
    # from_parallelized reads the merged (Hugging Face) form too, including a tied head left out of the files.
    tied = attach_checkpoint_methods(_train_one_step(tiny_llama(seed=0, tie_word_embeddings=True)).eval())
    tied.save_parallelized(str(tmp_path / "hf_tied"), merge_checkpoints=True)
    fresh = attach_checkpoint_methods(tiny_llama(seed=4, tie_word_embeddings=True)).eval()
    assert fresh.from_parallelized(str(tmp_path / "hf_tied")) is None
    assert torch.equal(_logits(fresh), _logits(tied))
    with pytest.raises(CheckpointError, match=r"shape mismatches: model.embed_tokens.weight: model \(1024, 128\)"):
        attach_checkpoint_methods(tiny_llama(hidden_size=128, tie_word_embeddings=True)).from_parallelized(
            str(tmp_path / "hf_tied"))
    with pytest.raises(CheckpointError, match="neither an atorch checkpoint"):
        fresh.from_parallelized(str(tmp_path))


_MERGE_PEAK_SCRIPT = """
import sys
import safetensors.torch, torch.distributed.checkpoint, transformers  # imported before the peak is reset
from atorch.checkpoint import merge_checkpoint

def kib(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

before = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
merge_checkpoint(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(kib("VmHWM") - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_merge_streams_one_shard_at_a_time(tmp_path):
    import subprocess
    import sys

    # 12 tensors of 16 MiB (192 MiB): merged in 16 MiB shards, the peak stays near 2 tensors.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    tensor_mib, total_mib = 16, 12 * 16
    run = subprocess.run([sys.executable, "-c", _MERGE_PEAK_SCRIPT, ckpt, out, f"{tensor_mib}MiB"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                              # a fixed mmap threshold: freed tensors go back to the OS, so the peak
                              # measures the live tensors, not glibc's retention of freed ones
                              "MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert run.returncode == 0, run.stderr
    peak_mib = int(run.stdout.split()[-1]) / 1024
    # Bound: one output shard (16 MiB) + DCP's read buffer of one tensor (16 MiB) + 48 MiB for the
    # interpreter's and allocator's own churn (measured: 51 MiB in all); the whole model in one shard: 227 MiB.
    assert peak_mib <= 2 * tensor_mib + 48 < total_mib, f"merge peak {peak_mib:.0f} MiB above its RSS"
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) == 12
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_file(os.path.join(out, name)))
    assert merged.keys() == model.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("as_object", [True, False], ids=["tokenizer_object", "tokenizer_dir"])
def test_the_tokenizer_recorded_at_save_travels_to_the_merged_folder(tmp_path, as_object):
    """save_checkpoint(..., tokenizer=...) records it (checksummed by the manifest); merge copies it by default."""
    from atorch.checkpoint import verify_checkpoint
    from atorch.testing.assets import load_tokenizer

    model = _train_one_step(tiny_llama(seed=0)).eval()
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), tokenizer=load_tokenizer() if as_object else TOKENIZER_DIR)
    assert "tokenizer/tokenizer.json" in verify_checkpoint(ckpt, collective=False).files
    out = merge_checkpoint(ckpt, str(tmp_path / "hf"))
    expected = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))("hello world")["input_ids"]
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == expected
    assert torch.equal(_logits(_load_hf(out)), _logits(model))
    # An explicit tokenizer still wins over the recorded one.
    other = tmp_path / "other_tokenizer"
    load_tokenizer().save_pretrained(str(other))
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    out2 = merge_checkpoint(ckpt, str(tmp_path / "hf2"), tokenizer=str(other))
    assert AutoTokenizer.from_pretrained(out2).model_max_length == 77
    assert AutoTokenizer.from_pretrained(out).model_max_length != 77


def test_a_bad_tokenizer_is_refused_before_saving(tmp_path):
    model = tiny_llama(seed=0)
    with pytest.raises(ValueError, match=r"tokenizer=42 must be a tokenizer object \(with save_pretrained\) or a "
                                         r"directory of tokenizer files"):
        save_checkpoint(model, str(tmp_path / "ckpt"), tokenizer=42)
    with pytest.raises(ValueError, match="has none of the tokenizer files"):
        save_checkpoint(model, str(tmp_path / "ckpt"), tokenizer=str(tmp_path))
    assert not (tmp_path / "ckpt").exists()
    # Without a recorded tokenizer the merged folder simply has none (as before).
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"))
    assert not os.path.exists(os.path.join(merge_checkpoint(ckpt, str(tmp_path / "hf")), "tokenizer.json"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_architecture_family_merges_to_a_model_transformers_loads(tmp_path, family):
    """Save -> merge -> `from_pretrained` gives the trained model's logits exactly, with no missing,
    unexpected or mismatched keys, for every family the tensor-parallel tests cover (fused experts,
    tied and padded vocabularies, parallel attention, biases, per-head norms)."""
    model, _ = build_family(family)
    model = _train_one_step(model).eval()
    out = merge_checkpoint(save_checkpoint(model, str(tmp_path / "ckpt")), str(tmp_path / "hf"))
    assert torch.equal(_logits(_load_hf(out)), _logits(model))


def test_merging_into_a_directory_that_holds_an_earlier_model_replaces_its_weights(tmp_path):
    """from_pretrained prefers model.safetensors over a sharded index: a stale single file used to survive a
    sharded merge into the same directory, and the old weights were loaded without a word."""
    a, b = tiny_llama(seed=1), tiny_llama(seed=2)
    save_checkpoint(a, str(tmp_path / "a"))
    save_checkpoint(b, str(tmp_path / "b"))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("the user's own file")
    merge_checkpoint(str(tmp_path / "a"), str(out), max_shard_size="1GB")          # one model.safetensors
    merge_checkpoint(str(tmp_path / "b"), str(out), max_shard_size="100KB")        # shards + index
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").exists()
    assert torch.equal(_logits(_load_hf(str(out))), _logits(b.eval()))
    merge_checkpoint(str(tmp_path / "a"), str(out), max_shard_size="1GB")          # and back
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                     "model.safetensors"]
    assert torch.equal(_logits(_load_hf(str(out))), _logits(a.eval()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "hf", "latest"]   # no staging left behind


class _Wrapper(nn.Module):
    """Stands for a mixin that wrappers give a model by swapping its class (FSDP2's FSDP<Name>)."""


def test_a_model_whose_class_a_wrapper_swapped_merges_as_its_transformers_class(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from atorch.utils.module_utils import derived_class

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=128, num_labels=3, pad_token_id=0)
    model = LlamaForSequenceClassification(config).eval()
    expected = model(X % 128).logits
    model.__class__ = derived_class(type(model), _Wrapper, "Wrapped", __name__)
    save_checkpoint(model, str(tmp_path / "ckpt"))
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    # Recorded as the transformers class: the merge builds that, not the causal LM of the config's type.
    assert meta["model"]["class"].endswith("modeling_llama.LlamaForSequenceClassification"), meta["model"]
    merge_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    merged = LlamaForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(merged(X % 128).logits, expected)


class _PlainNet(nn.Module):
    """Not a transformers model: no config.json in its checkpoint."""

    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
        self.register_buffer("freqs", torch.arange(6.0))

    def forward(self, x):
        return self.ff(x) + self.freqs


def test_lora_of_a_plain_module_merges_with_model_class_and_records_the_users_class(tmp_path):
    """merge_checkpoint(model_class=...) of peft LoRA on a plain nn.Module: "merge" writes the merged state dict
    (model_class().load_state_dict), "adapters" peft's adapter files (PeftModel.from_pretrained on model_class());
    without model_class the refusal names it. meta.json records the user's class, not peft's or DDP's."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_PlainNet(), LoraConfig(r=2, lora_alpha=4, target_modules=["ff.0"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()                                   # a trained adapter: not the identity
    x = torch.randn(3, 6)
    expected = model(x).detach()
    ckpt = save_checkpoint(model, str(tmp_path / "c"), step=0)
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["model"]["class"] == f"{__name__}._PlainNet", meta["model"]

    with pytest.raises(ValueError, match="pass model_class="):
        merge_checkpoint(ckpt, str(tmp_path / "none"))
    merge_checkpoint(ckpt, str(tmp_path / "merged"), model_class=_PlainNet)
    plain = _PlainNet()
    plain.load_state_dict(load_file(str(tmp_path / "merged" / "model.safetensors")))
    torch.testing.assert_close(plain(x), expected)
    # max_shard_size holds here too: shards and an index, which transformers' loader reads into any module.
    try:
        from transformers.trainer_utils import load_sharded_checkpoint      # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import load_sharded_checkpoint

    merge_checkpoint(ckpt, str(tmp_path / "sharded"), model_class=_PlainNet, max_shard_size=100)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) >= 3, files
    plain = _PlainNet()
    load_sharded_checkpoint(plain, str(tmp_path / "sharded"))
    torch.testing.assert_close(plain(x), expected)
    merge_checkpoint(ckpt, str(tmp_path / "adapters"), model_class=_PlainNet, lora="adapters")
    base = _PlainNet()                                        # the base weights, unmerged
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in model.get_base_model().state_dict().items()
                          if "lora_" not in k})
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapters"))
    torch.testing.assert_close(reloaded(x), expected)
