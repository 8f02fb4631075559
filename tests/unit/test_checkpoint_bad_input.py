"""Bad checkpoints are refused with the file and the problem named, before anything is loaded; pickled
payloads that would run code are refused even when the manifest was forged to match them."""

import hashlib
import json
import os
import pickle
import shutil
import warnings

import pytest
import torch

from atorch.checkpoint import (CheckpointError, attach_checkpoint_methods, load_checkpoint, merge_checkpoint,
                              save_checkpoint, verify_checkpoint)
from atorch.checkpoint import manifest as mf
from atorch.checkpoint.safe_load import load_dcp_metadata, safe_torch_load
from atorch.testing import tiny_gpt2, tiny_llama


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process checkpoint of a trained tiny Llama with its optimizer."""
    root = str(tmp_path_factory.mktemp("bad_input"))
    model = tiny_llama(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(4, 1000, (2, 8))
    model(x, labels=x).loss.backward()
    optim.step()
    return save_checkpoint(model, os.path.join(root, "step_1"), step=1, optimizer=optim)


def _copy(saved, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst


def _fresh():
    model = tiny_llama(seed=5)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _shard(ckpt):
    return sorted(n for n in os.listdir(os.path.join(ckpt, "dcp")) if n.endswith(".distcp"))[0]


def _forge_manifest(ckpt, rel):
    """What an attacker who can write the directory does: make the manifest match the edited file."""
    m = mf.Manifest.read(ckpt)
    path = os.path.join(ckpt, rel)
    m.files[rel] = mf.FileRecord(os.path.getsize(path), hashlib.sha256(open(path, "rb").read()).hexdigest())
    with open(os.path.join(ckpt, mf.MANIFEST_NAME), "w") as f:
        f.write(m.to_json())


def test_good_checkpoint_loads(saved):
    model, _ = _fresh()
    state = load_checkpoint(model, saved, load_optimizer=False)
    assert state.step == 1 and state.path == saved


def test_missing_shard(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    os.remove(os.path.join(ckpt, "dcp", _shard(ckpt)))
    model, before = _fresh()
    with pytest.raises(CheckpointError, match=rf"dcp/{_shard(saved)}: missing"):
        load_checkpoint(model, ckpt)
    assert _unchanged(model, before)


def test_checksum_mismatch(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    path = os.path.join(ckpt, "dcp", _shard(ckpt))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, before = _fresh()
    with pytest.raises(CheckpointError, match=rf"{_shard(saved)}: checksum mismatch"):
        load_checkpoint(model, ckpt)
    assert _unchanged(model, before)


def test_truncated_file(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    path = os.path.join(ckpt, "dcp", _shard(ckpt))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    model, before = _fresh()
    with pytest.raises(CheckpointError, match=rf"{_shard(saved)}: truncated: {size - 100} bytes, the manifest says "
                                              rf"{size}"):
        load_checkpoint(model, ckpt)
    assert _unchanged(model, before)


def test_checkpoint_of_a_different_model(saved):
    wider = tiny_llama(seed=0, hidden_size=128, intermediate_size=256)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"shape mismatches: .*model.embed_tokens.weight: model \(1024, 128\) "
                                              r"vs checkpoint \(1024, 64\)"):
        load_checkpoint(wider, saved, load_optimizer=False)
    assert _unchanged(wider, before)
    gpt2 = tiny_gpt2(seed=0)
    with pytest.raises(CheckpointError, match=r"28 model entries this model needs are not in the checkpoint, "
                                              r"e.g. \['transformer"):
        load_checkpoint(gpt2, saved, load_optimizer=False)
    shallower = tiny_llama(seed=0, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"the checkpoint has 9 model entries this model does not"):
        load_checkpoint(shallower, saved, load_optimizer=False)
    load_checkpoint(shallower, saved, load_optimizer=False, strict=False)  # the first layer is all it needs


def test_optimizer_requested_but_not_saved(tmp_path):
    model = tiny_llama(seed=0)
    ckpt = save_checkpoint(model, str(tmp_path / "weights_only"))
    optim = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="saved without optimizer state; pass load_optimizer=False"):
        load_checkpoint(model, ckpt, optimizer=optim)


def test_an_optimizer_over_another_models_parameters_is_refused_naming_the_fix(saved, tmp_path):
    """The model rebuilt after its optimizer was created: torch's state-dict code raised a bare `KeyError: 0`."""
    model, before = _fresh()
    stale = torch.optim.AdamW(tiny_llama(seed=5).parameters(), lr=1e-3)
    fix = r"build the optimizer from the model you {}, e.g. torch.optim.AdamW\(model.parameters\(\)\)"
    with pytest.raises(ValueError, match=r"^load_checkpoint: the optimizer holds 21 parameter\(s\) that are not the "
                       r"model's \(e.g. param_groups\[0\]\['params'\]\[0\], shape \[1024, 64\]\): it was built over "
                       r"another model's parameters .*" + fix.format("load into") + ", or pass load_optimizer=False"):
        load_checkpoint(model, saved, optimizer=stale)
    assert _unchanged(model, before)
    load_checkpoint(model, saved, optimizer=stale, load_optimizer=False)     # the optimizer is not touched
    with pytest.raises(ValueError, match=r"^save_checkpoint: the optimizer holds 21 parameter\(s\) .*"
                       + fix.format("save") + "$"):
        save_checkpoint(model, str(tmp_path / "step_1"), optimizer=stale)
    assert not os.path.exists(tmp_path / "step_1")
    # One foreign parameter among the model's own is enough (torch's KeyError named only its index).
    mixed = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) .*params'\]\[21\], shape \[3\]"):
        load_checkpoint(model, saved, optimizer=mixed)
    assert load_checkpoint(model, saved, optimizer=torch.optim.AdamW(model.parameters())).optimizer_restored


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tiny_llama(), str(tmp_path / "random"))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/atorch_ckpt_pwned",))


