"""The ``aes-256-gcm`` chunk transform on its own (``_transforms/aes_gcm.py``), the way the chunk pipeline
calls it: encode a chunk's raw bytes at its place, decode them from the stored bytes and the chunk's
manifest object. The bytes it writes are checked against a decryption written here from docs/format.md
§12 with the ``cryptography`` package alone, and every way of moving, swapping or changing a chunk fails."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import trainstate
from trainstate._keys import Key
from trainstate._transforms import Place, Transform
from trainstate._transforms.aes_gcm import AesGcm, associated_data

RAW_KEY = bytes(range(32))  # a TEST key: public in this repository, never for real data
KEY = Key(RAW_KEY)
W = Place("model.w", "F32", (0, 0), (2, 3))
DATA = memoryview(np.arange(6, dtype=np.float32).tobytes())


def _spec_decrypt(stored: bytes, nonce_hex: str, place: Place) -> bytes:
    """docs/format.md §12, with nothing from trainstate: HKDF-SHA256 of the key (no salt, the info string)
    is the AES-256 key; the associated data is the prefix, the length-prefixed name and dtype, the rank and
    the box as little-endian integers."""
    aes_key = HKDF(hashes.SHA256(), 32, None, b"trainstate aes-256-gcm chunk key v1").derive(RAW_KEY)
    name, dtype, rank = place.tensor.encode(), place.dtype.encode(), len(place.shape)
    aad = (
        b"trainstate aes-256-gcm chunk v1\x00"
        + struct.pack("<I", len(name))
        + name
        + struct.pack("<I", len(dtype))
        + dtype
        + struct.pack("<I", rank)
        + b"".join(struct.pack("<Q", o) for o in place.offset)
        + b"".join(struct.pack("<Q", s) for s in place.shape)
    )
    return AESGCM(aes_key).decrypt(bytes.fromhex(nonce_hex), stored, aad)


def test_it_is_a_transform_that_round_trips_and_matches_the_spec() -> None:
    t: Transform = AesGcm(KEY)
    assert t.name == "aes-256-gcm"
    encoded = t.encode(DATA, W)
    assert encoded is not None
    stored, params = encoded
    assert len(stored) == DATA.nbytes + 16  # ciphertext, then the 16-byte tag
    assert set(params) == {"name", "nonce"} and params["name"] == "aes-256-gcm"
    assert len(params["nonce"]) == 24 and params["nonce"] == params["nonce"].lower()
    assert bytes(DATA) not in bytes(stored)
    assert t.decode(memoryview(stored), params, W, DATA.nbytes) == bytes(DATA)
    assert _spec_decrypt(bytes(stored), params["nonce"], W) == bytes(DATA)


def test_the_associated_data_bytes_are_pinned() -> None:
    assert associated_data(Place("a.b", "BF16", (4,), (2,))) == (
        b"trainstate aes-256-gcm chunk v1\x00"
        b"\x03\x00\x00\x00a.b"
        b"\x04\x00\x00\x00BF16"
        b"\x01\x00\x00\x00"
        b"\x04\x00\x00\x00\x00\x00\x00\x00"
        b"\x02\x00\x00\x00\x00\x00\x00\x00"
    )
    assert associated_data(Place("_", "U8", (), ())).endswith(b"\x01\x00\x00\x00_\x02\x00\x00\x00U8\x00\x00\x00\x00")
    assert b"\xc3\xa9" in associated_data(Place("caf\u00e9", "F32", (0,), (1,)))  # UTF-8


def test_every_chunk_gets_a_fresh_nonce() -> None:
    t = AesGcm(KEY)
    outs = [t.encode(DATA, W) for _ in range(20)]
    assert len({p["nonce"] for _, p in outs}) == 20
    assert len({bytes(s) for s, _ in outs}) == 20  # same bytes, same place: different ciphertexts


def test_a_chunk_decodes_with_only_the_key_its_place_and_its_params() -> None:
    """What incremental checkpoints rely on: a later checkpoint copies an earlier one's chunk entry
    verbatim, and a reader that never saw the earlier checkpoint (a new transform object, no salt, no
    manifest) still decrypts it."""
    stored, params = AesGcm(KEY).encode(DATA, W)
    copied = dict(params)  # as a manifest entry, copied
    assert AesGcm(Key(RAW_KEY)).decode(memoryview(stored), copied, W, DATA.nbytes) == bytes(DATA)


@pytest.mark.parametrize(
    "other",
    [
        Place("model.b", "F32", (0, 0), (2, 3)),  # another tensor of the same dtype and shape
        Place("model.w", "F32", (2, 0), (2, 3)),  # another box of the same tensor
        Place("model.w", "I32", (0, 0), (2, 3)),  # the same bytes read as another dtype
        Place("model.w", "F32", (0, 0), (3, 2)),  # another shape
        Place("model.w", "F32", (0, 0, 0), (1, 2, 3)),  # another rank
    ],
    ids=["other-tensor", "other-box", "other-dtype", "other-shape", "other-rank"],
)
def test_a_chunk_moved_to_another_place_is_detected(other: Place) -> None:
    t = AesGcm(KEY)
    stored, params = t.encode(DATA, W)
    with pytest.raises(trainstate.TamperedCheckpointError, match="moved here from another tensor"):
        t.decode(memoryview(stored), params, other, DATA.nbytes)


def test_two_chunks_swapped_between_tensors_are_both_detected() -> None:
    """An attacker swaps the stored bytes and the nonces of two same-sized tensors' chunks."""
    t = AesGcm(KEY)
    a, b = Place("enc.w", "F32", (0,), (6,)), Place("dec.w", "F32", (0,), (6,))
    sa, pa = t.encode(DATA, a)
    sb, pb = t.encode(memoryview(bytes(reversed(bytes(DATA)))), b)
    for stored, params, place in ((sb, pb, a), (sa, pa, b)):
        with pytest.raises(trainstate.TamperedCheckpointError):
            t.decode(memoryview(stored), params, place, DATA.nbytes)


