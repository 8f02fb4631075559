"""ATorch's tensor-parallel API on 4 gloo ranks (tensor 2 x data 2): TPInfo at `atorch.tensor_parallel.manual_tp`,
layers built as ATorch builds them (sizes + Megatron-style init, or orig_module=), ParallelEmbedding, the randomizer.

From ATorch (dlrover bfd04ef1, `modules/distributed_modules/layers.py`, `randomizer.py`,
`tensor_parallel/manual_tp.py`): a layer built from sizes draws a full master weight with
`init_method` (default xavier_normal_) from the current random state, the same on every
rank, and keeps its slice; biases start at zero. Checked: every layer's output (and, for one,
the input gradient) equals the full layer's on the master weight, exactly in fp32 up to the
summation order of the row-parallel all-reduce (atol 1e-6).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atorch.testing import run_distributed

pytestmark = pytest.mark.distributed
ATOL = 1e-6


def _layers_and_randomizer() -> dict:
    from atorch.distributed.distributed import create_parallel_group
    from atorch.tensor_parallel.manual_tp import TPInfo, hf_init_weights_custom_fn, tp_manual_shard_custom_fn
    from atorch.utils import manual_tp_utils
    from atorch.utils.tp_compat import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
        VocabParallelEmbedding,
        get_MDPRInstance,
        get_randomizer,
        init_randomizer,
    )

    out = {"same_objects": TPInfo is manual_tp_utils.TPInfo and
           tp_manual_shard_custom_fn is manual_tp_utils.tp_manual_shard_custom_fn}
    create_parallel_group(([("tensor", 2), ("data", 2)], None))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ids = torch.tensor([[0, 5, 9, 3]])

    def master(shape):
        torch.manual_seed(7)
        return nn.init.xavier_normal_(torch.empty(*shape))

    torch.manual_seed(7)
    col = ColumnParallelLinear(8, 6, gather_output=True)
    out["col"] = (col(x) - F.linear(x, master((6, 8)))).abs().max().item()
    out["col_bias_zero"] = bool((col.bias == 0).all())
    torch.manual_seed(7)
    row = RowParallelLinear(8, 4, input_is_parallel=False)
    y = row(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, master((4, 8)))
    out["row"] = (y - ref).abs().max().item()
    y.sum().backward()
    ref.sum().backward()
    out["row_grad"] = (x.grad - ref_x.grad).abs().max().item()
    torch.manual_seed(7)
    vocab = VocabParallelEmbedding(10, 4)
    out["vocab"] = (vocab(ids) - F.embedding(ids, master((10, 4)))).abs().max().item()
    torch.manual_seed(7)
    pemb = ParallelEmbedding(10, 4)
    out["pemb"] = ((pemb(ids) - F.embedding(ids, master((10, 4)))).abs().max().item(), tuple(pemb.weight.shape))
    torch.manual_seed(3)
    full = nn.Linear(8, 6)
    from_orig = ColumnParallelLinear(orig_module=full, process_group="tensor", gather_output=True)
    out["orig"] = (from_orig(x) - full(x)).abs().max().item()
    for bad in (lambda: ColumnParallelLinear(8, 6, defer_init=True), lambda: RowParallelLinear(),
                lambda: ColumnParallelLinear(8, 6, process_group="pipeline")):
        try:
            bad()
        except ValueError as e:
            out.setdefault("errors", []).append(str(e))

    # Randomizer: a stream shared over "tensor" draws the same numbers on both ranks, the other differs.
    randomizer = init_randomizer(base_seed=1234)
    out["instance"] = get_MDPRInstance().randomizer is randomizer
    with get_randomizer("tensor").fork():
        same = torch.rand(3)
    with get_randomizer().fork():
        different = torch.rand(3)

    @get_randomizer("tensor").fork()
    def draw():
        return torch.rand(2)

    out["draws"] = (same.tolist(), different.tolist(), draw().tolist())
    with get_randomizer("data").fork():
        same_data = torch.rand(3)
    with get_randomizer("tensor", "data").fork():
        same_all = torch.rand(3)
    states = get_MDPRInstance().get_states()
    with get_randomizer("tensor", "data").fork():
        first = torch.rand(2)
    with get_randomizer().fork():
        first_own = torch.rand(2)
    get_MDPRInstance().set_states(states)
    with get_randomizer("tensor", "data").fork():
        again = torch.rand(2)
    with get_randomizer().fork():
        again_own = torch.rand(2)
    out["more_draws"] = (same_data.tolist(), same_all.tolist(),
                         torch.equal(first, again) and torch.equal(first_own, again_own))
    gpt2 = type("M", (nn.Module,), {"_init_weights": lambda self, m: None})()
    out["hf_init"] = hf_init_weights_custom_fn(gpt2) is gpt2
    return out


def test_atorch_tensor_parallel_api_on_four_ranks():
    results = run_distributed(_layers_and_randomizer, 4)
    r0, r1 = results[0], results[1]   # the two tensor ranks of data rank 0
    for out in results:
        assert out["same_objects"] and out["instance"] and out["hf_init"] and out["col_bias_zero"]
        for key in ("col", "row", "row_grad", "vocab", "orig"):
            assert out[key] <= ATOL, (key, out[key])
        assert out["pemb"][0] <= ATOL and out["pemb"][1] == (10, 2)
        assert "defer_init=True) is not supported" in out["errors"][0]
        assert "give orig_module or both input_size and output_size" in out["errors"][1]
        assert "unknown parallel group 'pipeline'" in out["errors"][2]
    # tensor = rank % 2, data = rank // 2 (tensor varies fastest).
    assert r0["draws"][0] == r1["draws"][0] and r0["draws"][2] == r1["draws"][2]   # shared over "tensor"
    assert r0["draws"][1] != r1["draws"][1]                                           # different everywhere
    assert results[2]["draws"][0] != r0["draws"][0]                                  # data ranks differ
    assert results[0]["more_draws"][0] == results[2]["more_draws"][0] != results[1]["more_draws"][0]
    assert len({tuple(out["more_draws"][1]) for out in results}) == 1                # shared over both groups
    assert all(out["more_draws"][2] for out in results)                               # states replay the streams
