"""Checkpoint details in one process: what `load_checkpoint` restores under each flag, the merge's refusal of a
config it cannot build, ZeRO-3's scatter source, the one optimizer unwrapper, and messages that show the
offending value."""

import json
import os
import re
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atorch.checkpoint import CheckpointError, load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint.layout_handlers import TorchHandler, flatten_optimizer
from atorch.checkpoint.merge import group_by_bytes
from atorch.modules.grad_scaling import GradScalingOptimizer
from atorch.utils.memory import innermost_optimizer


def _result(seed: int):
    from atorch.auto.result import AutoAccelerateResult

    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    return AutoAccelerateResult(
        model=model, optim=optimizer, dataloader=None, loss_func=lambda batch, out: out.sum(),
        prepare_input=lambda batch, device=None: batch,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        grad_scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))


@pytest.mark.parametrize("save_optimizer", [True, False])
def test_what_load_checkpoint_restores_under_load_optimizer(tmp_path, save_optimizer):
    """The lr schedule, the grad scaler (and a DeepSpeed engine's counters) travel with the optimizer state:
    a scheduler's step count next to a fresh optimizer's lr would schedule from the wrong base. With
    load_optimizer=False none of them is restored, whatever the checkpoint holds."""
    saved = _result(0)
    for _ in range(3):
        saved.model(torch.randn(2, 4)).sum().backward()
        saved.optim.step()
        saved.lr_scheduler.step()
    saved.grad_scaler.scale(torch.ones(()))
    saved.grad_scaler.update(512.0)
    path = save_checkpoint(saved, str(tmp_path / "ckpt"), step=3, save_optimizer=save_optimizer)

    fresh = _result(1)
    state = load_checkpoint(fresh, path, load_optimizer=False)
    assert torch.equal(fresh.model.weight, saved.model.weight) and state.step == 3 and not state.optimizer_restored
    assert fresh.lr_scheduler.last_epoch == 0 and fresh.optim.param_groups[0]["lr"] == 1.0
    assert not fresh.optim.state and fresh.grad_scaler.get_scale() == 1024.0

    fresh = _result(1)
    if not save_optimizer:
        with pytest.raises(CheckpointError, match="saved without optimizer state; pass load_optimizer=False"):
            load_checkpoint(fresh, path)
        return
    state = load_checkpoint(fresh, path)
    assert state.optimizer_restored and fresh.optim.state
    assert fresh.lr_scheduler.last_epoch == 3 and fresh.optim.param_groups[0]["lr"] == 0.125
    assert fresh.grad_scaler.get_scale() == 512.0


