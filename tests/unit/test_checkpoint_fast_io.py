"""The checksums of the data files are taken while DCP writes them (the save never reads its data back),
and the load copies every tensor once from a memory-mapped file, falling back to DCP's reader when it must."""

import io
import os

import pytest
import torch
from torch import nn

from atorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from atorch.checkpoint import manifest as mf
from atorch.checkpoint import safe_load
from atorch.checkpoint.hashing_writer import _HashingStream


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_save_checksums_data_files_without_reading_them(tmp_path, monkeypatch, checksum):
    model, optim = _trained()
    hashed = []
    real = mf.checksum_file

    def spy(path, algorithm=mf.DEFAULT_CHECKSUM):
        hashed.append(os.path.basename(path))
        return real(path, algorithm)

    monkeypatch.setattr(mf, "checksum_file", spy)
    out = save_checkpoint(model, str(tmp_path / "step_1"), step=1, optimizer=optim, checksum=checksum)
    monkeypatch.setattr(mf, "checksum_file", real)
    assert not [n for n in hashed if n.endswith(".distcp")], hashed  # only the small files were read back
    manifest = mf.Manifest.read(out)
    data = [n for n in manifest.files if n.endswith(".distcp")]
    assert data
    for name in data:  # the checksum taken on the way equals one of the file as it is on disk
        record = manifest.files[name]
        path = os.path.join(out, name)
        assert record.algorithm == checksum
        assert record.size == os.path.getsize(path) and record.digest == real(path, checksum)


def test_hashing_stream_refuses_to_seek_back():
    raw = io.BytesIO()
    stream = _HashingStream(raw, "xxh3_128")
    stream.write(b"abc")
    assert stream.tell() == 3 and stream.seek(0, 1) == 3
    with pytest.raises(io.UnsupportedOperation):
        stream.seek(0)
    expected = mf.new_hasher("xxh3_128")
    expected.update(b"abc")
    assert raw.getvalue() == b"abc" and stream.hexdigest() == expected.hexdigest()


@pytest.mark.parametrize("mapped", [True, False])
def test_load_mapped_or_through_dcp_restores_the_same_state(tmp_path, monkeypatch, mapped):
    model, optim = _trained()
    out = save_checkpoint(model, str(tmp_path / "step_1"), step=1, optimizer=optim)
    calls = {"dcp": 0}
    real_read = safe_load.FileSystemReader.read_data

    def counting(self, plan, planner):
        calls["dcp"] += 1
        return real_read(self, plan, planner)

    monkeypatch.setattr(safe_load.FileSystemReader, "read_data", counting)
    monkeypatch.setattr(safe_load, "_MAPPED_LOAD_OK", mapped)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = load_checkpoint(fresh, out, optimizer=fresh_optim)
    assert state.optimizer_restored and calls["dcp"] == (0 if mapped else 1)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    saved, loaded = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    for i in saved:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[i][k], loaded[i][k])


def test_load_still_refuses_a_corrupted_data_file(tmp_path):
    model, optim = _trained()
    out = save_checkpoint(model, str(tmp_path / "step_1"), step=1, optimizer=optim)
    data = [n for n in mf.list_files(out) if n.endswith(".distcp")][0]
    path = os.path.join(out, data)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(fresh, out)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def _zip_crc32_fields(data: bytes):
    """CRC32 of every zip central-directory entry in `data` (a DCP data file is a run of torch.save archives)."""
    import struct

    crcs, at = [], data.find(b"PK\x01\x02")
    while at != -1:
        crcs.append(struct.unpack_from("<I", data, at + 16)[0])
        at = data.find(b"PK\x01\x02", at + 4)
    return crcs


def test_data_files_skip_torch_save_crc32_and_still_load(tmp_path):
    """The xxh3 checksum taken while writing replaces torch.save's CRC32 pass inside the data files."""
    model, optim = _trained()
    out = save_checkpoint(model, str(tmp_path / "step_1"), step=1, optimizer=optim)
    data = [n for n in mf.Manifest.read(out).files if n.endswith(".distcp")]
    with open(os.path.join(out, data[0]), "rb") as f:
        crcs = _zip_crc32_fields(f.read())
    assert crcs and set(crcs) == {0}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(model, out, optimizer=optim)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # torch.save elsewhere in this thread still writes CRC32s (torch's own setting).
    buf = io.BytesIO()
    torch.save(torch.arange(8.0), buf)
    assert torch.serialization.get_crc32_options() is True
    assert 0 not in _zip_crc32_fields(buf.getvalue())


def test_crc32_is_off_only_in_the_thread_writing_a_data_file(tmp_path):
    import threading

    from atorch.checkpoint.hashing_writer import _HashingFileSystem

    fs = _HashingFileSystem("xxh3_128")
    seen = {}

    def other_thread():
        seen["other"] = torch.serialization.get_crc32_options()

    with fs.create_stream(str(tmp_path / "__0_0.distcp"), "wb"):
        seen["writer"] = torch.serialization.get_crc32_options()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    with fs.create_stream(str(tmp_path / ".metadata"), "wb"):
        seen["small file"] = torch.serialization.get_crc32_options()
    seen["after"] = torch.serialization.get_crc32_options()
    assert seen == {"writer": False, "other": True, "small file": True, "after": True}
    torch.serialization.set_crc32_options(False)  # a user's own setting is still obeyed outside
    try:
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)
