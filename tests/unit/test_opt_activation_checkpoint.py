"""`checkpoint`: same gradients, fewer saved activations, recomputation in backward, unchanged state dict."""

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import ValidationContext, get_optimization, resolve_strategy
from atorch.auto.opt_lib.activation_checkpoint import CheckpointConfig, is_checkpointed
from atorch.auto.strategy import Strategy
from atorch.testing import tiny_gpt2, tiny_llama

SEQ = 64


def _apply(model, raw=None):
    opt = get_optimization("checkpoint")()
    config = opt.parse_config(raw)
    opt.validate(config, ValidationContext(world_size=1, model=model))
    ctx = ModelContext(model=model)
    opt.apply(ctx, config)
    return ctx


def _batch(seed=0, batch=2):
    x = torch.randint(4, 1024, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "labels": x}


def _saved_activation_bytes(model, batch):
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    return loss, sum(storages.values())


def _four_layer(make):
    return make(seed=0, num_hidden_layers=4) if make is tiny_llama else make(seed=0, n_layer=4)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_same_loss_and_gradients_with_less_saved_activation_memory(make):
    plain = _four_layer(make)
    ckpt = copy.deepcopy(plain)
    ctx = _apply(ckpt)
    assert ctx.summaries["checkpoint"]["blocks"] == 4
    plain.train()
    ckpt.train()
    batch = _batch()
    plain_loss, plain_bytes = _saved_activation_bytes(plain, batch)
    ckpt_loss, ckpt_bytes = _saved_activation_bytes(ckpt, batch)
    # Inside checkpointed blocks nothing is saved; only the embedding, final norm, head and loss
    # (plus each block's input, kept by reference) remain. Measured: 4.4 MB -> 1.0 MB.
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
    plain_loss.backward()
    ckpt_loss.backward()
    # Recomputation runs the same kernels on the same inputs in the same order: bitwise equal.
    assert torch.equal(plain_loss, ckpt_loss)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_dropout_masks_are_replayed_in_recomputation():
    # With dropout, recomputation must restore the RNG state of the original forward, or the
    # recomputed activations (and so the gradients) would differ from the ones used for the loss.
    dropout = {"resid_pdrop": 0.2, "attn_pdrop": 0.2, "embd_pdrop": 0.2}
    plain = tiny_gpt2(seed=0, **dropout)
    ckpt = copy.deepcopy(plain)
    _apply(ckpt)
    grads = []
    for model in (plain, ckpt):
        model.train()
        torch.manual_seed(1)
        model(**_batch()).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


def test_tensor_parallel_dropout_streams_are_replayed(monkeypatch):
    # Tensor parallelism draws dropout masks from its own per-group streams, swapped in by hooks
    # on the dropout modules inside the blocks; recomputation must see the same stream states.
    from atorch.modules.distributed_modules import randomizer as rnd

    monkeypatch.setattr(rnd, "_DEFAULT", None)  # restored after the test
    dropout = {"resid_pdrop": 0.2, "attn_pdrop": 0.2, "embd_pdrop": 0.2}
    plain = tiny_gpt2(seed=0, **dropout)
    ckpt = copy.deepcopy(plain)
    _apply(ckpt)
    grads, losses = [], []
    for model in (plain, ckpt):
        rnd.init_randomizer(base_seed=5, coords={})
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                rnd.fork_module_rng(m, replicated=True)
        model.train()
        torch.manual_seed(1)
        loss = model(**_batch()).loss
        loss.backward()
        losses.append(loss)
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(losses[0], losses[1])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_structure_parameter_names_and_state_dict_keys_unchanged(make):
    model = make(seed=0)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    module_types = [type(m) for m in model.modules()]
    _apply(model)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert [type(m) for m in model.modules()] == module_types
    model.load_state_dict(make(seed=1).state_dict())  # strict load of an unwrapped model's checkpoint


def test_blocks_recompute_in_backward_only_while_training():
    model = tiny_llama(seed=0)
    _apply(model)
    calls = []
    for layer in model.model.layers:
        # A hook on a module *inside* the block fires again when backward recomputes the block.
        layer.self_attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    batch = _batch()
    model.train()
    loss = model(**batch).loss
    assert len(calls) == 2
    loss.backward()
    assert len(calls) == 4, "each of the 2 blocks must run its forward again in backward"
    calls.clear()
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch).loss.backward()
    assert len(calls) == 4, "no recomputation under no_grad or in eval mode"


def test_kv_cache_arguments_are_disabled_inside_checkpointed_blocks():
    # Llama passes a DynamicCache by keyword, GPT-2 positionally; a recomputed block would
    # append to it twice. Checkpointed training must not write it.
    for make in (tiny_llama, tiny_gpt2):
        model = make(seed=0)
        _apply(model)
        model.train()
        out = model(**_batch(), use_cache=True)
        out.loss.backward()
        cache = out.past_key_values
        assert cache is None or cache.get_seq_length() == 0, type(model).__name__


