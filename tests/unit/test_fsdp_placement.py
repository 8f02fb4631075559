"""FSDP2's shard dimension per parameter: dim 0 unless it pads much and another dimension pads less."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from atorch.auto.opt_lib._sharding import least_padded_placement, padded_elements


def test_padded_elements_counts_the_padded_rows_times_the_row():
    assert padded_elements((8, 192, 64), 0, 64) == 56 * 192 * 64
    assert padded_elements((8, 192, 64), 1, 64) == 0
    assert padded_elements((10,), 0, 4) == 2


@pytest.mark.parametrize("shape, ranks, expected", [
    ((8, 28672, 4096), 64, Shard(1)),    # Mixtral's experts on 64 data ranks: one expert per rank at dim 0
    ((8, 4096), 64, Shard(1)),           # its router
    ((8, 4096, 14336), 8, None),         # as many experts as ranks: dim 0 splits evenly
    ((32003, 4096), 64, None),           # an odd vocabulary: a few padded rows are not worth a copy per gather
    ((3, 8), 4, Shard(1)),               # dim 0 pads a third, dim 1 nothing
    ((3, 5), 4, None),                   # dim 1 does not split evenly: FSDP2 pads dim 0 only
    ((9, 66), 4, None),                  # GPT-2 with a 9-token vocabulary and width 66 on 4 ranks
    ((8, 4096), 12, None),               # a router on 12 data ranks: 4096 does not split over 12
    ((2, 192, 64), 4, Shard(1)),         # two experts on 4 ranks: the widest even dimension
    ((2, 6, 64), 4, Shard(2)),           # ... which need not be the first even one
    ((3, 3), 4, None),                   # no dimension pads less
    ((4096,), 64, None),                 # norms and biases: one dimension
])
def test_the_shard_dimension(shape, ranks, expected):
    assert least_padded_placement(ranks)(nn.Parameter(torch.empty(shape, device="meta"))) == expected


def test_a_parameter_two_blocks_share_is_refused_naming_it_before_any_collective():
    import pytest
    from torch import nn

    from atorch.auto.opt_lib._sharding import check_no_parameter_spans_blocks

    class Block(nn.Module):
        def __init__(self, fc=None):
            super().__init__()
            self.fc = fc if fc is not None else nn.Linear(4, 4)

    first = Block()
    model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([first, Block(first.fc), Block()]))
    # ALBERT-style sharing failed deep in torch's second fully_shard ("Cannot concatenate overlapping meshes").
    with pytest.raises(ValueError, match=r"fsdp: parameter '1.0.fc.weight' is shared by '1.0' and '1.1'"):
        check_no_parameter_spans_blocks(model, list(model[1]), "fsdp")
    # Blocks that share nothing, or a block nested in another (children are sharded first), pass.
    check_no_parameter_spans_blocks(model, [model[1][0], model[1][2]], "fsdp")
    outer = nn.Sequential(first)
    check_no_parameter_spans_blocks(nn.Sequential(outer), [outer, first], "fsdp")


def test_an_encoder_s_embedding_is_not_a_block():
    """BERT-family encoders name their embeddings in `_no_split_modules` with their layers. As a block the
    embedding became an FSDP unit of its own, and the tied MLM head in the root unit made `fully_shard` fail
    (the automatic search's zero2/fsdp candidates raised on BERT); the activation probe measured it as the
    first block. Blocks are the named classes that stand in a layer stack (a model naming none that does keeps
    what it names: ViLT's embeddings and an attention inside a layer)."""
    from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

    from atorch.auto.opt_lib._sharding import check_no_parameter_spans_blocks
    from atorch.testing import tiny_bert_mlm
    from atorch.utils.module_utils import find_transformer_block_classes, modules_of_classes

    bert = tiny_bert_mlm()
    assert [c.__name__ for c in find_transformer_block_classes(bert)] == ["BertLayer"]
    check_no_parameter_spans_blocks(bert, modules_of_classes(bert, find_transformer_block_classes(bert)), "fsdp")
    vit = AutoModelForImageClassification.from_config(AutoConfig.for_model(
        "vit", image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64))
    assert [c.__name__ for c in find_transformer_block_classes(vit)] == ["ViTLayer"]
    vilt = AutoModel.from_config(AutoConfig.for_model(
        "vilt", vocab_size=100, max_position_embeddings=64, image_size=32, patch_size=8, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    assert [c.__name__ for c in find_transformer_block_classes(vilt)] == ["ViltEmbeddings", "ViltSelfAttention"]


def test_a_block_sharing_a_parameter_with_the_root_is_refused_naming_both():
    """wrap_cls naming BERT's embedding: its word embedding is the MLM head's decoder weight, which stays in the
    root unit. Refused before any collective, naming the parameter, the block and the module outside."""
    import pytest

    from atorch.auto.opt_lib._sharding import check_no_parameter_spans_blocks
    from atorch.testing import tiny_bert_mlm
    from atorch.utils.module_utils import modules_of_classes, resolve_module_classes

    bert = tiny_bert_mlm()
    blocks = modules_of_classes(bert, resolve_module_classes(bert, ["BertEmbeddings", "BertLayer"]))
    with pytest.raises(ValueError, match=r"zero2: parameter 'bert\.embeddings\.word_embeddings\.weight' of the wrapped "
                                         r"block 'bert\.embeddings' \(BertEmbeddings\) is also used by "
                                         r"'cls\.predictions\.decoder'.*Pass wrap_cls without BertEmbeddings"):
        check_no_parameter_spans_blocks(bert, blocks, "zero2")
