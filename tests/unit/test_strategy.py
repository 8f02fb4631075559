import json

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.opt_lib import ValidationContext, is_valid_strategy, registered_names, resolve_strategy


def test_all_item_forms_and_exact_json_round_trip(tmp_path):
    s = Strategy(["parallel_mode",
                  ("amp_native", {"dtype": torch.bfloat16}),
                  ("parallel_mode_x", ([("tensor", 2), ("data", 2)], None), True),
                  ("cls", {"wrap_cls": [torch.nn.Linear], "t": (1, (2, 3))})])
    assert s.names() == ["parallel_mode", "amp_native", "parallel_mode_x", "cls"]
    assert s[2].tunable is True and s[0].config is None
    back = Strategy.from_json(s.to_json())
    assert back == s
    assert back[1].config["dtype"] is torch.bfloat16
    assert back[2].config == ([("tensor", 2), ("data", 2)], None)
    assert back[3].config["wrap_cls"] == [torch.nn.Linear] and back[3].config["t"] == (1, (2, 3))
    path = tmp_path / "s.json"
    s.save(path)
    assert json.loads(path.read_text())["format"] == "atorch.strategy/1"
    assert Strategy.from_any(str(path)) == s


def test_unserializable_config_is_refused_with_its_key():
    with pytest.raises(ValueError, match=r"fsdp.config.fn holds function"):
        Strategy([("fsdp", {"fn": lambda m: m})]).to_json()


def test_bad_items_and_files():
    with pytest.raises(ValueError, match="must be a name"):
        Strategy([42])
    with pytest.raises(ValueError, match="tunable must be a bool"):
        Strategy([("fsdp", None, "yes")])
    with pytest.raises(ValueError, match="does not exist"):
        Strategy.load("/nonexistent/strategy.json")
    # A bare optimization name where a list was meant: the message says how to name optimizations.
    with pytest.raises(ValueError, match=r"does not exist; to apply optimizations by name, pass a list, "
                                         r"e\.g\. load_strategy=\['fsdp'\]"):
        Strategy.load("fsdp")
    with pytest.raises(ValueError, match="not valid JSON"):
        Strategy.from_json("{")


def test_resolve_adds_parallel_mode_and_rejects_unknown_names():
    ctx = ValidationContext(world_size=2)
    resolved = resolve_strategy(Strategy([]), ctx)
    # Two data ranks and nothing that reduces gradients itself: DDP is added too.
    assert [r.name for r in resolved] == ["parallel_mode", "ddp"]
    assert [r.name for r in resolve_strategy(Strategy([]), ValidationContext(world_size=1))] == ["parallel_mode"]
    assert [r.name for r in resolve_strategy(Strategy(["fsdp"]), ctx)] == ["parallel_mode", "fsdp"]
    with pytest.raises(ValueError, match=r"unknown optimization 'fdsp'; valid names are \[.*'parallel_mode'"):
        resolve_strategy(Strategy(["fdsp"]), ctx)
    assert "parallel_mode" in registered_names()


def test_parallel_mode_config_checks():
    ctx = ValidationContext(world_size=4)
    with pytest.raises(ValueError, match="tensor=2 x data=3 = 6 does not equal world size 4"):
        resolve_strategy(Strategy([("parallel_mode", ([("tensor", 2), ("data", 3)], None))]), ctx)
    with pytest.raises(ValueError, match="must be \\(\\[\\(name, size\\)"):
        resolve_strategy(Strategy([("parallel_mode", {"data": 4})]), ctx)
    assert is_valid_strategy(Strategy([("parallel_mode", ([("data", 4)], None))]), ctx)
    with pytest.raises(ValueError, match="listed twice with different configs"):
        resolve_strategy(Strategy([("parallel_mode", ([("data", 4)], None)),
                                   ("parallel_mode", ([("tensor", 4)], None))]), ctx)
    # The same item twice is harmless and applied once.
    resolved = resolve_strategy(Strategy(["parallel_mode", "parallel_mode"]), ctx)
    assert [r.name for r in resolved] == ["parallel_mode", "ddp"]


def test_a_strategy_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "strategy.json"
    path.write_bytes(b"\xef\xbb\xbf" + Strategy(["amp_native", ("fsdp", {"sync_module_states": True})]).to_json()
                     .encode("utf-8"))
    assert Strategy.load(path) == Strategy(["amp_native", ("fsdp", {"sync_module_states": True})])


