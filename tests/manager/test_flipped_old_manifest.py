"""A bit flip in an old checkpoint's manifest that makes it claim a newer format is damage, not a newer
writer: the run keeps going from its intact newer checkpoints (only a checksum-verified manifest is
believed when it says it is newer)."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest


def _run(tmp_path):
    with trainstate.CheckpointManager(tmp_path, keep_last=5) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(4, step, dtype=np.float32)}, force=True)


def _flip_version(path):
    manifest = path / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    at = raw.index(b'"format_version":"') + len(b'"format_version":"')
    raw[at] ^= 0x02  # "1.x" -> "3.x": one bit
    assert chr(raw[at]) == "3"
    manifest.write_bytes(bytes(raw))


def test_a_flipped_format_version_is_damage(tmp_path):
    trainstate.save(tmp_path / "c", {"x": np.arange(3)})
    _flip_version(tmp_path / "c")
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum"):
        trainstate.load(tmp_path / "c")


def test_a_newer_format_version_with_its_checksum_is_still_newer(tmp_path):
    trainstate.save(tmp_path / "c", {"x": np.arange(3)})
    reseal_manifest(tmp_path / "c", lambda b: b.update(format_version="3.0"))
    with pytest.raises(trainstate.FormatVersionError):
        trainstate.load(tmp_path / "c")


def test_an_old_checkpoint_flipped_to_look_newer_does_not_stop_the_run(tmp_path):
    _run(tmp_path)
    _flip_version(tmp_path / "step_00000001")
    with trainstate.CheckpointManager(tmp_path, keep_last=2) as mgr:  # opens beside it (read-write)
        state = {"x": np.zeros(4, dtype=np.float32)}
        assert mgr.restore_latest(state) == 4 and state["x"][0] == 3
        assert [c.step for c in mgr.list()] == [2, 3]
        mgr.save(4, {"x": np.full(4, 4, dtype=np.float32)}, force=True)  # retention runs beside the damage
        assert [c.step for c in mgr.list()] == [3, 4]
    with trainstate.CheckpointManager(tmp_path, read_only=True) as reader:
        state = {"x": np.zeros(4, dtype=np.float32)}
        assert reader.restore_latest(state) == 5 and state["x"][0] == 4


def test_restore_latest_skips_an_old_flipped_manifest_when_the_newer_ones_are_damaged_too(tmp_path):
    _run(tmp_path)
    _flip_version(tmp_path / "step_00000001")
    for name in ("step_00000002", "step_00000003"):
        (tmp_path / name / "manifest.json").write_bytes(b"{garbage")
    with trainstate.CheckpointManager(tmp_path, read_only=True) as reader:
        with pytest.raises(trainstate.CorruptCheckpointError, match="none of the 3"):
            reader.restore_latest({"x": np.zeros(4, dtype=np.float32)})


def test_a_flipped_transform_name_is_damage_not_an_unknown_transform(tmp_path):
    pytest.importorskip("zstandard")
    trainstate.save(tmp_path / "c", {"x": np.zeros(1 << 16, dtype=np.float32)}, compression="zstd")
    manifest = tmp_path / "c" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    at = raw.index(b'"name":"zstd"') + len(b'"name":"z')
    raw[at] ^= 0x01  # "zstd" -> "zrtd": a name this trainstate does not know
    manifest.write_bytes(bytes(raw))
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum"):
        trainstate.load(tmp_path / "c")
