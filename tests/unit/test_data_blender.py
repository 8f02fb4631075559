"""DatasetBlender: realized shares within 1% over every 1000-sample window, determinism, bad weights."""

import warnings

import numpy as np
import pytest
import torch

from atorch.data import DatasetBlender, blend_schedule


class Tagged:
    """A dataset whose item i is (name, i)."""

    def __init__(self, name, n):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return (self.name, i)


def worst_window_error(dataset_index, weights, window=1000):
    """Largest |share - weight| of any dataset over any `window` consecutive samples."""
    worst = 0.0
    for d, w in enumerate(weights):
        counts = np.concatenate([[0], np.cumsum(dataset_index == d)])
        shares = (counts[window:] - counts[:-window]) / window
        worst = max(worst, float(np.abs(shares - w).max()))
    return worst


@pytest.mark.parametrize("weights", [
    [0.5, 0.3, 0.2], [0.97, 0.01, 0.01, 0.01], [1 / 3] * 3, [0.123, 0.877],
    list(np.random.default_rng(0).dirichlet(np.ones(9))), [1 / 40] * 40,
    # Many equal small weights beside a large one: due together without the phases (2% off).
    [0.9] + [0.1 / 30] * 30, [0.5] + [0.5 / 9] * 9,
    list(np.random.default_rng(1).dirichlet(np.ones(100) * 0.3)),
])
def test_every_window_of_1000_is_within_one_percent(weights):
    dataset_index, sample_index = blend_schedule(weights, 30_000)
    assert worst_window_error(dataset_index, np.array(weights) / sum(weights)) < 0.01
    # Each dataset's samples are taken in order 0, 1, 2, ... with no gap or repeat.
    for d in range(len(weights)):
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


def test_random_weights_stay_within_one_percent():
    rng = np.random.default_rng(1)
    for _ in range(30):
        k = int(rng.integers(2, 50))
        weights = rng.dirichlet(np.ones(k) * 0.5)
        dataset_index, _ = blend_schedule(weights, 5000)
        assert worst_window_error(dataset_index, weights) < 0.01, weights


def test_default_weights_take_every_sample_once():
    datasets = [Tagged("a", 300), Tagged("b", 100), Tagged("c", 600)]
    blend = DatasetBlender(datasets)
    assert len(blend) == 1000 and blend.weights == [0.3, 0.1, 0.6]
    items = [blend[i] for i in range(len(blend))]
    assert sorted(items) == sorted((d.name, i) for d in datasets for i in range(len(d)))
    assert blend[-1] == items[-1]
    with pytest.raises(IndexError, match="sample 1000 out of range for 1000"):
        blend[1000]


def test_explicit_weights_size_and_wrap_around():
    with pytest.warns(UserWarning, match=r"reads datasets\[0\] 100.00 times \(1000 samples of its 10\); those "
                                         r"samples repeat in the same order\. Pass size <= about 20 "):
        blend = DatasetBlender([Tagged("small", 10), Tagged("big", 1000), Tagged("off", 5)], weights=[1, 1, 0],
                               size=2000)
    items = [blend[i] for i in range(len(blend))]
    names = [name for name, _ in items]
    assert names.count("small") == names.count("big") == 1000 and "off" not in names
    # The small dataset wraps around: 100 passes over its 10 samples, in order.
    assert [i for name, i in items if name == "small"] == list(range(10)) * 100
    # Deterministic: the same arguments give the same order.
    with pytest.warns(UserWarning, match="repeat"):
        again = DatasetBlender([Tagged("small", 10), Tagged("big", 1000), Tagged("off", 5)], weights=[1, 1, 0],
                               size=2000)
    assert np.array_equal(again.dataset_index, blend.dataset_index)