def test_a_checkpoint_saved_without_an_lr_scheduler_loads_into_a_run_with_one(tmp_path):
    """`initial_lr` is written into the groups by a scheduler's construction, not saved by a run without one:
    its absence is no different optimizer. The optimizer's state and lr load; initial_lr stays this run's."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.25
    path = save_checkpoint(model, str(tmp_path / "ckpt"), step=1, optimizer=optimizer)

    fresh = nn.Linear(4, 4)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=2, gamma=0.5)
    state = load_checkpoint(fresh, path, optimizer=fresh_optim, lr_scheduler=scheduler)
    assert state.optimizer_restored and torch.equal(fresh.weight, model.weight)
    assert fresh_optim.param_groups[0]["lr"] == 0.25 and fresh_optim.param_groups[0]["initial_lr"] == 0.5
    assert torch.equal(fresh_optim.state[fresh.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])


class _TiedHead(nn.Module):
    """An embedding and an LM head sharing one weight, or (`tied=False`) kept as two copies the way a native
    pipeline keeps a tied pair split over two stages (`tied_weight_names`, gradients summed every step)."""

    def __init__(self, seed: int, tied: bool):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            self.head.weight.data.copy_(self.embed.weight.data)
            self.tied_weight_names = ("embed.weight", "head.weight")

    def train_step(self, optimizer):
        self(torch.arange(8)).square().sum().backward()
        if self.head.weight is not self.embed.weight:   # the pipeline's all-reduce of the tied pair
            total = self.embed.weight.grad + self.head.weight.grad
            self.embed.weight.grad, self.head.weight.grad = total, total.clone()
        optimizer.step()
        optimizer.zero_grad()

    def forward(self, x):
        return self.head(self.embed(x))


def test_a_tied_weight_loads_between_a_pipeline_s_two_copies_and_one_shared_parameter(tmp_path, monkeypatch):
    """A pipeline's checkpoint of a tied pair holds both copies' optimizer states (equal: same weight, same
    summed gradient); the tied model takes one, and its checkpoint fills both copies. A checkpoint naming
    the shared parameter twice is refused before the weights are touched when the tie is not known."""
    copies = _TiedHead(0, tied=False)
    copies_optim = torch.optim.AdamW(copies.parameters(), lr=0.1)
    for _ in range(2):
        copies.train_step(copies_optim)
    split = save_checkpoint(copies, str(tmp_path / "split"), step=2, optimizer=copies_optim)

    tied = _TiedHead(1, tied=True)
    tied_optim = torch.optim.AdamW(tied.parameters(), lr=0.1)
    load_checkpoint(tied, split, optimizer=tied_optim)
    assert torch.equal(tied.embed.weight, copies.embed.weight) and len(tied_optim.state) == 1
    loaded, saved = tied_optim.state[tied.embed.weight], copies_optim.state[copies.head.weight]
    assert torch.equal(loaded["exp_avg"], saved["exp_avg"])
    tied.train_step(tied_optim)
    shared = save_checkpoint(tied, str(tmp_path / "tied"), step=3, optimizer=tied_optim)

    copies.train_step(copies_optim)
    again = _TiedHead(2, tied=False)
    again_optim = torch.optim.AdamW(again.parameters(), lr=0.1)
    load_checkpoint(again, shared, optimizer=again_optim)
    for p in (again.embed.weight, again.head.weight):
        assert torch.equal(p, copies.embed.weight)
        assert torch.equal(again_optim.state[p]["exp_avg_sq"], copies_optim.state[copies.embed.weight]["exp_avg_sq"])

    monkeypatch.setattr(TorchHandler, "tied_weights", lambda self: [])
    fresh = _TiedHead(3, tied=True)
    before = fresh.embed.weight.detach().clone()
    with pytest.raises(CheckpointError, match="param group 0 has 1 parameters, but the checkpoint's hyperparameters "
                                              "name 2 .*tied"):
        load_checkpoint(fresh, split, optimizer=torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert torch.equal(fresh.embed.weight, before)


def test_an_untied_checkpoint_loads_into_a_tied_model_only_when_its_two_tensors_are_equal(tmp_path):
    """An untied model's embedding and head are two tensors; a tied model (one shared Parameter, or a pipeline's
    two copies) would take whichever is read last, silently. Refused by both names before anything is loaded, with
    the optimizer or without; equal tensors load."""
    untied = _TiedHead(0, tied=False)
    del untied.tied_weight_names              # an ordinary untied model: its head trained apart from the embedding
    with torch.no_grad():
        untied.head.weight.add_(1.0)
    untied_optim = torch.optim.AdamW(untied.parameters(), lr=0.1)
    untied.train_step(untied_optim)
    path = save_checkpoint(untied, str(tmp_path / "untied"), step=1, optimizer=untied_optim)
    for target in (_TiedHead(1, tied=True), _TiedHead(1, tied=False)):   # shared Parameter; a pipeline's copies
        before = [p.detach().clone() for p in target.parameters()]
        for load_optimizer in (False, True):
            with pytest.raises(CheckpointError, match="holds 'embed.weight' and 'head.weight' as two different "
                                                      "tensors.*ties them.*tie_word_embeddings=False"):
                load_checkpoint(target, path, load_optimizer=load_optimizer,
                                optimizer=torch.optim.AdamW(target.parameters(), lr=0.1))
        assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before))

    equal = _TiedHead(0, tied=False)
    del equal.tied_weight_names
    path = save_checkpoint(equal, str(tmp_path / "equal"), step=1)
    tied = _TiedHead(1, tied=True)
    load_checkpoint(tied, path)
    assert torch.equal(tied.embed.weight, equal.embed.weight)


def test_a_deepspeed_engine_over_a_tied_model_refuses_an_untied_checkpoint(tmp_path):
    """A DeepSpeed engine reads and writes a tied Parameter once per name (full fp32 copies), so an untied
    checkpoint's head overwrote the embedding there too, silently; refused the same way, and a tied one loads."""
    from atorch.auto import auto_accelerate
    from atorch.testing.models import tiny_llama
    from atorch.testing.parity import TokenDataset

    untied, tied = tiny_llama(seed=0), tiny_llama(seed=2, tie_word_embeddings=True)
    untied_path = save_checkpoint(untied, str(tmp_path / "untied"), step=1)
    tied_path = save_checkpoint(tied, str(tmp_path / "tied"), step=1)
    status, result, _ = auto_accelerate(tiny_llama(seed=1, tie_word_embeddings=True), torch.optim.AdamW,
                                        TokenDataset(n=8, seq_len=8), dataloader_args={"batch_size": 4},
                                        load_strategy=[("zero1", {"use_ds_zero": True})])
    assert status
    try:
        model = result.engine.module
        before = model.lm_head.weight.detach().clone()
        with pytest.raises(CheckpointError, match="holds 'model.embed_tokens.weight' and 'lm_head.weight' as two "
                                                  "different tensors"):
            load_checkpoint(result, untied_path, load_optimizer=False)
        assert torch.equal(model.lm_head.weight, before)
        load_checkpoint(result, tied_path, load_optimizer=False)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, tied.lm_head.weight)
    finally:
        result.engine.destroy()


