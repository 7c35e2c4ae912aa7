"""The authenticated manifest of an encrypted checkpoint (``_format/manifest_mac.py``, docs/format.md §12.3):
written and checked with the §5.1 prefix rule, its MAC and key check recomputed here from the spec alone,
and every way of getting it wrong (no key, another key, a changed byte, a stripped or forged ``encryption``
object) a clear error of its own."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import trainstate
from helpers import laid_out
from trainstate import _checksum as checksum
from trainstate import _state, _tree
from trainstate._format import manifest
from trainstate._keys import Key

RAW_KEY = bytes(range(64, 96))  # a TEST key: public in this repository, never for real data
KEY = Key(RAW_KEY)
OTHER = Key(bytes(32))


def _hkdf(salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, salt, info).derive(RAW_KEY)


def _sealed() -> bytes:
    tree, metadata = _state.encode_plain({"name": "w"}), _state.encode_plain({"run": "x"})
    return manifest.Manifest(tree=tree, tensors={}, files=(), metadata=metadata).to_json_bytes(KEY)


def _sign(body: dict[str, object]) -> bytes:
    """A manifest file for ``body`` (no checksum member) laid out and MACed per §5.1 and §12.3, from the
    spec alone: a writer in another language would do exactly this."""
    b = laid_out(body)
    salt = bytes.fromhex(body["encryption"]["salt"])  # type: ignore[index]
    mac = hmac.new(_hkdf(salt, b"trainstate manifest hmac-sha256 v1", 32), b, hashlib.sha256).hexdigest()
    return b'{"checksum":"hmac-sha256:' + mac.encode() + b'",' + b[1:] + b"\n"


def _body(raw: bytes) -> dict[str, object]:
    body = json.loads(raw)
    body.pop("checksum")
    return body


def test_an_encrypted_manifest_follows_the_prefix_rule_with_a_mac_from_the_spec() -> None:
    raw = _sealed()
    body = _body(raw)
    enc = body["encryption"]
    assert body["format_version"] == "1.3"
    assert enc.keys() == {"algorithm", "kdf", "salt", "key_check"}
    assert (enc["algorithm"], enc["kdf"]) == ("aes-256-gcm", "hkdf-sha256")
    salt = bytes.fromhex(enc["salt"])
    assert len(salt) == 16
    assert enc["key_check"] == _hkdf(salt, b"trainstate key check v1", 16).hex()
    # §5.1 with a longer prefix: F = P + B[1:] + LF, P = {"checksum":"hmac-sha256:<64 hex>",
    c = json.loads(raw)["checksum"]
    prefix = b'{"checksum":"' + c.encode() + b'",'
    assert raw.startswith(prefix) and len(prefix) == 13 + 12 + 64 + 2 and raw.endswith(b"}\n")
    covered = b"{" + raw[len(prefix) :].rstrip(b"\n")
    expected = hmac.new(_hkdf(salt, b"trainstate manifest hmac-sha256 v1", 32), covered, hashlib.sha256)
    assert c == "hmac-sha256:" + expected.hexdigest()
    assert _sign(body) == raw  # and a manifest written from the spec is byte for byte the same
    m = manifest.parse(raw, "m", KEY)
    assert m.encrypted and _tree.decode(m.metadata) == {"run": "x"} and m.format_version == "1.3"


def test_each_save_gets_its_own_salt() -> None:
    a, b = _body(_sealed()), _body(_sealed())
    assert a["encryption"]["salt"] != b["encryption"]["salt"]  # type: ignore[index]
    assert a["encryption"]["key_check"] != b["encryption"]["key_check"]  # type: ignore[index]


def test_a_reindented_encrypted_manifest_still_authenticates() -> None:
    """§5.1's MAY: a manifest re-formatted by a tool is checked in Python's canonical form; the MAC
    covers the same bytes either way."""
    pretty = json.dumps(json.loads(_sealed()), indent=2).encode()
    assert manifest.parse(pretty, "m", KEY).encrypted


def test_a_plain_manifest_is_unchanged_without_a_key() -> None:
    raw = manifest.Manifest(tree=None, tensors={}, files=()).to_json_bytes()
    body = json.loads(raw)
    assert "encryption" not in body and body["format_version"] == "1.0"
    assert body["checksum"].startswith("xxh3_64:")
    assert not manifest.parse(raw).encrypted


def test_the_key_given_must_fit() -> None:
    raw = _sealed()
    with pytest.raises(trainstate.KeyRequiredError, match="encrypted checkpoint .* no key was given"):
        manifest.parse(raw, "m")
    with pytest.raises(trainstate.WrongKeyError, match="another key"):
        manifest.parse(raw, "m", OTHER)
    plain = manifest.Manifest(tree=None, tensors={}, files=()).to_json_bytes()
    with pytest.raises(trainstate.NotEncryptedError, match="plain checkpoint, but a key was given"):
        manifest.parse(plain, "m", KEY)
    for error in (trainstate.KeyRequiredError, trainstate.WrongKeyError, trainstate.NotEncryptedError):
        assert issubclass(error, trainstate.EncryptionKeyError)
        assert not issubclass(error, trainstate.CorruptCheckpointError)  # not damage: a manager must not skip on


@pytest.mark.parametrize(
    "change",
    [
        (b'["run","x"]', b'["run","y"]'),  # metadata
        (b'["name","w"]', b'["name","v"]'),  # the tree
        (b'"format_version":"1.3"', b'"format_version":"1.4"'),
        (b'"files":[]', b'"files":[] '),  # insignificant whitespace inside the covered bytes
    ],
    ids=["metadata", "tree", "version", "whitespace"],
)
def test_any_changed_byte_fails_authentication(change: tuple[bytes, bytes]) -> None:
    raw = _sealed()
    assert change[0] in raw
    with pytest.raises(trainstate.TamperedCheckpointError, match="the key is right") as got:
        manifest.parse(raw.replace(*change), "m", KEY)
    assert isinstance(got.value, trainstate.CorruptCheckpointError)


def test_a_rewritten_key_check_or_salt_reads_as_a_wrong_key() -> None:
    """The key check is checked first (it is what tells a wrong key apart): altering it, or the salt, makes
    the right key look wrong. Either way nothing is read."""
    body = _body(_sealed())
    for member in ("key_check", "salt"):
        forged = json.loads(json.dumps(body))
        value = forged["encryption"][member]
        forged["encryption"][member] = ("0" if value[0] != "0" else "1") + value[1:]
        raw = b'{"checksum":"hmac-sha256:' + b"0" * 64 + b'",' + json.dumps(forged).encode()[1:]
        with pytest.raises(trainstate.WrongKeyError):
            manifest.parse(raw, "m", KEY)


def test_stripping_encryption_is_refused_when_a_key_is_given() -> None:
    """A downgrade: someone without the key removes the encryption object and writes a valid xxh3
    checksum. Without a key it reads as the plain checkpoint it now is; with the key it is refused."""
    body = _body(_sealed())
    del body["encryption"]
    b = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    raw = b'{"checksum":"' + checksum.digest(b).encode() + b'",' + b[1:] + b"\n"
    assert not manifest.parse(raw, "m").encrypted
    with pytest.raises(trainstate.NotEncryptedError):
        manifest.parse(raw, "m", KEY)


def _hostile(change) -> bytes:  # type: ignore[no-untyped-def]
    """A manifest whose ``encryption`` object ``change`` broke. Its MAC is zeros: the object is checked
    before any MAC, so the error must be about the object, with or without a key."""
    body = _body(_sealed())
    change(body)
    return b'{"checksum":"hmac-sha256:' + b"0" * 64 + b'",' + json.dumps(body).encode()[1:]


def _set(member: str, value: object):  # type: ignore[no-untyped-def]
    return lambda body: body["encryption"].__setitem__(member, value)


@pytest.mark.parametrize(
    "change, error, said",
    [
        (lambda b: b.__setitem__("encryption", "aes"), trainstate.CorruptCheckpointError, "should be an object"),
        (lambda b: b.__setitem__("encryption", None), trainstate.CorruptCheckpointError, "should be an object"),
        (_set("algorithm", 7), trainstate.CorruptCheckpointError, "encryption.algorithm' should be a string"),
        (_set("algorithm", "chacha20-poly1305"), trainstate.FormatVersionError, "'chacha20-poly1305'"),
        (_set("kdf", "scrypt"), trainstate.FormatVersionError, "kdf 'scrypt'"),
        (lambda b: b["encryption"].pop("kdf"), trainstate.CorruptCheckpointError, "encryption.kdf"),
        (_set("salt", "00" * 8), trainstate.CorruptCheckpointError, "salt' should be 32 lowercase hex"),
        (_set("salt", "ZZ" * 16), trainstate.CorruptCheckpointError, "salt' should be 32"),
        (_set("salt", ["00"]), trainstate.CorruptCheckpointError, "salt' should be 32"),
        (_set("key_check", "AB" * 16), trainstate.CorruptCheckpointError, "key_check' should be 32"),
        (lambda b: b["encryption"].pop("key_check"), trainstate.CorruptCheckpointError, "key_check"),
    ],
    ids=[
        "not-object",
        "null",
        "algorithm-int",
        "algorithm-unknown",
        "kdf-unknown",
        "kdf-missing",
        "salt-short",
        "salt-not-hex",
        "salt-list",
        "key-check-upper",
        "key-check-missing",
    ],
)
def test_a_hostile_encryption_object_is_a_clear_error(change, error, said) -> None:  # type: ignore[no-untyped-def]
    raw = _hostile(change)
    for key in (KEY, None):  # refused before any key is used, with or without one
        with pytest.raises(error, match=said):
            manifest.parse(raw, "m", key)


@pytest.mark.parametrize(
    "checksum_text, said",
    [
        ("xxh3_64:0123456789abcdef", "must be hmac-sha256"),
        ("hmac-sha256:" + "0" * 63, "must be hmac-sha256"),
        ("hmac-sha256:" + "A" * 64, "must be hmac-sha256"),
        ("hmac-sha1:" + "0" * 40, "must be hmac-sha256"),
    ],
)
def test_an_encrypted_manifest_needs_a_well_formed_mac(checksum_text: str, said: str) -> None:
    body = _body(_sealed())
    raw = b'{"checksum":"' + checksum_text.encode() + b'",' + json.dumps(body).encode()[1:]
    with pytest.raises(trainstate.CorruptCheckpointError, match=said):
        manifest.parse(raw, "m", KEY)


def test_a_mac_without_an_encryption_object_is_corrupt() -> None:
    raw = b'{"checksum":"hmac-sha256:' + b"0" * 64 + b'",' + manifest.Manifest(None, {}, ()).to_json_bytes()[39:]
    for key in (KEY, None):
        with pytest.raises(trainstate.CorruptCheckpointError, match="carries a MAC .* but no 'encryption'"):
            manifest.parse(raw, "m", key)


def test_a_saved_checkpoint_on_disk(tmp_path: Path) -> None:
    """The same through the public API, the way a user would meet each case."""
    state = {"w": np.arange(4, dtype=np.float32), "lr": 0.5}
    trainstate.save(tmp_path / "c", state, metadata={"note": "hi"}, key=RAW_KEY)
    with trainstate.open(tmp_path / "c", key=RAW_KEY.hex()) as ck:
        assert ck.encrypted and ck.metadata == {"note": "hi"} and ck.keys() == ["w"]
    mpath = tmp_path / "c" / "manifest.json"
    raw = mpath.read_bytes()
    assert b'"shape":[4]' in raw and b'"lr"' in raw  # names, shapes and plain values are readable JSON
    with pytest.raises(trainstate.KeyRequiredError, match="--key-env"):
        trainstate.load(tmp_path / "c")
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.open(tmp_path / "c", key=bytes(32))
    assert b'["note","hi"]' in raw
    mpath.write_bytes(raw.replace(b'["note","hi"]', b'["note","ho"]'))
    with pytest.raises(trainstate.TamperedCheckpointError):
        trainstate.load(tmp_path / "c", key=RAW_KEY)
    trainstate.save(tmp_path / "p", state)
    with pytest.raises(trainstate.NotEncryptedError):
        trainstate.load(tmp_path / "p", key=RAW_KEY)
    assert trainstate.load(tmp_path / "p")["lr"] == 0.5
