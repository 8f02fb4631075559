"""The crash-safe directory protocol: manifest, verification, atomic commit, `latest`, rotation."""

import os

import pytest

from atorch.checkpoint import manifest as mf
from atorch.checkpoint.manifest import CheckpointError, Manifest


def _write(root, name, data: bytes):
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _make_checkpoint(parent, name, step, files=None):
    """A committed checkpoint directory through the real staging -> commit path."""
    final = os.path.join(parent, name)
    staging = mf.staging_dir(final, "t" + name)
    os.makedirs(staging)
    for rel, data in (files or {"a.bin": b"abc", "sub/b.bin": b"0123456789"}).items():
        _write(staging, rel, data)
    mf.commit(staging, final, Manifest(files=mf.record_files(staging, mf.list_files(staging)), step=step))
    return final


def test_manifest_round_trip_and_verification(tmp_path):
    ckpt = _make_checkpoint(str(tmp_path), "step_1", 1)
    m = Manifest.read(ckpt)
    assert m.step == 1 and sorted(m.files) == ["a.bin", "sub/b.bin"]
    assert m.files["sub/b.bin"].size == 10
    assert mf.verify_files(ckpt, m, sorted(m.files)) == []

    _write(ckpt, "a.bin", b"abd")  # same size, different bytes
    with open(os.path.join(ckpt, "sub/b.bin"), "r+b") as f:
        f.truncate(4)
    problems = mf.verify_files(ckpt, m, sorted(m.files))
    assert any("a.bin: checksum mismatch" in p for p in problems)
    assert any("b.bin: truncated: 4 bytes, the manifest says 10" in p for p in problems)
    os.remove(os.path.join(ckpt, "a.bin"))
    assert any("a.bin: missing" in p for p in mf.verify_files(ckpt, m, ["a.bin"]))
    with pytest.raises(CheckpointError, match="failed verification, nothing was loaded"):
        mf.raise_problems(ckpt, mf.verify_files(ckpt, m, sorted(m.files)))