def test_auto_accelerate_logs_what_it_does_not_use_and_what_it_leaves_out(caplog):
    """excluded/included restrict the search only; with load_strategy a warning says so. A dataset that
    does not fill its last global batch is trimmed each epoch (drop_last, the default), logged once."""
    import torch

    from atorch.auto import auto_accelerate
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    with caplog.at_level("INFO"):
        status, result, _ = auto_accelerate(tiny_llama(), torch.optim.AdamW, TokenDataset(n=10, seq_len=8),
                                            dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"],
                                            excluded=["fsdp"])
    assert status and len(result.dataloader) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("excluded=['fsdp'] and included=None only restrict the automatic search" in m for m in messages)
    assert any("10 samples in global batches of 4: the last 2 are left out in each epoch" in m for m in messages)
    # Unused, but a typo is still a typo (it only warned, and surfaced when the search was run).
    for argument in ("excluded", "included"):
        with pytest.raises(ValueError, match=rf"{argument}=\['fsdpp'\]: unknown optimization 'fsdpp'"):
            auto_accelerate(tiny_llama(), torch.optim.AdamW, TokenDataset(n=10, seq_len=8),
                            dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"], **{argument: ["fsdpp"]})
    # ATorch's optimizations that atorch does not have are names, not typos (their scripts exclude them).
    status, _, _ = auto_accelerate(tiny_llama(), torch.optim.AdamW, TokenDataset(n=10, seq_len=8),
                                   dataloader_args={"batch_size": 4}, load_strategy=["parallel_mode"],
                                   excluded=["amp_apex_o1", "fsdp"])
    assert status


# -- hashing agrees with ==, and never raises -------------------------------------------------------

def test_equal_strategies_hash_alike_and_any_config_hashes():
    a = Strategy([("fsdp", {"cpu_offload": False, "sync_module_states": True})])
    b = Strategy([("fsdp", {"sync_module_states": True, "cpu_offload": False})])   # the same, keys reordered
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    holding = Strategy([("checkpoint", {"wrap_cls": [lambda: None], "sets": {1, 2}, "nested": [{"a": [1]}]})])
    assert isinstance(hash(holding), int)   # a callable, a set, lists of dicts: no JSON needed to hash
    assert len({Strategy(["fsdp"]), Strategy(["fsdp", "amp_native"]), Strategy(["fsdp"])}) == 2


# -- a JSON strategy imports only trusted packages or modules the process has imported ----------------

def test_a_json_strategy_imports_no_module_the_process_has_not_imported(tmp_path, monkeypatch):
    import sys

    marker = tmp_path / "imported"
    (tmp_path / "user_module_with_side_effect.py").write_text(
        "import dataclasses, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('module code ran')\n"
        "class Block:\n    pass\n"
        "@dataclasses.dataclass\nclass Options:\n    x: int = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_module_with_side_effect", raising=False)

    def config(value):
        return json.dumps({"format": "atorch.strategy/1", "items": [{"name": "checkpoint", "config": value}]})

    as_class = config({"wrap_cls": {"__class__": "user_module_with_side_effect:Block"}})
    as_dataclass = config({"opts": {"__dataclass__": "user_module_with_side_effect:Options", "fields": {"x": 3}}})
    for text in (as_class, as_dataclass):
        with pytest.raises(ValueError, match=r"class 'user_module_with_side_effect:(Block|Options)' is in module "
                                             r"'user_module_with_side_effect', which is not imported; a strategy file "
                                             r"only imports modules of torch, transformers, atorch, peft, deepspeed "
                                             r".*import user_module_with_side_effect in your script"):
            Strategy.from_json(text)
    assert not marker.exists() and "user_module_with_side_effect" not in sys.modules
    # Once the user's script has imported it, its classes are found (nothing new runs).
    import user_module_with_side_effect

    assert Strategy.from_json(as_class)[0].config["wrap_cls"] is user_module_with_side_effect.Block
    assert Strategy.from_json(as_dataclass)[0].config["opts"] == user_module_with_side_effect.Options(3)
    # Trusted packages are imported as before, submodules included.
    text = config({"wrap_cls": {"__class__": "torch.nn.modules.linear:Linear"}})
    assert Strategy.from_json(text)[0].config["wrap_cls"] is torch.nn.Linear


def test_a_strategy_json_of_another_format_names_the_format_it_found():
    """Before, every such file got one message that named nothing it found."""
    items = [{"name": "fsdp"}]
    with pytest.raises(ValueError, match=r"strategy JSON has format 'atorch.strategy/2'; this atorch reads format "
                                         r"'atorch.strategy/1' .* needs converting"):
        Strategy.from_json(json.dumps({"format": "atorch.strategy/2", "items": items}))
    with pytest.raises(ValueError, match=r"strategy JSON has format 1; this atorch reads"):
        Strategy.from_json(json.dumps({"format": 1, "items": items}))
    with pytest.raises(ValueError, match=r"strategy JSON has no 'format' key; this atorch reads"):
        Strategy.from_json(json.dumps({"items": items}))
    with pytest.raises(ValueError, match=r"strategy JSON must be an object .*, got a str"):
        Strategy.from_json(json.dumps("fsdp"))
    assert Strategy.from_json(json.dumps({"format": "atorch.strategy/1", "items": items})).names() == ["fsdp"]


def test_the_last_global_batch_is_told_about_once_per_call_not_per_dry_run(caplog):
    """An automatic search builds a dataloader for every dry run: the drop_last warning came once per dry run
    (7 times in one search, an outside probe, session 30); once per auto_accelerate call now."""
    import torch

    from atorch.auto.engine import build_dataloader, new_call
    from atorch.auto.model_context import ModelContext
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    ctx = ModelContext(model=tiny_llama(), dataset=TokenDataset(n=10, seq_len=8), dataloader_args={"batch_size": 4})
    new_call()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            build_dataloader(ctx, 4)
        new_call()
        build_dataloader(ctx, 4)
    said = [r for r in caplog.records if "the last 2 are left out in each epoch" in r.getMessage()]
    assert len(said) == 2
