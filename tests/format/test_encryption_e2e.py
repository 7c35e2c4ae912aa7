"""End to end through the public API: tensor bytes on disk are ciphertext, every reader decrypts, a chunk
moved between tensors is caught by the AES-GCM tag even with checksums off, one tensor still reads alone,
and the v1.3 fixture loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from make_encrypted_fixture import FIXTURE, TEST_KEY, fixture_state
from test_encrypted_fixture import _spec_read

import trainstate
from helpers import assert_same

KEY = TEST_KEY.hex()
PATTERN = np.frombuffer(b"TRAINSTATE-PLAINTEXT-MARKER-0123" * 512, dtype=np.uint8)  # 16 KiB, easy to find


def test_the_v1_3_fixture_loads_and_verifies() -> None:
    assert_same(fixture_state(), trainstate.load(FIXTURE, key=TEST_KEY))
    with trainstate.open(FIXTURE, key=TEST_KEY) as ck:
        ck.verify()
        assert ck.info("model.w").shape == (3, 4)
        np.testing.assert_array_equal(ck.read("model.w"), fixture_state()["model"]["w"])


def test_tensor_bytes_on_disk_are_ciphertext_and_no_plaintext_checksum_is_written(tmp_path: Path) -> None:
    state = {"marker": PATTERN.copy(), "w": np.arange(1000, dtype=np.float32)}
    trainstate.save(tmp_path / "c", state, key=KEY)
    for f in (tmp_path / "c").glob("*.safetensors"):
        assert b"TRAINSTATE-PLAINTEXT-MARKER" not in f.read_bytes()
    body = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    for t in body["tensors"].values():
        for chunk in t["chunks"]:
            assert chunk["transforms"][-1]["name"] == "aes-256-gcm"  # encryption last
            for params in chunk["transforms"]:
                assert "checksum" not in json.dumps(params)  # no xxh3 of plaintext anywhere (contract §2)
    assert_same(state, trainstate.load(tmp_path / "c", key=KEY))
    found = _spec_read(tmp_path / "c")  # a reader written from docs/format.md alone decrypts trainstate's save
    np.testing.assert_array_equal(found["marker"], PATTERN)


def test_encryption_with_compression_round_trips(tmp_path: Path) -> None:
    state = {"z": np.zeros(1 << 20, dtype=np.float32), "marker": PATTERN.copy()}
    trainstate.save(tmp_path / "c", state, key=KEY, compression="zstd")
    body = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    names = [[x["name"] for x in c["transforms"]] for t in body["tensors"].values() for c in t["chunks"]]
    assert ["zstd", "aes-256-gcm"] in names  # compression first, then encryption
    assert_same(state, trainstate.load(tmp_path / "c", key=KEY))


def _swap_stored_bytes(ckpt: Path, a: str, b: str) -> None:
    """Swap two same-sized tensors' stored bytes in place: what someone without the key can do."""
    body = json.loads((ckpt / "manifest.json").read_bytes())
    (ca,), (cb,) = body["tensors"][a]["chunks"], body["tensors"][b]["chunks"]
    fa, fb = ckpt / ca["file"], ckpt / cb["file"]
    ra, rb = fa.read_bytes()[slice(*ca["byte_range"])], fb.read_bytes()[slice(*cb["byte_range"])]
    assert len(ra) == len(rb)
    for f, rng, data in ((fa, ca["byte_range"], rb), (fb, cb["byte_range"], ra)):
        raw = bytearray(f.read_bytes())
        raw[rng[0] : rng[1]] = data
        f.write_bytes(bytes(raw))


def test_chunks_swapped_between_tensors_are_detected_even_without_checksums(tmp_path: Path) -> None:
    state = {"a": np.arange(64, dtype=np.float32), "b": np.arange(64, dtype=np.float32)[::-1].copy()}
    trainstate.save(tmp_path / "c", state, key=KEY, threads=1)
    _swap_stored_bytes(tmp_path / "c", "a", "b")
    with pytest.raises(trainstate.CorruptCheckpointError):  # the authenticated manifest's checksums
        trainstate.load(tmp_path / "c", key=KEY)
    with pytest.raises(trainstate.TamperedCheckpointError):  # and the AES-GCM tag with its place
        trainstate.load(tmp_path / "c", key=KEY, verify=False)
    with trainstate.open(tmp_path / "c", key=KEY) as ck, pytest.raises(trainstate.TamperedCheckpointError):
        ck.read("a", verify=False)


def test_one_tensor_reads_alone(tmp_path: Path) -> None:
    state = {"a": np.arange(64, dtype=np.float32), "b": PATTERN.copy()}
    trainstate.save(tmp_path / "c", state, key=KEY, threads=1)
    body = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    (cb,) = body["tensors"]["b"]["chunks"]
    f = tmp_path / "c" / cb["file"]
    raw = bytearray(f.read_bytes())
    raw[cb["byte_range"][0]] ^= 0xFF  # damage b only
    f.write_bytes(bytes(raw))
    with trainstate.open(tmp_path / "c", key=KEY) as ck:
        np.testing.assert_array_equal(ck.read("a"), state["a"])
        with pytest.raises(trainstate.CorruptCheckpointError):
            ck.read("b")


def test_every_reader_decrypts(tmp_path: Path) -> None:
    for step in (1, 2):
        trainstate.save(tmp_path / f"c{step}", {"w": np.full(8, step, dtype=np.float32)}, key=KEY)
    trainstate.average([tmp_path / "c1", tmp_path / "c2"], tmp_path / "avg", key=KEY)
    np.testing.assert_array_equal(trainstate.load(tmp_path / "avg", key=KEY)["w"], np.full(8, 1.5, np.float32))
    trainstate.consolidate(tmp_path / "c1", tmp_path / "one", key=KEY)
    np.testing.assert_array_equal(trainstate.load(tmp_path / "one", key=KEY)["w"], np.full(8, 1, np.float32))
    blob = trainstate.pack(tmp_path / "c2", key=KEY)
    np.testing.assert_array_equal(trainstate.load(blob, key=KEY)["w"], np.full(8, 2, np.float32))
    with trainstate.open(tmp_path / "c1", key=KEY) as ck:
        ck.verify()
    trainstate.export(tmp_path / "c1", tmp_path / "w.safetensors", format="safetensors", select="w", key=KEY)
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(str(tmp_path / "w.safetensors"))["w"], np.full(8, 1, np.float32))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_managed_run_encrypts_every_checkpoint(tmp_path: Path, async_save: bool) -> None:
    run = tmp_path / "run"
    with trainstate.CheckpointManager(run, every_steps=1, key=KEY, async_save=async_save) as mgr:
        for step in range(3):
            mgr.save(step, {"marker": PATTERN.copy(), "step": step})
    for f in run.rglob("*.safetensors"):
        assert b"TRAINSTATE-PLAINTEXT-MARKER" not in f.read_bytes()
    state = {"marker": np.zeros_like(PATTERN), "step": -1}
    assert trainstate.CheckpointManager(run, key=KEY).restore_latest(state) == 3
    np.testing.assert_array_equal(state["marker"], PATTERN)