def test_an_optimizer_grouped_differently_from_the_checkpoint_is_refused(tmp_path):
    """Hyperparameters are restored per group from its first parameter's: one saved group loaded into decay /
    no-decay groups would give the no-decay group the decay, two groups into one would drop the second's lr.
    Refused naming the first parameter whose group differs and both groupings; the same grouping loads."""
    def model_and_groups(split: bool, seed: int = 0):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        if not split:
            return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        no_decay = [model[0].bias, model[1].weight, model[1].bias]
        return model, torch.optim.AdamW([{"params": [model[0].weight]}, {"params": no_decay, "weight_decay": 0.0,
                                                                         "lr": 0.2}], lr=0.1, weight_decay=0.5)

    for saved_split in (False, True):
        model, optimizer = model_and_groups(saved_split)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        path = save_checkpoint(model, str(tmp_path / f"split_{saved_split}"), step=1, optimizer=optimizer)
        other, other_optim = model_and_groups(not saved_split, seed=1)
        before = other[0].weight.detach().clone(), [dict(g, params=None) for g in other_optim.param_groups]
        one = "[['0.weight', '0.bias', '1.weight', '... 1 more']]"
        two = "[['0.weight'], ['0.bias', '1.weight', '1.bias']]"
        groups = (f"this optimizer's groups are {one if saved_split else two}, the checkpoint's "
                  f"{two if saved_split else one}")
        now, was = (0, 1) if saved_split else (1, 0)
        with pytest.raises(CheckpointError, match=f"optimizer parameter '0.bias' is in param group {now} .*saved in "
                                                  f"group {was}.*{re.escape(groups)}.*load_optimizer=False"):
            load_checkpoint(other, path, optimizer=other_optim)
        assert torch.equal(other[0].weight, before[0]) and [dict(g, params=None) for g in other_optim.param_groups] \
            == before[1]
        same, same_optim = model_and_groups(saved_split, seed=1)
        load_checkpoint(same, path, optimizer=same_optim)
        assert [g["lr"] for g in same_optim.param_groups] == [g["lr"] for g in optimizer.param_groups]
        assert torch.equal(same_optim.state[same[1].bias]["exp_avg"], optimizer.state[model[1].bias]["exp_avg"])


def test_a_checkpoint_whose_config_has_no_causal_lm_class_asks_for_model_class(tmp_path):
    """A custom module holding a T5 config (a piece of an encoder-decoder): no transformers class to build it by
    name, and T5 has no causal-LM class. The merge says to pass model_class=, not transformers' "Unrecognized
    configuration class"."""
    from transformers import AutoConfig

    class Piece(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = AutoConfig.for_model("t5", d_model=8, num_layers=1, num_heads=2, d_kv=4, d_ff=16,
                                               vocab_size=32)
            self.proj = nn.Linear(8, 8)

    ckpt = save_checkpoint(Piece(), str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"T5Config.*no causal-LM class; pass model_class="):
        merge_checkpoint(ckpt, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_group_by_bytes_takes_any_size_function():
    tensors = [("a", torch.zeros(3)), ("b", torch.zeros(2)), ("c", torch.zeros(10))]
    assert [list(g) for g in group_by_bytes(tensors, 20)] == [["a", "b"], ["c"]]   # 12 + 8 bytes, then 40
    assert [list(g) for g in group_by_bytes(tensors, 20, nbytes=lambda t: t.numel())] == [["a", "b", "c"]]


def test_zero3_scatter_writes_the_weights_on_the_rank_deepspeed_broadcasts_from(monkeypatch):
    """`GatheredParameters(modifier_rank=0)` broadcasts from rank 0 *of the parameter's data-parallel group*
    (DeepSpeed converts it with get_global_rank). Here that process is global rank 1 (a group [1, 3], as
    under pipeline or tensor parallelism): it must hold the loaded weights when the context exits."""
    from atorch.checkpoint.deepspeed_layout import _scatter
    from atorch.testing.fake_distributed import fake_process_group

    broadcast_from_here = []

    class GatheredParameters:   # DeepSpeed's, reduced to which process is the broadcast's source
        def __init__(self, params, modifier_rank=None):
            self.params, self.modifier_rank = params, modifier_rank

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            for p in self.params:
                if dist.get_rank(group=p.ds_process_group) == self.modifier_rank:
                    broadcast_from_here.append(p.data.clone())

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(
        zero=types.SimpleNamespace(GatheredParameters=GatheredParameters)))
    with fake_process_group(1, 4):
        p = nn.Parameter(torch.zeros(2, 3))
        p.ds_process_group = dist.new_group([1, 3])
        full = torch.arange(6.0).reshape(2, 3)
        _scatter(p, full)
    assert len(broadcast_from_here) == 1 and torch.equal(broadcast_from_here[0], full)


class _SharesState(torch.optim.Optimizer):
    """A wrapper holding no state of its own (as accelerate's AcceleratedOptimizer)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups


class _OwnState(torch.optim.Optimizer):
    """A wrapper with state of its own next to its inner optimizer's (as a Lookahead's slow weights)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.state = {}
        self.param_groups = optimizer.param_groups