def test_manifest_refuses_paths_outside_the_checkpoint_and_foreign_files(tmp_path):
    ckpt = str(tmp_path / "c")
    os.makedirs(ckpt)
    _write(ckpt, mf.MANIFEST_NAME, b'{"format": "atorch-checkpoint", "version": 1, "files": '
                                   b'{"../../etc/passwd": {"size": 1, "sha256": "x"}}}')
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        Manifest.read(ckpt)
    _write(ckpt, mf.MANIFEST_NAME, b'{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="not an atorch checkpoint"):
        Manifest.read(ckpt)
    _write(ckpt, mf.MANIFEST_NAME, b'{not json')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Manifest.read(ckpt)


def test_commit_publishes_only_complete_directories_and_replaces_an_old_one(tmp_path):
    parent = str(tmp_path)
    final = os.path.join(parent, "step_5")
    staging = mf.staging_dir(final, "x")
    os.makedirs(staging)
    _write(staging, "data.bin", b"new")
    # Before the commit the final name does not exist and the staging dir is not a checkpoint.
    assert not os.path.exists(final)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        mf.resolve_checkpoint_dir(staging)
    mf.commit(staging, final, Manifest(files=mf.record_files(staging, ["data.bin"]), step=5))
    assert mf.is_checkpoint(final) and not os.path.exists(staging)

    # Saving the same name again swaps the directory whole.
    staging2 = mf.staging_dir(final, "y")
    os.makedirs(staging2)
    _write(staging2, "other.bin", b"newer")
    mf.commit(staging2, final, Manifest(files=mf.record_files(staging2, ["other.bin"]), step=5))
    assert sorted(os.listdir(final)) == [mf.MANIFEST_NAME, "other.bin"]
    assert [e for e in os.listdir(parent)] == ["step_5"]


def test_latest_pointer_resolution_and_errors(tmp_path):
    parent = str(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        mf.resolve_checkpoint_dir(parent)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        mf.resolve_checkpoint_dir(os.path.join(parent, "nope"))
    a = _make_checkpoint(parent, "step_1", 1)
    mf.write_latest(parent, "step_1")
    assert mf.resolve_checkpoint_dir(parent) == a
    assert mf.resolve_checkpoint_dir(a) == a
    mf.write_latest(parent, "step_9")
    with pytest.raises(CheckpointError, match="names 'step_9', which is not a complete checkpoint"):
        mf.resolve_checkpoint_dir(parent)
    _write(parent, "file.txt", b"x")
    with pytest.raises(CheckpointError, match="not a directory"):
        mf.resolve_checkpoint_dir(os.path.join(parent, "file.txt"))


def test_a_checkpoint_name_resolved_by_one_process_is_found_under_another_spelling_of_the_path(tmp_path):
    """load_checkpoint's ranks share rank 0's reading of `latest` as a name relative to the path."""
    parent = str(tmp_path / "ckpt")
    a = _make_checkpoint(parent, "step_1", 1)
    mf.write_latest(parent, "step_1")
    assert mf.checkpoint_name(parent) == "step_1" and mf.checkpoint_name(a + "/") == "."
    other_mount = str(tmp_path / "mnt")
    os.symlink(parent, other_mount)                # another node's mount point of the same directory
    assert mf.checkpoint_at(other_mount, "step_1") == os.path.join(other_mount, "step_1")
    assert mf.checkpoint_at(a, ".") == a
    with pytest.raises(CheckpointError, match="resolved to 'step_2' on rank 0, which is not a complete checkpoint "
                                              "here .*no such checkpoint directory"):
        mf.checkpoint_at(parent, "step_2")
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        mf.checkpoint_at(parent, "../elsewhere")


def test_rotation_keeps_the_newest_and_never_latest_or_foreign_dirs(tmp_path):
    parent = str(tmp_path)
    for step in (1, 2, 3, 4):
        _make_checkpoint(parent, f"step_{step}", step)
    os.makedirs(os.path.join(parent, "user_data"))  # not a checkpoint: never touched
    mf.write_latest(parent, "step_1")               # an old one marked latest is protected
    removed = mf.rotate(parent, keep_last=2, protect=[os.path.join(parent, "step_4")])
    assert sorted(os.path.basename(p) for p in removed) == ["step_2"]
    assert sorted(os.listdir(parent)) == ["latest", "step_1", "step_3", "step_4", "user_data"]
    with pytest.raises(ValueError, match="keep_last=0"):
        mf.rotate(parent, keep_last=0)


def test_rotation_after_a_restart_from_an_earlier_step_keeps_the_most_recently_saved(tmp_path):
    """A run restarted from step_5 saves lower steps than the abandoned run's step_10/11: keep_last counts
    commits, so the restarted run's own checkpoints stay and the abandoned ones go."""
    parent = str(tmp_path)
    for step in (8, 9, 10, 11):
        _make_checkpoint(parent, f"step_{step}", step)
    for step in (5, 6):                               # the restarted run
        path = _make_checkpoint(parent, f"step_{step}", step)
        mf.write_latest(parent, f"step_{step}")
        mf.rotate(parent, keep_last=2, protect=[path])
    assert sorted(os.listdir(parent)) == ["latest", "step_5", "step_6"]


def test_stale_staging_dirs_of_the_same_name_are_removed(tmp_path):
    parent = str(tmp_path)
    final = os.path.join(parent, "step_7")
    for token in ("a", "b"):
        os.makedirs(mf.staging_dir(final, token))
    os.makedirs(mf.staging_dir(os.path.join(parent, "step_70"), "c"))  # another name: kept
    removed = mf.remove_stale_staging(final)
    assert len(removed) == 2
    assert os.listdir(parent) == [os.path.basename(mf.staging_dir(os.path.join(parent, "step_70"), "c"))]
    assert mf.list_checkpoints(parent) == []


@pytest.mark.parametrize("algorithm", mf.CHECKSUMS)
def test_each_checksum_records_its_algorithm_and_detects_a_flipped_byte(tmp_path, algorithm):
    final = str(tmp_path / "step_1")
    staging = mf.staging_dir(final, "t")
    _write(staging, "a.bin", bytes(range(256)) * 64)
    mf.commit(staging, final, Manifest(files=mf.record_files(staging, ["a.bin"], algorithm), step=1))
    m = Manifest.read(final)
    assert m.files["a.bin"].algorithm == algorithm and m.version == mf.FORMAT_VERSION
    assert m.files["a.bin"].digest == mf.checksum_file(os.path.join(final, "a.bin"), algorithm)
    assert mf.verify_files(final, m, ["a.bin"]) == []
    with open(os.path.join(final, "a.bin"), "r+b") as f:
        f.seek(1000)
        f.write(b"\xff")
    assert any(f"checksum mismatch: {algorithm}" in p for p in mf.verify_files(final, m, ["a.bin"]))


def test_version_1_sha256_manifest_still_verifies(tmp_path):
    import hashlib
    import json

    ckpt = str(tmp_path / "old")
    _write(ckpt, "a.bin", b"abc")
    _write(ckpt, mf.MANIFEST_NAME, json.dumps({"format": "atorch-checkpoint", "version": 1, "step": 3, "files": {
        "a.bin": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}}).encode())
    m = Manifest.read(ckpt)
    assert m.files["a.bin"].algorithm == "sha256" and m.files["a.bin"].sha256 == hashlib.sha256(b"abc").hexdigest()
    assert mf.verify_files(ckpt, m, ["a.bin"]) == []
    _write(ckpt, "a.bin", b"abd")
    assert any("checksum mismatch: sha256" in p for p in mf.verify_files(ckpt, m, ["a.bin"]))


def test_unknown_checksum_is_refused_with_the_valid_values(tmp_path):
    with pytest.raises(ValueError, match=r"checksum='md5'; valid values are \['xxh3_128', 'sha256'\]"):
        mf.record_files(str(tmp_path), [], "md5")
    ckpt = str(tmp_path / "c")
    _write(ckpt, mf.MANIFEST_NAME, b'{"format": "atorch-checkpoint", "version": 2, "files": '
                                   b'{"a.bin": {"size": 1, "md5": "x"}}}')
    with pytest.raises(CheckpointError, match="one checksum"):
        Manifest.read(ckpt)