def test_pickled_code_in_dcp_metadata_is_refused_even_with_a_forged_manifest(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    marker = "/tmp/atorch_ckpt_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    with open(os.path.join(ckpt, "dcp", ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(), f)
    _forge_manifest(ckpt, "dcp/.metadata")
    model, before = _fresh()
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: the pickled metadata refers to "
                                              r"(posix|os)\.system"):
        load_checkpoint(model, ckpt)
    assert not os.path.exists(marker) and _unchanged(model, before)


def test_real_dcp_metadata_passes_the_restricted_unpickler(saved):
    from torch.distributed.checkpoint.metadata import Metadata

    assert isinstance(load_dcp_metadata(os.path.join(saved, "dcp", ".metadata")), Metadata)


def test_byte_entries_are_refused(tmp_path):
    """DCP would torch.load(weights_only=False) a non-tensor entry; atorch never writes one and refuses it."""
    import torch.distributed.checkpoint as dcp

    model = tiny_llama(seed=0)
    ckpt = save_checkpoint(model, str(tmp_path / "c"))
    # Replace the model tensors by a checkpoint where one "tensor" is a pickled object.
    shutil.rmtree(os.path.join(ckpt, "dcp"))
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    state["model/lm_head.weight"] = "not a tensor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(ckpt, "dcp")), no_dist=True)
    m = mf.Manifest.read(ckpt)
    m.files = {k: v for k, v in m.files.items() if not k.startswith("dcp/")}
    m.files.update({f"dcp/{n}": mf.FileRecord(0, "") for n in mf.list_files(os.path.join(ckpt, "dcp"))})
    with open(os.path.join(ckpt, mf.MANIFEST_NAME), "w") as f:
        f.write(m.to_json())
    for n in mf.list_files(os.path.join(ckpt, "dcp")):
        _forge_manifest(ckpt, f"dcp/{n}")
    # Refused before reading: the entry is not a tensor, so the model's lm_head.weight is "missing".
    with pytest.raises(CheckpointError, match=r"1 model entries this model needs are not in the checkpoint, e.g. "
                                              r"\['lm_head.weight'\]"):
        load_checkpoint(tiny_llama(seed=1), ckpt)
    # And the reader itself never unpickles it, even when asked for that entry.
    from atorch.checkpoint.save_load import _dcp_load

    with pytest.raises(CheckpointError, match="'model/lm_head.weight' is a pickled object, not a tensor; refused"):
        _dcp_load({"model/lm_head.weight": torch.empty(1024, 64)}, os.path.join(ckpt, "dcp"), mf.Manifest.read(ckpt))


