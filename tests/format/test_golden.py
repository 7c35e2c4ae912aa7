"""Golden bytes pin the format: the data-file layout, the manifest, and the v1.0 fixture that must keep loading."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

import trainstate
from helpers import assert_same

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.0" / "basic"


def golden_state() -> dict:
    """The state saved into the v1.0 fixture (regenerate it with: python tests/format/test_golden.py)."""
    return {
        "weights": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.array([1, 2], dtype=ml_dtypes.bfloat16),
        },
        "optim": {
            "state": {0: {"step": np.float32(3.0), "m": np.full((2, 2), -0.5, dtype=np.float64)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "step": 1200,
        "flags": [True, False],
        "name": "exp1",
        "nan": float("nan"),
        "blob": b"\x00\xff",
        "empty": np.zeros((0, 3), dtype=np.int8),
        "scalar0d": np.array(7, dtype=np.uint8),
    }


def test_data_file_bytes_are_exactly_safetensors(tmp_path):
    trainstate.save(tmp_path / "c", {"x": np.array([1, 2], dtype=np.int32)}, threads=1)
    raw = (tmp_path / "c" / "data-00000.safetensors").read_bytes()
    header = b'{"__metadata__":{"format":"trainstate"},"x":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}'
    header += b" " * (-(len(header) + 8) % 8)
    assert raw == struct.pack("<Q", len(header)) + header + b"\x01\x00\x00\x00\x02\x00\x00\x00"


def _comparable(manifest_bytes: bytes) -> dict:
    body = json.loads(manifest_bytes)
    for volatile in ("created", "writer", "checksum"):
        body.pop(volatile)
    return body


def test_fresh_save_matches_the_v1_fixture_byte_for_byte(tmp_path):
    trainstate.save(tmp_path / "c", golden_state(), metadata={"run": "golden"}, threads=2)
    fixture_files = sorted(p.name for p in FIXTURE.iterdir())
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == fixture_files
    for name in fixture_files:
        if name.endswith(".safetensors"):
            assert (tmp_path / "c" / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    assert _comparable((tmp_path / "c" / "manifest.json").read_bytes()) == _comparable(
        (FIXTURE / "manifest.json").read_bytes()
    )


def test_manifest_is_canonical_json(tmp_path):
    raw = (FIXTURE / "manifest.json").read_bytes()
    body = json.loads(raw)
    assert raw == json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
    assert body["format"] == "trainstate" and body["format_version"] == "1.0"


def test_v1_fixture_still_loads():
    assert_same(golden_state(), trainstate.load(FIXTURE))
    with trainstate.open(FIXTURE) as ck:
        ck.verify()
        assert ck.metadata == {"run": "golden"}


if __name__ == "__main__":
    import shutil

    shutil.rmtree(FIXTURE, ignore_errors=True)
    trainstate.save(FIXTURE, golden_state(), metadata={"run": "golden"}, threads=2)
    print("wrote", FIXTURE)
