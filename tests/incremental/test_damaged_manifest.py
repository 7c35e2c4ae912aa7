"""One damaged manifest in an incremental run does not keep the shared pool from being collected.

A checkpoint whose manifest cannot be read was left out of retention altogether, so it was never deleted;
and while it was there the pool's collection deleted nothing (it could not tell what the manifest names),
so every later save's pool files stayed: the pool grew without bound. A damaged checkpoint is now aged out
by retention like the others, and while it is kept only what its bytes may name is kept for it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import trainstate


def state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(4096, step, np.float32)}  # changes every save: each save writes a pool file


def manager(root: Path, **kw: object) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(root, every_steps=1, incremental=True, capture_rng=False, keep_last=2, **kw)


def damage(manifest: Path, how: str) -> None:
    raw = manifest.read_bytes()
    if how == "garbage":  # not JSON any more: it could name anything
        manifest.write_bytes(b"\0" * 64)
    elif how == "truncated":
        manifest.write_bytes(raw[: len(raw) // 2])
    else:  # still JSON, fails its checksum
        at = raw.index(b'"checksum":"xxh3_64:') + len(b'"checksum":"xxh3_64:')
        manifest.write_bytes(raw[:at] + (b"0" if raw[at : at + 1] != b"0" else b"1") + raw[at + 1 :])


def pool(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "_shared").iterdir()}


def named(root: Path, step: int) -> set[str]:
    body = json.loads((root / f"step_{step:08d}" / "manifest.json").read_bytes())
    return {f["path"] for f in body["files"] if f.get("pool")}


@pytest.mark.parametrize("how", ["garbage", "truncated", "checksum"])
def test_a_damaged_manifest_ages_out_and_the_pool_stays_bounded(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    sizes = []
    with manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        damage(tmp_path / "step_00000002" / "manifest.json", how)
        with caplog.at_level(logging.WARNING, "trainstate"):
            for step in range(4, 13):
                mgr.save(step, state(step))
                sizes.append(pool(tmp_path))
        deleted = [name for r in mgr.history() for name in r.deleted]
    assert not (tmp_path / "step_00000002").exists()
    assert "step_00000002" in deleted
    assert any("step_00000002" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000011",
        "step_00000012",
    ]
    assert set(sizes[-1]) == named(tmp_path, 11) | named(tmp_path, 12)  # nothing else is kept
    assert [len(s) for s in sizes[-5:]] == [2] * 5  # the pool stopped growing
    for step in (11, 12):
        assert trainstate.load(tmp_path / f"step_{step:08d}")["w"][0] == step


def test_a_pinned_damaged_manifest_keeps_only_what_it_may_name(tmp_path: Path) -> None:
    """A pin keeps a damaged checkpoint (the user asked for it), and with it every pool file whose name is
    in its bytes; the other pool files are collected as they fall out."""
    with manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.pin(2, "look at it later")
        kept = named(tmp_path, 2)
        damage(tmp_path / "step_00000002" / "manifest.json", "truncated")
        for step in range(4, 10):
            mgr.save(step, state(step))
        assert mgr.last_retention is not None
        assert mgr.last_retention.keep["step_00000002"] == ["pinned", "damaged manifest"]  # what is kept, and why
    assert (tmp_path / "step_00000002" / "pinned.json").exists()
    truncated = (tmp_path / "step_00000002" / "manifest.json").read_bytes()
    assert set(pool(tmp_path)) == named(tmp_path, 8) | named(tmp_path, 9) | {n for n in kept if n.encode() in truncated}


@pytest.mark.parametrize("field", [b'"files"', b'"pool"'])
def test_a_pinned_manifest_flipped_into_json_of_another_shape_does_not_stop_collection(
    tmp_path: Path, field: bytes
) -> None:
    """A bit flip can leave a manifest JSON of another shape ("files" -> "fines"): that fails its checksum,
    so it is damage, not a newer format the collector cannot read; the pool is collected around it (it
    stopped collecting altogether, and with a pin keeping that checkpoint the pool grew with every save)."""
    with manager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
        mgr.pin(1, "best")
    kept = named(tmp_path, 1)
    path = tmp_path / "step_00000001" / "manifest.json"
    raw = path.read_bytes()
    at = raw.index(field) + 3
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x02]) + raw[at + 1 :])  # one bit: still JSON
    with manager(tmp_path) as mgr:  # a new process: nothing remembered of the manifest before the flip
        for step in range(3, 12):
            mgr.save(step, state(step))
    assert set(pool(tmp_path)) == kept | named(tmp_path, 10) | named(tmp_path, 11)
