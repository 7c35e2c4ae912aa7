"""The encrypted fixture (tests/fixtures/v1.3-encrypted/basic, format 1.3) must keep opening, and must keep
meaning what docs/format.md §12 says: a reader written here from that section, with the ``cryptography``
package and no trainstate import, authenticates its manifest and decrypts every chunk into the saved state."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from make_encrypted_fixture import FIXTURE, METADATA, TEST_KEY, fixture_state, write

import trainstate
from helpers import one_line

DTYPES = {
    "F32": np.float32,
    "F64": np.float64,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "U8": np.uint8,
    "I8": np.int8,
    "I32": np.int32,
    "I64": np.int64,
}


def _hkdf(salt: bytes | None, info: bytes, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, salt, info).derive(TEST_KEY)


def _spec_read(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an encrypted checkpoint, by §5.1, §4 and §12 alone."""
    raw = (path / "manifest.json").read_bytes()
    body = json.loads(raw)
    c = body["checksum"]
    prefix = b'{"checksum":"' + c.encode() + b'",'
    assert raw.startswith(prefix)
    salt = bytes.fromhex(body["encryption"]["salt"])
    assert bytes.fromhex(body["encryption"]["key_check"]) == _hkdf(salt, b"trainstate key check v1", 16)
    mac_key = _hkdf(salt, b"trainstate manifest hmac-sha256 v1", 32)
    covered = b"{" + raw[len(prefix) :].rstrip(b"\n")
    assert c == "hmac-sha256:" + hmac.new(mac_key, covered, hashlib.sha256).hexdigest()
    aead = AESGCM(_hkdf(None, b"trainstate aes-256-gcm chunk key v1", 32))
    out = {}
    for name, t in body["tensors"].items():
        whole = np.zeros(t["shape"], dtype=DTYPES[t["dtype"]])
        for chunk in t["chunks"]:
            begin, end = chunk["byte_range"]
            stored = (path / chunk["file"]).read_bytes()[begin:end]
            assert chunk["checksum"] == f"xxh3_64:{xxhash.xxh3_64_hexdigest(stored)}"  # over the stored bytes
            (transform,) = chunk["transforms"]
            assert transform["name"] == "aes-256-gcm"
            n, d, rank = name.encode(), t["dtype"].encode(), len(chunk["shape"])
            aad = b"trainstate aes-256-gcm chunk v1\x00" + struct.pack(
                f"<I{len(n)}sI{len(d)}sI{rank}Q{rank}Q", len(n), n, len(d), d, rank, *chunk["offset"], *chunk["shape"]
            )
            plain = aead.decrypt(bytes.fromhex(transform["nonce"]), stored, aad)
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"]))
            whole[box] = np.frombuffer(plain, dtype=whole.dtype).reshape(chunk["shape"])
        out[name] = whole
    return out


def test_the_fixture_decrypts_by_the_spec_into_the_saved_state() -> None:
    found = _spec_read(FIXTURE)
    state = fixture_state()
    expected = {
        "model.w": state["model"]["w"],
        "model.b": state["model"]["b"],
        "scale": np.asarray(state["scale"]),
        "empty": state["empty"],
        "counts": state["counts"],
    }
    assert found.keys() == expected.keys()
    for name, want in expected.items():
        assert found[name].dtype == want.dtype and found[name].tobytes() == want.tobytes(), name


def test_the_fixture_opens_with_the_test_key_only() -> None:
    with trainstate.open(FIXTURE, key=TEST_KEY) as ck:
        assert ck.encrypted and ck.manifest.format_version == "1.3"
        assert ck.metadata == METADATA
        assert ck.keys() == ["model.w", "model.b", "scale", "empty", "counts"]
        ck.verify_headers()
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.open(FIXTURE)
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.open(FIXTURE, key=bytes(32))


def test_the_fixture_is_what_its_script_writes(tmp_path: Path) -> None:
    """The script is deterministic, so the fixture's bytes are pinned: the AAD, the KDF, the nonce's and
    salt's places, the MAC and the manifest's layout cannot change without this failing."""
    write(tmp_path / "again")
    for f in sorted(p.name for p in FIXTURE.iterdir()):
        if f != "manifest.json":
            assert (tmp_path / "again" / f).read_bytes() == (FIXTURE / f).read_bytes(), f
    # The fixture predates the line layout (docs/format.md §3.1) and stays as it was written: today's writer
    # gives the same JSON with the layout's line feeds, MACed over its own bytes.
    again = (tmp_path / "again" / "manifest.json").read_bytes()
    _spec_read(tmp_path / "again")  # its MAC covers its own bytes (§5.1)
    pinned = (FIXTURE / "manifest.json").read_bytes()
    mac, old = json.loads(again)["checksum"], json.loads(pinned)["checksum"]
    assert one_line(again).replace(mac.encode(), old.encode()) == pinned