def test_one_optimizer_unwrapper_serves_memory_accounting_and_checkpoints():
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cases = {"grad scaling": (GradScalingOptimizer(inner, torch.amp.GradScaler("cpu")), inner),
             "shares state": (_SharesState(inner), inner),
             "own state": (_OwnState(inner), None)}
    for what, (wrapped, expected) in cases.items():
        expected = wrapped if expected is None else expected
        assert innermost_optimizer(wrapped) is expected, what
        assert TorchHandler(model, wrapped)._local_optim is expected, what


def test_an_optimizer_tensor_that_is_not_a_model_parameter_is_named_by_group_and_shape():
    model = nn.Linear(4, 2)
    stray = nn.Parameter(torch.zeros(5, 3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [stray]}], lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"param group 1 holds a tensor of shape \(5, 3\) that is not a parameter"):
        flatten_optimizer(optimizer, names)


def test_a_malformed_manifest_entry_is_shown(tmp_path):
    ckpt = save_checkpoint(nn.Linear(2, 2), str(tmp_path / "ckpt"))
    path = os.path.join(ckpt, mf.MANIFEST_NAME)
    raw = json.load(open(path))
    name = sorted(raw["files"])[0]
    raw["files"][name] = {"size": "twelve", "xxh3_128": "00"}
    json.dump(raw, open(path, "w"))
    with pytest.raises(CheckpointError, match=r"must have an integer size and one checksum .*; it holds "
                                              r"\{'size': 'twelve', 'xxh3_128': '00'\}"):
        mf.Manifest.read(ckpt)


def test_parameter_groups_merge_by_index_or_by_their_hyperparameters():
    """Ranks with as many groups as each other merge by index (ZeRO-1 shards of the same groups). A pipeline
    stage with fewer groups (one left out as empty there) joins each group to the one with its hyperparameters,
    in order among equal ones, so the recorded grouping is the model's."""
    from atorch.checkpoint.save_load import _param_group_problems, merge_param_groups

    def values(groups):
        return {f"param_groups.{n}.{k}": v for names, settings in groups for n in names for k, v in settings.items()}

    emb, decay, no_decay = {"lr": 5.0, "weight_decay": 0.1}, {"lr": 1.0, "weight_decay": 0.1}, {"lr": 1.0,
                                                                                              "weight_decay": 0.0}
    stage0 = [(["embed"], emb), (["l0.w"], decay), (["l0.norm"], no_decay)]
    stage1 = [(["l1.w", "head"], decay), (["l1.norm", "norm"], no_decay)]
    ranks = [(values(s), [names for names, _ in s]) for s in (stage0, stage1)]
    merged = merge_param_groups(ranks)
    assert merged == [["embed"], ["l0.w", "l1.w", "head"], ["l0.norm", "l1.norm", "norm"]]
    one_process = [["embed"], ["l0.w", "l1.w", "head"], ["l0.norm", "l1.norm", "norm"]]
    assert _param_group_problems(one_process, merged) == []
    assert _param_group_problems([["embed", "l0.w", "l1.w", "head"], ["l0.norm", "l1.norm", "norm"]], merged)
    # Same counts: by index, whatever the hyperparameters (two shards of one optimizer's groups).
    shards = [(values([(["a"], decay), (["b"], no_decay)]), [["a"], ["b"]]),
              (values([(["c"], decay), ([], no_decay)]), [["c"], []])]
    assert merge_param_groups(shards) == [["a", "c"], ["b"]]
    # Two groups with equal hyperparameters on one stage stay two groups (in order) when counts differ.
    twins = [(values([(["x"], decay), (["y"], decay)]), [["x"], ["y"]]), (values([(["z"], decay)]), [["z"]])]
    assert merge_param_groups(twins) == [["x", "z"], ["y"]]