def test_safe_torch_load_refuses_code_and_accepts_tensors(tmp_path):
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2)}, ok)
    assert torch.equal(safe_torch_load(str(ok))["w"], torch.ones(2))
    bad = tmp_path / "bad.pt"
    torch.save({"w": _RunsCode()}, bad)
    with pytest.raises(CheckpointError, match="bad.pt: refused to load"):
        safe_torch_load(str(bad))
    assert not os.path.exists("/tmp/atorch_ckpt_pwned")


def test_tampered_json_state_is_refused(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    meta_path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(meta_path))
    meta["step"] = 999
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="meta.json: checksum mismatch|meta.json: (truncated|larger)"):
        load_checkpoint(tiny_llama(), ckpt)


def _files(path):
    return {n: os.path.getsize(os.path.join(path, n)) for n in mf.list_files(path)}


def _still_loads(ckpt):
    verify_checkpoint(ckpt, collective=False)
    model, _ = _fresh()
    assert load_checkpoint(model, ckpt, load_optimizer=False).step == 1


def test_merge_refuses_to_write_into_a_checkpoint_or_a_checkpoint_root(saved, tmp_path):
    """A merge into a checkpoint used to add config.json and model.safetensors to it: verification then failed."""
    root = tmp_path / "root"
    root.mkdir()
    ckpt = shutil.copytree(saved, str(root / "step_1"))
    other = shutil.copytree(saved, str(root / "step_2"))
    (root / "link").symlink_to(root / "step_2")
    before = {p: _files(p) for p in (ckpt, other)}
    root_before = sorted(os.listdir(root))
    cases = [(ckpt, "is the checkpoint being merged"),
             (os.path.relpath(ckpt), "is the checkpoint being merged"),
             (other, "is a checkpoint \\(it holds manifest.json\\)"),
             (str(root / "link"), "is a checkpoint \\(it holds manifest.json\\)"),
             (os.path.join(ckpt, "hf"), "is inside the checkpoint .*step_1"),
             (os.path.join(other, "dcp"), "is inside the checkpoint .*step_2"),
             (str(root), "is a checkpoint root \\(it holds the checkpoints \\['link', 'step_1', 'step_2'\\]"),
             (str(tmp_path / "sharded"), None)]
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "latest").write_text("step_9\n")   # a root whose checkpoints are all gone
    for out, why in cases:
        why = why or "is a checkpoint root \\(it holds the 'latest' pointer\\)"
        with pytest.raises(ValueError, match=rf"out_dir=.* {why}.*; merging would write .* outside the checkpoints"):
            merge_checkpoint(ckpt, out)
    with pytest.raises(ValueError, match="is a checkpoint root"):
        merge_checkpoint(str(root), str(root))          # the root, resolved through its latest pointer
    for p, files in before.items():
        assert _files(p) == files
    assert sorted(os.listdir(root)) == root_before      # no staging directory either
    assert not os.path.exists(os.path.join(ckpt, "hf"))
    _still_loads(ckpt)
    _still_loads(other)
    # The refusal comes before the collective save of save_parallelized(merge_checkpoints=True) too.
    with pytest.raises(ValueError, match="^save_dir=.* is a checkpoint"):   # named as the caller named it
        attach_checkpoint_methods(tiny_llama()).save_parallelized(other, merge_checkpoints=True)
    assert _files(other) == before[other]
    # A new directory next to the checkpoints is fine.
    merge_checkpoint(ckpt, str(root / "hf"))
    assert os.path.isfile(root / "hf" / "model.safetensors")
    _still_loads(ckpt)


