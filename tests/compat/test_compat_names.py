"""Names ATorch's own tests and scripts import, at ATorch's paths (dlrover bfd04ef1).

- `atorch.distributed.distributed`: `ParallelGroupContextManager(prefix)` (groups created inside
  are named `prefix + name` and looked up by `name` inside it), `_DistributedContext` (here a
  read-only view), `get_pg_ranks` / `get_ranks_in_same_group` (rank tables, first dim fastest,
  repeated over copies of the layout).
- `atorch.common.log_utils.{Timer, TimeStats}`, `atorch.common.util_func.exit_after`.
- `atorch.modules.distributed_modules.layers._initialize_affine_weight` (rank r of n takes pieces
  r, r+n, ... of `per_partition_size // stride` rows of the master weight).
- `atorch.modules.distributed_modules.randomizer.{init_randomizer, get_randomizer, get_MDPRInstance}`.
- `vocab_parallel_cross_entropy(logits, target, label_smoothing)`: over the "tensor" group, one
  loss per token; parity with `F.cross_entropy(..., label_smoothing=)` on the gathered logits.
"""

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from atorch.common.log_utils import TimeStats, Timer
from atorch.common.util_func import exit_after
from atorch.distributed.distributed import (
    ParallelGroupContextManager,
    _DistributedContext,
    get_pg_ranks,
    get_ranks_in_same_group,
)
from atorch.modules.distributed_modules.cross_entropy import vocab_parallel_cross_entropy
from atorch.modules.distributed_modules.layers import ParallelEmbedding, _initialize_affine_weight
from atorch.testing import run_distributed


def test_timer_and_time_stats():
    timer = Timer("step")
    timer.start()
    timer.end()
    assert timer.elapsed_time >= 0
    stats = TimeStats("train")
    assert stats["forward"] is None
    with Timer("forward", stats) as t:
        sum(range(1000))
    assert stats["forward"] == t.elapsed_time >= 0
    written = {}

    class Writer:
        def add_scalars(self, values, n_iter, name):
            written.update(values=dict(values), n_iter=n_iter, name=name)

        def flush(self):
            written["flushed"] = True

    stats.to_dashboard(Writer(), 3)
    assert written == {"values": {"forward": t.elapsed_time}, "n_iter": 3, "name": "train", "flushed": True}


def test_exit_after():
    @exit_after(0.2)
    def slow():
        time.sleep(5)

    @exit_after(2)
    def quick(x):
        return x + 1

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="slow timed out after 0.2 s"):
        slow()
    assert time.monotonic() - start < 4
    assert quick(1) == 2
    caught = []
    thread = threading.Thread(target=lambda: caught.append(pytest.raises(RuntimeError, quick, 1)))
    thread.start()
    thread.join()
    assert "main thread" in str(caught[0].value)
    with pytest.raises(ValueError, match="seconds must be a number > 0"):
        exit_after(0)


def test_rank_tables():
    tables = get_pg_ranks([("model", 2), ("pipeline", 2), ("data", 2)], list(range(8)))
    assert tables == [{"model": [[0, 1], [2, 3], [4, 5], [6, 7]], "pipeline": [[0, 2], [1, 3], [4, 6], [5, 7]],
                       "data": [[0, 4], [1, 5], [2, 6], [3, 7]]}]
    two = get_pg_ranks([("tensor", 4), ("data", 2)], list(range(16)))
    assert two[1]["tensor"] == [[8, 9, 10, 11], [12, 13, 14, 15]] and two[1]["data"][0] == [8, 12]
    assert get_ranks_in_same_group(([("tensor", 4), ("data", 2)], list(range(16))), 10) == {
        "tensor": [8, 9, 10, 11], "data": [10, 14]}
    with pytest.raises(ValueError, match="multiply to 4, which does not divide the 6 ranks"):
        get_pg_ranks([("tensor", 4)], list(range(6)))


def test_distributed_context_is_a_read_only_view():
    from atorch.distributed.distributed import destroy_parallel_group

    destroy_parallel_group()   # an earlier test in this process may have left groups (auto_accelerate publishes them)
    assert _DistributedContext.INITIALIZED is torch.distributed.is_initialized()
    assert _DistributedContext.PARALLEL_RANK is None
    assert _DistributedContext.PG_NAME_PREFIX == ""
    with ParallelGroupContextManager("p1_"):
        assert _DistributedContext.PG_NAME_PREFIX == "p1_"
    assert _DistributedContext.PG_NAME_PREFIX == ""
    with pytest.raises(AttributeError, match="WORLD_SIZE is read-only here"):
        _DistributedContext.WORLD_SIZE = 8
    with pytest.raises(AttributeError, match="has no attribute 'STORE'"):
        _DistributedContext.STORE