def test_wrap_cls_by_name_or_class_keeps_only_outermost_blocks():
    model = tiny_llama(seed=0, num_hidden_layers=3)
    ctx = _apply(model, {"wrap_cls": ["LlamaDecoderLayer", LlamaMLP]})
    # LlamaMLP sits inside LlamaDecoderLayer: nesting a second checkpoint would recompute twice.
    assert ctx.summaries["checkpoint"] == {"blocks": 3, "classes": ["LlamaDecoderLayer"]}
    assert all(is_checkpointed(layer) for layer in model.model.layers)
    assert not any(is_checkpointed(layer.mlp) for layer in model.model.layers)

    only_mlp = tiny_llama(seed=0)
    ctx = _apply(only_mlp, {"wrap_cls": "LlamaMLP"})
    assert ctx.summaries["checkpoint"] == {"blocks": 2, "classes": ["LlamaMLP"]}


def test_replaces_hugging_face_gradient_checkpointing():
    model = tiny_llama(seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _apply(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    model.train()
    model(**_batch()).loss.backward()
    assert len(calls) == 2, "one forward plus one recomputation, not a nested second one"


def test_generic_module_list_model_and_deepcopy():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            return torch.tanh(self.fc(x)) * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x, scale=0.5)
            return x.sum()

    torch.manual_seed(0)
    plain = Net()
    ckpt = copy.deepcopy(plain)
    assert _apply(ckpt).summaries["checkpoint"]["blocks"] == 3
    x = torch.randn(4, 8)
    plain(x).backward()
    ckpt(x).backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    clone = copy.deepcopy(ckpt)
    # The wrapper is a bound method: a copy recomputes its own block, not the original's.
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]
    _apply(clone)  # idempotent
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]


def test_validation_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"'NoSuchLayer' is not in the model; its module classes are \[.*"
                                         r"LlamaDecoderLayer"):
        _apply(tiny_llama(), {"wrap_cls": ["NoSuchLayer"]})
    with pytest.raises(ValueError, match=r"found no transformer block class in Sequential.*pass wrap_cls"):
        _apply(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer'\] has no instance in GPT2LMHeadModel"):
        _apply(tiny_gpt2(), {"wrap_cls": [LlamaDecoderLayer]})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['cls'\]; valid keys are \['wrap_cls'\]"):
        _apply(tiny_llama(), {"cls": "LlamaDecoderLayer"})
    with pytest.raises(ValueError, match="non-empty list"):
        CheckpointConfig(wrap_cls=())


def test_strategy_with_classes_resolves_in_documented_order():
    model = tiny_llama()
    strategy = Strategy([("checkpoint", {"wrap_cls": [LlamaDecoderLayer]}), "lora", "module_replace"])
    restored = Strategy.from_json(strategy.to_json())  # classes travel by import path
    assert restored == strategy
    resolved = resolve_strategy(restored, ValidationContext(world_size=1, model=model, model_config=model.config))
    # Module replacement and LoRA change the blocks before checkpointing wraps them.
    assert [r.name for r in resolved] == ["parallel_mode", "module_replace", "lora", "checkpoint"]
    assert resolved[-1].config.wrap_cls == (LlamaDecoderLayer,)


def test_kv_cache_arguments_are_dropped_whatever_their_name():
    # transformers renames the blocks' cache argument between releases (past_key_value,
    # past_key_values, cache); a Cache object under any name must not be written twice.
    from transformers.cache_utils import DynamicCache

    from atorch.auto.opt_lib.activation_checkpoint import _without_cache

    class Block(nn.Module):
        def forward(self, x, kv_store=None, use_cache=True, scale=2.0):
            return x * scale

    import inspect

    block = Block()
    args, kwargs = _without_cache(block, (torch.ones(1), DynamicCache()), {"use_cache": True, "scale": 3.0})
    bound = inspect.signature(block.forward).bind(*args, **kwargs).arguments
    assert bound["kv_store"] is None and bound["use_cache"] is False and bound["scale"] == 3.0
    assert torch.equal(bound["x"], torch.ones(1))


def test_only_the_blocks_own_forked_dropouts_bring_in_the_stream_replay(monkeypatch):
    # A randomizer left in the process (an earlier tensor-parallel dry run) must not make an
    # unrelated model's checkpoint pass a context_fn: torch.compile cannot trace that replay.
    from atorch.auto.opt_lib.activation_checkpoint import _parallel_randomizer_of
    from atorch.tensor_parallel import randomizer as rnd

    monkeypatch.setattr(rnd, "_DEFAULT", None)
    stale = rnd.init_randomizer(base_seed=3, coords={})
    plain = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    assert _parallel_randomizer_of(plain) is None
    forked = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1), nn.Dropout(0.0))
    rnd.fork_module_rng(forked[1])
    assert _parallel_randomizer_of(forked) is stale               # the process default, looked up at call time
    own = rnd.MultiDimParallelRandomizer(5)
    idle = nn.Sequential(nn.Dropout(0.0))
    rnd.fork_module_rng(idle[0], randomizer=own)
    assert _parallel_randomizer_of(idle) is None                  # p == 0 draws nothing
    idle[0].p = 0.2
    assert _parallel_randomizer_of(idle) is own
