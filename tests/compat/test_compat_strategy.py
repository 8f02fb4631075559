"""ATorch's Strategy methods and pickled strategy files.

ATorch (dlrover bfd04ef1, `atorch/auto/strategy.py`, `accelerate.py`) saved a `Strategy`
(whose `opt_list` is a list of `(name, config, tunable)`) with `pickle.dumps`, and loaded
`load_strategy` files or bytes with `pickle.loads`. Here such files are read by a restricted
unpickler that executes nothing, and strategies are still written as JSON.
"""

import os
import pickle

import pytest
import torch

import atorch.auto.strategy as strategy_module
from atorch.auto.strategy import Strategy, convert_strategy_file

ITEMS = [("parallel_mode", ([("data", 2)], None), False), ("amp_native", {"dtype": torch.bfloat16}, False),
         ("fsdp", {"atorch_wrap_cls": ["LlamaDecoderLayer"], "sync_module_states": True}, None),
         ("checkpoint", None, True)]


class AtorchStrategy:
    """Pickles exactly like ATorch's Strategy: module atorch.auto.strategy, name Strategy, state {'opt_list'}."""

    def __init__(self, opt_list):
        self.opt_list = opt_list


def atorch_pickle(opt_list, monkeypatch, protocol=pickle.DEFAULT_PROTOCOL) -> bytes:
    AtorchStrategy.__module__, AtorchStrategy.__qualname__ = "atorch.auto.strategy", "Strategy"
    monkeypatch.setattr(strategy_module, "Strategy", AtorchStrategy)
    try:
        return pickle.dumps(AtorchStrategy(opt_list), protocol=protocol)
    finally:
        monkeypatch.undo()


def test_strategy_methods():
    s = Strategy(["parallel_mode"])
    s.add_opt(("amp_native", {"dtype": "bf16"}, None))
    s.add_opt("checkpoint")
    assert s.opt_names() == ["parallel_mode", "amp_native", "checkpoint"]
    assert s.get_parallel_mode() == (True, None)
    assert Strategy([("fsdp", None)]).get_parallel_mode() == (False, None)
    assert Strategy([("parallel_mode", ([("data", 4)], None))]).get_parallel_mode() == (True, ([("data", 4)], None))


@pytest.mark.parametrize("protocol", [0, 2, pickle.DEFAULT_PROTOCOL])
def test_atorch_pickle_files_load_and_convert_to_json(tmp_path, monkeypatch, protocol):
    path = tmp_path / "strategy.pkl"
    path.write_bytes(atorch_pickle(ITEMS, monkeypatch, protocol))
    expected = [(n, c, bool(t)) for n, c, t in ITEMS]
    if protocol == 0:  # protocol 0 does not start with the 0x80 marker: only bytes/JSON detection applies
        with pytest.raises(ValueError, match="is neither a JSON strategy .* nor an ATorch strategy pickle"):
            Strategy.load(path)
        return
    loaded = Strategy.load(path)
    assert loaded.to_list() == expected
    assert Strategy.from_any(path.read_bytes()).to_list() == expected   # load_strategy=bytes, as in ATorch
    out = tmp_path / "strategy.json"
    convert_strategy_file(path, out)
    assert out.read_text().lstrip().startswith("{")
    assert Strategy.load(out) == loaded


def test_plain_list_pickle_is_accepted():
    data = pickle.dumps([("zero1", None, False), "checkpoint"])
    assert Strategy.from_any(data).to_list() == [("zero1", None, False), ("checkpoint", None, False)]


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo owned > /tmp/atorch_strategy_exploit",))


@pytest.mark.parametrize("payload", [
    lambda: pickle.dumps(Exploit()),
    lambda: pickle.dumps([("fsdp", {"x": Exploit()}, False)]),
    lambda: pickle.dumps([("checkpoint", {"wrap_class": torch.nn.Linear}, False)]),
])
def test_anything_but_plain_values_is_refused_without_running_it(tmp_path, payload):
    marker = "/tmp/atorch_strategy_exploit"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / "evil.pkl"
    path.write_bytes(payload())
    with pytest.raises(ValueError, match=rf"strategy '{path}' is not an accepted ATorch strategy pickle: .*refers to"):
        Strategy.load(path)
    assert not os.path.exists(marker)


def test_errors_name_the_file_and_the_formats(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("not a strategy")
    with pytest.raises(ValueError, match=rf"strategy '{path}' is neither a JSON strategy .*accepted formats"):
        Strategy.load(path)
    path.write_bytes(pickle.dumps({"opt_list": 1}))
    with pytest.raises(ValueError, match="holds dict, not an ATorch Strategy"):
        Strategy.load(path)
    path.write_bytes(pickle.dumps([("fsdp", None, "yes")]))
    with pytest.raises(ValueError, match="tunable='yes' must be a bool or None"):
        Strategy.load(path)