def test_initialize_affine_weight_without_groups_copies_or_draws():
    master = torch.arange(12.0).view(4, 3)
    weight = torch.empty(4, 3)
    assert _initialize_affine_weight(weight, 4, 0, master_weight=master) is None
    assert torch.equal(weight, master)
    torch.manual_seed(0)
    drawn = _initialize_affine_weight(weight, 4, 0, init_method=torch.nn.init.ones_, return_master_weight=True)
    assert drawn is weight and torch.equal(weight, torch.ones(4, 3))


def test_randomizer_api_at_the_old_path():
    from atorch.modules.distributed_modules import randomizer as old

    r = old.init_randomizer()
    assert r.base_seed == 1234 and old.get_randomizer() is r
    with old.get_randomizer().fork():
        a = torch.rand(3)
    with old.get_randomizer().fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)           # one stream, continued
    states = old.get_MDPRInstance().get_states()
    with old.get_randomizer().fork():
        c = torch.rand(3)
    old.get_MDPRInstance().set_states(states)
    with old.get_randomizer().fork():
        assert torch.equal(torch.rand(3), c)
    assert old.MultiDimParallelRandomizer is r.__class__ and old._DEFAULT is r   # the moved module's state


def test_vocab_parallel_cross_entropy_signature_and_label_smoothing_one_process():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 10, requires_grad=True)
    target = torch.randint(0, 7, (2, 5))
    target[1, 2] = -100
    ref = logits.detach()[..., :7].clone().requires_grad_()
    # Columns 7..9 are padding (vocab_size=7): the autograd function path, with smoothing.
    losses = vocab_parallel_cross_entropy(logits, target, 0.1, vocab_size=7)
    expected = F.cross_entropy(ref.reshape(-1, 7), target.reshape(-1), label_smoothing=0.1, reduction="none")
    assert losses.shape == (2, 5) and torch.allclose(losses.reshape(-1), expected, atol=1e-6)
    (losses * torch.arange(10.0).view(2, 5)).sum().backward()
    (expected * torch.arange(10.0)).sum().backward()
    assert torch.allclose(logits.grad[..., :7], ref.grad, atol=1e-6) and logits.grad[..., 7:].abs().max() == 0
    # No padding: F.cross_entropy itself; keywords of atorch's earlier signature still work.
    mean = vocab_parallel_cross_entropy(logits[..., :7], target, label_smoothing=0.2, group=None, reduction="mean")
    assert torch.allclose(mean, F.cross_entropy(ref.reshape(-1, 7), target.reshape(-1), label_smoothing=0.2))
    with pytest.raises(ValueError, match="the third argument is label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, "tensor")
    with pytest.raises(ValueError, match=r"label_smoothing=1.0 must be a float in \[0, 1\)"):
        vocab_parallel_cross_entropy(logits, target, 1.0)
    with pytest.raises(TypeError):
        vocab_parallel_cross_entropy(logits, target, 0.0, None)   # group is keyword-only


# -- two gloo ranks -------------------------------------------------------------------------------

def _two_ranks() -> dict:
    import torch.distributed as dist

    from atorch.distributed.distributed import (
        create_parallel_group,
        destroy_parallel_group,
        get_device_mesh,
        parallel_config,
        parallel_group,
        parallel_group_and_ranks,
        parallel_rank,
    )

    rank = dist.get_rank()
    out: dict = {}
    # Two sets of groups with the same dimension name, one under a prefix (ATorch's distributed_test).
    create_parallel_group(([("model", 2)], None))
    with ParallelGroupContextManager("pg_p_1_"):
        create_parallel_group(([("model", 2)], None))
        inner = parallel_group("model")
        out["inner_rank"] = parallel_rank("model")
        out["inner_ranks"] = parallel_group_and_ranks("model")[1]
        out["inner_config"] = parallel_config()
        out["inner_mesh"] = get_device_mesh("model").mesh_dim_names
        out["keys"] = sorted(_DistributedContext.PARALLEL_RANK)
        t = torch.ones(1)
        dist.all_reduce(t, group=inner)
        out["inner_sum"] = float(t)
    outer = parallel_group("model")
    out["outer_mesh"] = get_device_mesh("model").mesh_dim_names
    t = torch.ones(1)
    dist.all_reduce(t, group=outer)
    out["outer_sum"] = float(t)
    out["sizes"] = dict(_DistributedContext.PARALLEL_GROUP_SIZE)
    destroy_parallel_group()
    out["after_destroy"] = _DistributedContext.PARALLEL_RANK

    create_parallel_group(([("tensor", 2)], None))
    # _initialize_affine_weight: rank r takes pieces r, r+2, ... of the master weight.
    master = torch.arange(24.0).view(6, 4)
    w = torch.empty(3, 4)
    _initialize_affine_weight(w, 3, 0, master_weight=master)
    out["affine_rows"] = w[:, 0].tolist()
    w3 = torch.empty(3, 4)
    _initialize_affine_weight(w3, 3, 0, stride=3, master_weight=master)
    out["affine_strided_rows"] = w3[:, 0].tolist()
    torch.manual_seed(7)   # the same master weight on both ranks
    drawn = torch.empty(4, 2)
    full = _initialize_affine_weight(drawn, 2, 1, init_method=torch.nn.init.xavier_normal_, out_features=4,
                                     in_features=4, return_master_weight=True)
    out["drawn_ok"] = torch.equal(drawn, full[:, 2 * rank:2 * rank + 2])

    # Vocabulary-parallel loss over the default "tensor" group, with smoothing and padding.
    torch.manual_seed(0)
    vocab, padded = 7, 8
    full_logits = torch.randn(3, 4, padded)
    target = torch.randint(0, vocab, (3, 4))
    target[0, 1] = -100
    mine = full_logits[..., 4 * rank:4 * rank + 4].clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(mine, target, 0.1, vocab_size=vocab)
    weights = torch.arange(12.0).view(3, 4)
    (losses * weights).sum().backward()
    ref = full_logits[..., :vocab].clone().requires_grad_()
    expected = F.cross_entropy(ref.reshape(-1, vocab), target.reshape(-1), label_smoothing=0.1, reduction="none")
    (expected * weights.reshape(-1)).sum().backward()
    ref_grad = torch.cat([ref.grad, torch.zeros(3, 4, padded - vocab)], dim=-1)[..., 4 * rank:4 * rank + 4]
    out["ce_loss_err"] = float((losses.reshape(-1) - expected).abs().max().detach())
    out["ce_grad_err"] = float((mine.grad - ref_grad).abs().max())
    emb = ParallelEmbedding(10, 6)
    out["embedding_shape"] = tuple(emb(torch.tensor([[1, 2]])).shape)
    destroy_parallel_group()
    try:
        vocab_parallel_cross_entropy(mine, target)
    except ValueError as e:
        out["no_tensor_group"] = str(e)
    return out


@pytest.mark.distributed
@pytest.mark.heavy   # one spawn of 2 ranks: 40-60 s on the shared 2-core machine
def test_two_ranks_prefixed_groups_affine_weight_and_vocab_parallel_loss():
    outs = run_distributed(_two_ranks, 2)
    for rank, out in enumerate(outs):
        assert out["inner_rank"] == rank and out["inner_ranks"] == [0, 1] and out["outer_mesh"] == ("model",)
        assert out["inner_config"] == ([("model", 2)], None) and out["inner_mesh"] == ("pg_p_1_model",)
        assert out["keys"] == ["model", "pg_p_1_model"] and out["inner_sum"] == out["outer_sum"] == 2.0
        assert out["sizes"] == {"model": 2, "pg_p_1_model": 2} and out["after_destroy"] is None
        assert out["affine_rows"] == ([0.0, 4.0, 8.0] if rank == 0 else [12.0, 16.0, 20.0])
        assert out["affine_strided_rows"] == ([0.0, 8.0, 16.0] if rank == 0 else [4.0, 12.0, 20.0])
        assert out["drawn_ok"]
        # fp32; the split changes only the order of the vocabulary sums.
        assert out["ce_loss_err"] < 1e-5 and out["ce_grad_err"] < 1e-5
        assert out["embedding_shape"] == (1, 2, 6)
        assert "there is no 'tensor' parallel group" in out["no_tensor_group"]


def test_torch_version_and_materialize_path():
    from atorch.modules.distributed_modules.materialize_modules import materialize_modules_to_device
    from atorch.utils.meta_model_utils import materialize_modules_to_device as moved
    from atorch.utils.version import torch_version

    assert torch_version("2.13.0+cpu") == (2, 13, 0) and torch_version("2.6.0a0+git1") == (2, 6, 0)
    assert torch_version("nightly") == () and torch_version() >= (2, 0, 0)
    assert materialize_modules_to_device is moved


def test_is_coworker_is_false():
    import atorch

    assert atorch.distributed.is_coworker() is False   # no coworker processes here: every process trains