def test_cli_merge_into_a_checkpoint_exits_2_and_writes_nothing(saved, tmp_path):
    import subprocess
    import sys

    ckpt = _copy(saved, tmp_path)
    before = _files(ckpt)
    r = subprocess.run([sys.executable, "-m", "atorch.cli", "merge", saved, ckpt], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"out_dir={ckpt!r} is a checkpoint (it holds manifest.json)" in r.stderr
    assert _files(ckpt) == before
    _still_loads(ckpt)


@pytest.mark.parametrize("bad", [5, None, b"ckpt", ["ckpt"]])
def test_a_non_path_directory_argument_is_a_type_error_naming_it(saved, tmp_path, bad):
    kind = type(bad).__name__
    model = tiny_llama(seed=0)
    out = str(tmp_path / "out")
    calls = [("save_checkpoint", "path", lambda: save_checkpoint(model, bad)),
             ("load_checkpoint", "path", lambda: load_checkpoint(model, bad)),
             ("verify_checkpoint", "ckpt_dir", lambda: verify_checkpoint(bad)),
             ("merge_checkpoint", "ckpt_dir", lambda: merge_checkpoint(bad, out)),
             ("merge_checkpoint", "out_dir", lambda: merge_checkpoint(saved, bad))]
    attach_checkpoint_methods(model)
    calls += [("save_parallelized", "save_dir", lambda: model.save_parallelized(bad)),
              ("save_parallelized", "save_dir", lambda: model.save_parallelized(bad, merge_checkpoints=True)),
              ("from_parallelized", "load_dir", lambda: model.from_parallelized(bad))]
    for func, name, call in calls:
        with pytest.raises(TypeError, match=rf"^{func}: {name}=.* \({kind}\) must be a str or os.PathLike$"):
            call()
    assert not os.path.exists(out) and os.listdir(tmp_path) == []


def test_a_path_like_directory_argument_works(saved, tmp_path):
    import pathlib

    model, _ = _fresh()
    assert load_checkpoint(model, pathlib.Path(saved), load_optimizer=False).step == 1
    verify_checkpoint(pathlib.Path(saved), collective=False)
    out = merge_checkpoint(pathlib.Path(saved), tmp_path / "hf")
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_flags_must_be_bools_and_step_an_int(saved, tmp_path):
    """A string flag ("no") would count as True and a bool step as 1: refused, naming the argument and value,
    before anything is written or loaded."""
    model, before = _fresh()
    out = str(tmp_path / "out")
    for name in ("save_optimizer", "update_latest", "async_save"):
        with pytest.raises(TypeError, match=rf"^save_checkpoint: {name}='no' \(str\) must be True or False$"):
            save_checkpoint(model, out, step=1, **{name: "no"})
    for name in ("load_optimizer", "load_rng", "strict"):
        with pytest.raises(TypeError, match=rf"^load_checkpoint: {name}='no' \(str\) must be True or False$"):
            load_checkpoint(model, saved, **{name: "no"})
    with pytest.raises(TypeError, match=r"strict=0 \(int\)"):
        load_checkpoint(model, saved, strict=0)
    with pytest.raises(ValueError, match=r"^step=True must be a non-negative int"):
        save_checkpoint(model, out, step=True)
    assert _unchanged(model, before)
    assert os.listdir(tmp_path) == []


def test_save_inside_a_checkpoint_is_refused(saved, tmp_path):
    """A save into a directory inside a committed checkpoint would put a checkpoint and a `latest` pointer among
    its files (and it would fail verification): refused before anything is written, as merge refuses it."""
    ckpt = _copy(saved, tmp_path)
    before = _files(ckpt)
    model = tiny_llama(seed=0)
    for inner in (os.path.join(ckpt, "inner"), os.path.join(ckpt, "dcp", "a", "b")):
        with pytest.raises(ValueError, match=rf"^path='{inner}' is inside the checkpoint {ckpt} \(it holds "
                                             r"manifest.json\); .* Save next to it instead"):
            save_checkpoint(model, inner, step=1)
    assert _files(ckpt) == before
    _still_loads(ckpt)
    # Next to it is fine.
    save_checkpoint(model, os.path.join(tmp_path, "step_2"), step=2)
    assert mf.is_checkpoint(os.path.join(tmp_path, "step_2"))
