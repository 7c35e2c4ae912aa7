"""The v1.3 zstd fixture pins compressed checkpoints: it must keep loading, exactly, in every later version.

Regenerate it with ``python tests/format/test_zstd_fixture.py`` (only when the format changes on purpose).
zstd's output may differ between library versions, so a fresh save is compared with the fixture by layout
(boxes, which chunks are compressed, header names), not byte for byte; the fixture's own bytes are pinned by
its checksums and by loading it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import trainstate
from helpers import assert_same

pytest.importorskip("zstandard")

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.3-zstd" / "basic"


def zstd_state() -> dict:
    """The state saved into the fixture: a tensor of two compressed chunks, chunks that do not pay, 0-d and empty."""
    return {
        "model": {
            "w": (np.arange(1100 * 1000) % 7).astype(np.float32).reshape(1100, 1000),  # 4.4 MB: two chunks
            "b": np.arange(32).astype(ml_dtypes.bfloat16),  # 64 bytes: too small to pay
        },
        "noise": np.frombuffer(hashlib.shake_256(b"trainstate").digest(4096), dtype=np.uint8),  # does not pay
        "zeros": np.zeros((64, 64), dtype=np.float64),
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 4), dtype=np.int16),
        "step": 10,
    }


def test_the_fixture_loads_exactly():
    assert_same(trainstate.load(FIXTURE), zstd_state())
    with trainstate.open(FIXTURE) as ck:
        ck.verify()
        assert ck.manifest.format_version == "1.3"
        w = ck.manifest.tensors["model.w"]
        assert [c.shape for c in w.chunks] == [(1048, 1000), (52, 1000)]
        assert all(c.transforms[0]["name"] == "zstd" and "raw_checksum" in c.transforms[0] for c in w.chunks)
        assert not ck.manifest.tensors["noise"].chunks[0].transforms


def test_a_fresh_save_has_the_fixtures_layout(tmp_path):
    trainstate.save(tmp_path / "c", zstd_state(), metadata={"run": "zstd"}, threads=2, compression="zstd")
    fresh, fixed = (json.loads((p / "manifest.json").read_bytes()) for p in (tmp_path / "c", FIXTURE))
    assert fresh["format_version"] == fixed["format_version"] == "1.3"

    def layout(m: dict) -> dict:
        return {
            n: [(c["file"], c["offset"], c["shape"], [x["name"] for x in c.get("transforms", [])]) for c in t["chunks"]]
            for n, t in m["tensors"].items()
        }

    assert layout(fresh) == layout(fixed)
    assert fresh["tree"] == fixed["tree"] and fresh["metadata"] == fixed["metadata"]
    for f in fixed["files"]:
        assert list(_header(tmp_path / "c" / f["path"])) == list(_header(FIXTURE / f["path"]))


def test_safetensors_opens_the_fixtures_data_files():
    from safetensors import safe_open

    for f in sorted(FIXTURE.glob("*.safetensors")):
        with safe_open(f, "np") as st:
            names = set(st.keys())
            for name in names:
                st.get_tensor(name)
        assert names == {k for k in _header(f) if k != "__metadata__"}
    with safe_open(next(p for p in FIXTURE.glob("*.safetensors") if "model.w#0" in _header(p)), "np") as st:
        assert st.get_tensor("model.w#0").dtype == np.uint8  # compressed bytes, listed as U8


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


def write_fixture() -> None:
    import shutil

    shutil.rmtree(FIXTURE, ignore_errors=True)
    trainstate.save(FIXTURE, zstd_state(), metadata={"run": "zstd"}, threads=2, compression="zstd")


if __name__ == "__main__":
    write_fixture()
    sys.exit(0)
