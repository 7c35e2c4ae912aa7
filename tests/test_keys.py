"""Encryption keys (``_keys.py``): the forms a key is accepted in, the clear errors for everything else, and
that a key's bytes never leave the one object that holds them: not in a repr, a message, an exception's
args or chained exceptions, a log record or a pickle."""

from __future__ import annotations

import base64
import copy
import logging
import pickle
import traceback

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import trainstate
from trainstate._keys import Key, hkdf_sha256, resolve

RAW = bytes(range(100, 132))  # a TEST key: public in this repository, never for real data
HEX = RAW.hex()
B64 = base64.b64encode(RAW).decode()


def _forms(raw: bytes) -> list[str]:
    """Every way the key could show up in text."""
    b64 = base64.b64encode(raw).decode()
    return [raw.hex(), raw.hex().upper(), b64, b64.rstrip("="), base64.urlsafe_b64encode(raw).decode(), repr(raw)]


def _assert_not_leaked(text: str, raw: bytes = RAW) -> None:
    for form in _forms(raw):
        assert form not in text
    assert raw.hex()[8:40] not in text  # not even a good part of it


def _everything_about(error: BaseException) -> str:
    """The error as a user, a log or a traceback would show it, chained exceptions included."""
    return "\n".join(
        [
            str(error),
            repr(error),
            repr(error.args),
            *traceback.format_exception(type(error), error, error.__traceback__),
        ]
    )


@pytest.mark.parametrize(
    "given",
    [
        RAW,
        bytearray(RAW),
        memoryview(RAW),
        HEX,
        HEX.upper(),
        f"  {HEX}\n",  # as read from a key file
        B64,
        B64.rstrip("="),
        base64.urlsafe_b64encode(RAW).decode(),
    ],
    ids=["bytes", "bytearray", "memoryview", "hex", "HEX", "hex-newline", "base64", "base64-unpadded", "urlsafe"],
)
def test_a_key_is_accepted_in_every_documented_form(given: object) -> None:
    key = resolve(given)  # type: ignore[arg-type]
    assert isinstance(key, Key)
    assert key.derive(b"probe") == Key(RAW).derive(b"probe")


def test_a_key_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TS_TEST_KEY", HEX + "\n")
    key = resolve(key_env="TS_TEST_KEY")
    assert key is not None and key.derive(b"probe") == Key(RAW).derive(b"probe")
    assert resolve() is None
    assert resolve(key) is key  # a resolved key passes through


@pytest.mark.parametrize(
    "given, said",
    [
        (RAW[:16], "got 16 bytes"),
        (RAW + b"\0", "got 33 bytes"),
        (HEX[:-1], "a string of 63 characters"),
        (HEX + "00", "a string of 66 characters"),
        ("correct horse battery staple", "a string of 28 characters"),
        ("z" * 64, "a string of 64 characters"),
        (B64[:40], "a string of 40 characters"),
        (12345, "a int"),
    ],
)
def test_a_wrong_key_is_a_clear_error_that_does_not_repeat_it(given: object, said: str) -> None:
    with pytest.raises(trainstate.InvalidArgumentError) as got:
        resolve(given)  # type: ignore[arg-type]
    text = _everything_about(got.value)
    assert "not an encryption key" in str(got.value) and said in str(got.value)
    assert "trainstate keygen" in str(got.value)  # says how to make a right one
    assert got.value.__cause__ is None and got.value.__context__ is None
    if isinstance(given, (str, bytes)) and len(given) > 8:
        assert (given if isinstance(given, str) else given.hex()) not in text


def test_environment_mistakes_name_the_variable_never_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TS_TEST_UNSET", raising=False)
    with pytest.raises(trainstate.InvalidArgumentError, match="TS_TEST_UNSET is not set"):
        resolve(key_env="TS_TEST_UNSET")
    monkeypatch.setenv("TS_TEST_SHORT", HEX[:-2])
    with pytest.raises(trainstate.InvalidArgumentError, match="TS_TEST_SHORT holds a string of 62") as got:
        resolve(key_env="TS_TEST_SHORT")
    _assert_not_leaked(_everything_about(got.value))
    assert HEX[:-2] not in _everything_about(got.value)
    with pytest.raises(trainstate.InvalidArgumentError, match="not both"):
        resolve(HEX, key_env="TS_TEST_SHORT")


@pytest.mark.parametrize("mistake", [HEX, "ab" * 32, B64, f"{HEX}\n"])
def test_the_key_itself_passed_as_key_env_is_refused_without_echoing_it(mistake: str) -> None:
    """The classic slip: key_env=<the key>. The error must not print the key it was handed."""
    with pytest.raises(trainstate.InvalidArgumentError, match="NAME of an environment variable") as got:
        resolve(key_env=mistake)
    assert mistake.strip() not in _everything_about(got.value)


def test_a_key_object_shows_nothing_and_refuses_to_be_pickled() -> None:
    key = Key(RAW)
    for text in (repr(key), str(key), f"{key}", f"{key!r}", repr([key]), repr({"key": key})):
        assert text.count("trainstate encryption key") >= 1
        _assert_not_leaked(text)
    with pytest.raises(trainstate.InvalidArgumentError, match="never pickled") as got:
        pickle.dumps(key)
    _assert_not_leaked(_everything_about(got.value))
    assert copy.deepcopy(key) is key and copy.copy(key) is key
    assert not hasattr(key, "__dict__")  # nothing but the slot: vars() shows nothing


def test_hkdf_is_rfc_5869() -> None:
    # RFC 5869, appendix A.1 (test case 1)
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = hkdf_sha256(ikm, salt, info, 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")
    # and the same as the cryptography package's, with no salt (the chunk key's derivation)
    ours = hkdf_sha256(RAW, b"", b"trainstate aes-256-gcm chunk key v1", 32)
    theirs = HKDF(hashes.SHA256(), 32, None, b"trainstate aes-256-gcm chunk key v1").derive(RAW)
    assert ours == theirs


def test_generated_keys_are_fresh_hex_keys() -> None:
    keys = {trainstate.generate_key() for _ in range(8)}
    assert len(keys) == 8
    for k in keys:
        assert len(k) == 64 and bytes.fromhex(k) and resolve(k) is not None


def test_the_key_is_in_no_log_record_repr_or_file(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Save, load and a manager's saves and resume with a key, logging everything: the key appears in
    no log record, no repr, and no file the checkpoint holds."""
    state = {"w": np.arange(6, dtype=np.float32), "step": 1}
    with caplog.at_level(logging.DEBUG, logger="trainstate"):
        trainstate.save(tmp_path / "c", state, key=HEX)
        trainstate.load(tmp_path / "c", key=HEX)
        with trainstate.open(tmp_path / "c", key=HEX) as ck:
            _assert_not_leaked(repr(ck))
        mgr = trainstate.CheckpointManager(tmp_path / "run", every_steps=1, key=HEX, async_save=True)
        for step in range(2):
            mgr.save(step, state)
        mgr.wait()
        _assert_not_leaked(repr(mgr._config) + repr(mgr.catalog.__dict__) + repr(mgr.history()))
        with pytest.raises(trainstate.InvalidArgumentError) as got:
            mgr.key = HEX  # type: ignore[attr-defined]
        _assert_not_leaked(_everything_about(got.value))
        mgr.close()
        trainstate.CheckpointManager(tmp_path / "run", key=HEX).restore_latest(state)
    assert caplog.records  # something was logged, and none of it is the key
    _assert_not_leaked("\n".join(r.getMessage() + repr(r.args) for r in caplog.records))
    for f in tmp_path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert RAW not in data and HEX.encode() not in data and B64.encode() not in data
