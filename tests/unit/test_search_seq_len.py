"""The sequence length the search's cost model reads off the user's dataset (`auto_search.infer_seq_len`)."""

import pytest
import torch

from atorch.auto.search.auto_search import infer_seq_len


@pytest.mark.parametrize("sample, expected", [
    ({"input_ids": torch.zeros(12, dtype=torch.long), "labels": torch.zeros(12, dtype=torch.long)}, 12),
    ((torch.zeros(2, 9, dtype=torch.long), torch.zeros(2)), 9),     # token ids: the last dimension
    ((torch.randn(16), torch.tensor(1)), 1),            # one vector of 16 features: one position, not 16
    ((torch.randn(5, 16), torch.randn(5)), 5),          # five positions of 16 features
    (torch.randn(3, 8, 8), 1),                          # an image: no sequence
    ("text", 1),
])
def test_token_ids_give_their_length_and_feature_vectors_one_position(sample, expected):
    assert infer_seq_len([sample]) == expected


def test_no_dataset_or_one_without_indexing_is_one_position():
    assert infer_seq_len(None) == 1
    assert infer_seq_len(iter([{"input_ids": torch.zeros(4)}])) == 1