def test_a_dataset_read_more_than_once_is_named_in_a_warning():
    datasets = [Tagged("a", 10), Tagged("b", 3)]
    # A zero weight with the default size (the sum of ALL lengths) reads `a` 1.3 times: it used to say nothing.
    with pytest.warns(UserWarning, match=r"size=13 with weights \[1, 0\] reads datasets\[0\] 1.30 times \(13 samples "
                                         r"of its 10\).* size <= about 10 "):
        blend = DatasetBlender(datasets, [1, 0])
    assert [blend[i] for i in range(13)] == [("a", i % 10) for i in range(13)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # one pass over each dataset: no warning
        DatasetBlender(datasets)
        DatasetBlender(datasets, [1, 0], size=10)
        DatasetBlender(datasets, [10, 3], size=13)


def test_index_must_be_an_integer():
    blend = DatasetBlender([Tagged("a", 10), Tagged("b", 3)])
    assert blend[np.int64(1)] == blend[torch.tensor(1)] == blend[1]
    # numpy's bare "only integers, slices ... are valid indices" named neither the blender nor the index.
    with pytest.raises(TypeError, match=r"DatasetBlender index must be an int, got float 1.0"):
        blend[1.0]
    with pytest.raises(TypeError, match=r"got str '1'"):
        blend["1"]


@pytest.mark.parametrize("datasets, weights, message", [
    ([], None, "datasets is empty"),
    ([Tagged("a", 3), Tagged("b", 3)], [1.0], r"weights has 1 entries but 2 datasets were given"),
    ([Tagged("a", 3), Tagged("b", 3)], [0.5, -0.1], r"weights\[1\]=-0.1; every weight must be a finite number >= 0"),
    ([Tagged("a", 3), Tagged("b", 3)], [0.5, float("nan")], r"weights\[1\]=nan"),
    ([Tagged("a", 3), Tagged("b", 3)], [0, 0], "weights sum to 0; at least one must be > 0"),
    ([Tagged("a", 3), Tagged("b", 0)], [1, 1], r"datasets\[1\] is empty but has weight 1"),
    ([Tagged("a", 0), Tagged("b", 0)], None, "all 2 datasets are empty"),
    ([Tagged("a", 3), Tagged("b", 3)], ["1", "2"], r"weights\[0\]='1'; every weight must be a finite number"),
])
def test_bad_weights_raise(datasets, weights, message):
    with pytest.raises(ValueError, match=message):
        DatasetBlender(datasets, weights)


@pytest.mark.filterwarnings("ignore:DatasetBlender.*repeat")  # a dataset read twice, on purpose
def test_tensor_and_numpy_scalar_weights_count_as_numbers():
    datasets = [Tagged("a", 10), Tagged("b", 10)]
    expected = DatasetBlender(datasets, [0.25, 0.75], size=40)
    for weights in (torch.tensor([0.25, 0.75]), np.array([0.25, 0.75]), [torch.tensor(0.25), np.array(0.75)],
                    torch.tensor([1, 3]), [np.float32(0.25), np.float64(0.75)]):
        blend = DatasetBlender(datasets, weights, size=40)
        assert blend.weights == pytest.approx([0.25, 0.75]) and all(type(w) is float for w in blend.weights)
        assert np.array_equal(blend.dataset_index, expected.dataset_index)
    # Not a number: the message names the type (it said "every weight must be a finite number" of tensor(0.25)).
    with pytest.raises(ValueError, match=r"weights\[1\]=tensor\(\[0.5000, 0.5000\]\); .* not a Tensor"):
        DatasetBlender(datasets, [torch.tensor(1.0), torch.tensor([0.5, 0.5])])
    with pytest.raises(ValueError, match=r"weights\[0\]=\(1\+0j\); .* not a complex"):
        DatasetBlender(datasets, torch.tensor([1 + 0j, 1 + 0j]))


@pytest.mark.filterwarnings("ignore:DatasetBlender.*repeat")  # a dataset read twice, on purpose
def test_huge_weights_do_not_overflow_the_normalization():
    # Their sum overflowed to inf and every share became 0; the error then showed [0.0, 0.0], not the input.
    datasets = [Tagged("a", 10), Tagged("b", 10)]
    blend = DatasetBlender(datasets, [1e308, 1e308], size=40)
    assert blend.weights == [0.5, 0.5]
    assert np.array_equal(blend.dataset_index, DatasetBlender(datasets, [1, 1], size=40).dataset_index)
    assert DatasetBlender(datasets, [1e308, 3e307], size=40).weights == pytest.approx([1 / 1.3, 0.3 / 1.3])
    dataset_index, _ = blend_schedule([1e308, 1e308], 40)
    assert np.array_equal(dataset_index, blend.dataset_index)
    with pytest.raises(ValueError, match=r"got \[1e\+308, -1.0\]"):
        blend_schedule([1e308, -1.0], 4)


def test_bad_size_raises():
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        DatasetBlender([Tagged("a", 3)], size=0)
    with pytest.raises(ValueError, match=r"size=5.5 must be an int"):   # was truncated to 5 without a word
        DatasetBlender([Tagged("a", 3)], size=5.5)
    with pytest.warns(UserWarning, match="repeat"):
        assert len(DatasetBlender([Tagged("a", 3)], [np.float32(1.0)], size=np.int64(4))) == 4