def test_a_flipped_byte_a_changed_nonce_or_another_key_is_detected() -> None:
    t = AesGcm(KEY)
    stored, params = t.encode(DATA, W)
    for i in (0, len(stored) // 2, len(stored) - 1):  # ciphertext, tag
        damaged = bytearray(stored)
        damaged[i] ^= 0x01
        with pytest.raises(trainstate.TamperedCheckpointError) as got:
            t.decode(memoryview(damaged), params, W, DATA.nbytes)
        assert isinstance(got.value, trainstate.CorruptCheckpointError)  # damage, as far as callers know
    nonce = params["nonce"]
    other_nonce = {**params, "nonce": ("0" if nonce[0] != "0" else "1") + nonce[1:]}
    with pytest.raises(trainstate.TamperedCheckpointError):
        t.decode(memoryview(stored), other_nonce, W, DATA.nbytes)
    with pytest.raises(trainstate.TamperedCheckpointError):
        AesGcm(Key(bytes(32))).decode(memoryview(stored), params, W, DATA.nbytes)
    with pytest.raises(trainstate.TamperedCheckpointError):
        t.decode(memoryview(stored[:-1]), params, W, DATA.nbytes)  # truncated


@pytest.mark.parametrize(
    "params",
    [
        {"name": "aes-256-gcm"},
        {"name": "aes-256-gcm", "nonce": 12},
        {"name": "aes-256-gcm", "nonce": "00" * 11},
        {"name": "aes-256-gcm", "nonce": "AB" * 12},
        {"name": "aes-256-gcm", "nonce": "zz" * 12},
        {"name": "aes-256-gcm", "nonce": None},
    ],
    ids=["missing", "int", "short", "upper", "not-hex", "null"],
)
def test_a_malformed_nonce_is_a_clear_corrupt_error(params: dict[str, object]) -> None:
    stored, _ = AesGcm(KEY).encode(DATA, W)
    with pytest.raises(trainstate.CorruptCheckpointError, match="nonce of 24 lowercase hex digits"):
        AesGcm(KEY).decode(memoryview(stored), params, W, DATA.nbytes)


def test_fewer_stored_bytes_than_a_tag_is_corrupt() -> None:
    _, params = AesGcm(KEY).encode(DATA, W)
    with pytest.raises(trainstate.CorruptCheckpointError, match="fewer than an AES-GCM tag"):
        AesGcm(KEY).decode(memoryview(b"\0" * 15), params, W, DATA.nbytes)


def test_an_empty_chunk_is_just_a_tag() -> None:
    t = AesGcm(KEY)
    empty = Place("e", "I8", (0, 0), (0, 3))
    stored, params = t.encode(memoryview(b""), empty)
    assert len(stored) == 16
    assert t.decode(memoryview(stored), params, empty, 0) == b""


def test_reading_without_a_key_says_the_tensor_is_encrypted() -> None:
    stored, params = AesGcm(KEY).encode(DATA, W)
    no_key = AesGcm(None)
    with pytest.raises(trainstate.KeyRequiredError, match="tensor 'model.w' is encrypted"):
        no_key.decode(memoryview(stored), params, W, DATA.nbytes)
    with pytest.raises(trainstate.KeyRequiredError):
        no_key.encode(DATA, W)
    assert "without a key" in repr(no_key) and RAW_KEY.hex() not in repr(AesGcm(KEY))


def test_without_cryptography_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)  # as if not installed
    with pytest.raises(trainstate.MissingDependencyError, match=r"trainstate\[crypto\]"):
        AesGcm(KEY)
    assert AesGcm(None)._aead is None  # reading a plain checkpoint never needs it
