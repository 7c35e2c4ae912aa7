"""The pool's mark and sweep rules (trainstate._incremental.gc), one at a time, on a real run directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

import trainstate
from helpers import reseal_manifest
from trainstate._incremental.gc import PoolCollector
from trainstate._storage import LocalStorage


def _run(root: Path) -> list[str]:
    """Two checkpoints of different bases (nothing shared); returns step 1's pool files."""
    with trainstate.CheckpointManager(
        root, every_steps=1, fsync=False, capture_rng=False, incremental=True, collective=False
    ) as mgr:
        mgr.save(1, {"w": np.zeros(1000, np.float32)})
        mgr.save(2, {"w": np.ones(1000, np.float32)})
    return [f["path"] for f in json.loads((root / "step_00000001" / "manifest.json").read_bytes())["files"]]


def _collect(root: Path, *, locked: bool = True, mine: tuple[str, ...] = ()) -> list[str]:
    return PoolCollector(LocalStorage(), str(root)).collect(locked=locked, min_age=3600.0, mine=mine)


def test_a_leftover_that_a_sweep_may_put_back_keeps_its_files(tmp_path):
    files = _run(tmp_path)
    (tmp_path / "step_00000001").rename(tmp_path / ".step_00000001.old-0123456789ab")
    assert _collect(tmp_path) == []
    assert trainstate.load(tmp_path / "step_00000001")["w"].sum() == 0  # a reader puts it back, bytes intact
    shutil.rmtree(tmp_path / "step_00000001")
    assert _collect(tmp_path) == files  # nothing names them now


def test_a_copy_inside_the_run_directory_keeps_its_files(tmp_path):
    files = _run(tmp_path)
    shutil.copytree(tmp_path / "step_00000001", tmp_path / "keep-me")
    shutil.rmtree(tmp_path / "step_00000001")
    assert _collect(tmp_path) == []
    shutil.rmtree(tmp_path / "keep-me")
    assert _collect(tmp_path) == files


def test_an_unreadable_manifest_keeps_the_pool_files_its_bytes_name(tmp_path):
    files = _run(tmp_path)
    manifest = tmp_path / "step_00000002" / "manifest.json"
    mine = [f["path"] for f in json.loads(manifest.read_bytes())["files"]]
    shutil.rmtree(tmp_path / "step_00000001")
    manifest.write_bytes(b"\0" * 64 + json.dumps(mine[:1]).encode())  # damaged, but the name is still there
    assert sorted(_collect(tmp_path)) == sorted(files)  # step 1's go: one damaged manifest stops nothing
    assert [p.name for p in (tmp_path / "_shared").iterdir()] == mine[:1]
    shutil.rmtree(tmp_path / "step_00000002")
    assert _collect(tmp_path) == mine[:1]


def test_other_names_in_the_pool_are_left_alone(tmp_path):
    _run(tmp_path)
    (tmp_path / "_shared" / "notes.txt").write_text("mine")
    shutil.rmtree(tmp_path / "step_00000001")
    shutil.rmtree(tmp_path / "step_00000002")
    _collect(tmp_path)
    assert [p.name for p in (tmp_path / "_shared").iterdir()] == ["notes.txt"]


def test_without_a_lock_only_its_own_files_or_old_ones_go(tmp_path):
    files = _run(tmp_path)
    shutil.rmtree(tmp_path / "step_00000001")
    assert _collect(tmp_path, locked=False) == []  # young: another writer's save may be in flight
    assert _collect(tmp_path, locked=False, mine=(files[0],)) == [files[0]]


def test_a_manifest_replaced_within_the_same_second_is_read_again(tmp_path):
    # Object stores keep modification times to the second: an overwrite of a checkpoint then looks unchanged
    # by time and size. The collector must still see which pool files the new manifest names.
    files = _run(tmp_path)
    shutil.rmtree(tmp_path / "step_00000002")
    collector = PoolCollector(LocalStorage(), str(tmp_path))
    assert collector.collect(locked=True, min_age=3600.0) != []  # step 2's files go; step 1's are cached
    old = files[0]
    new = old.replace(old[5:17], "0123456789ab")  # a name of the same length: the same manifest size
    shutil.copy(tmp_path / "_shared" / old, tmp_path / "_shared" / new)
    manifest = tmp_path / "step_00000001" / "manifest.json"
    stamp, size = manifest.stat(), manifest.stat().st_size
    reseal_manifest(
        tmp_path / "step_00000001", lambda b: b.update(json.loads(json.dumps(b).replace(old, new))), layout=True
    )
    os.utime(manifest, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert manifest.stat().st_size == size and manifest.stat().st_mtime_ns == stamp.st_mtime_ns
    assert collector.collect(locked=True, min_age=3600.0) == [old]
    trainstate.load(tmp_path / "step_00000001")  # its bytes, now in the new file, are still there


def test_json_of_another_shape_stops_the_collection(tmp_path):
    """Valid JSON without the files this version reads may be a newer format's manifest, naming its pool
    files otherwise: nothing is deleted while it is there."""
    files = _run(tmp_path)
    shutil.rmtree(tmp_path / "step_00000001")
    (tmp_path / "step_00000002" / "manifest.json").write_text(json.dumps({"format_version": "9.0", "data": []}))
    assert _collect(tmp_path) == []
    shutil.rmtree(tmp_path / "step_00000002")
    assert set(files) < set(_collect(tmp_path))
