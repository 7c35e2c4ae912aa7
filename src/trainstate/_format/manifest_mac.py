"""The authenticated manifest of an encrypted checkpoint (format 1.3).

An encrypted checkpoint's manifest says so in a top-level ``encryption`` object (algorithm, KDF, a random
per-checkpoint salt and a key check), and its ``checksum`` member is an HMAC-SHA256 keyed from the user's key
(``"hmac-sha256:<64 hex digits>"``) over exactly the bytes an xxh3 checksum covers (docs/format.md §5.1: the
same prefix rule, a longer prefix). Nobody without the key can change a byte of it, so every chunk's
checksum, place and nonce is the writer's; that is what stops chunks being swapped between checkpoints.

The key check (HKDF of the key and the salt, 16 bytes) tells a WRONG key (:class:`WrongKeyError`) from a
TAMPERED manifest (:class:`TamperedCheckpointError`: the key check matches, the MAC does not). It reveals
nothing about the key: like the MAC it is a pseudorandom function of it. A reader given a key refuses a
plain manifest (:class:`NotEncryptedError`), since anyone can write one: a key promises authenticity.

``manifest.py`` calls :func:`seal` when it writes and :func:`verifier` when it parses; docs/format.md §12
is the normative description.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from trainstate import _checksum as checksum
from trainstate._keys import Key
from trainstate.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    KeyRequiredError,
    NotEncryptedError,
    TamperedCheckpointError,
    WrongKeyError,
)

ENCRYPTION_VERSION = "1.3"  # the minor version that added encrypted checkpoints
FIELD = "encryption"
ALGORITHM = "aes-256-gcm"
KDF = "hkdf-sha256"
MAC_ALGORITHM = "hmac-sha256"
SALT_BYTES = 16
KEY_CHECK_BYTES = 16
MAC_INFO = b"trainstate manifest hmac-sha256 v1"
KEY_CHECK_INFO = b"trainstate key check v1"
_PREFIX = MAC_ALGORITHM + ":"
_HEX = re.compile(r"[0-9a-f]+")

Verify = Callable[[bytes], None]


class Mac:
    """The MAC of manifest bytes that arrive in parts; :class:`checksum.Hasher`'s interface."""

    def __init__(self, key: Key, salt: bytes) -> None:
        self._h = hmac.new(key.derive(MAC_INFO, salt), digestmod=hashlib.sha256)

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def result(self) -> str:
        return _PREFIX + self._h.hexdigest()


def seal(body: dict[str, Any], key: Key | None) -> Mac | checksum.Hasher:
    """What computes the manifest's ``checksum`` member; with a key it also makes ``body`` an encrypted
    checkpoint's: a fresh salt, the ``encryption`` object, and format version 1.3 at least."""
    if key is None:
        return checksum.Hasher()
    salt = os.urandom(SALT_BYTES)
    body[FIELD] = {"algorithm": ALGORITHM, "kdf": KDF, "salt": salt.hex(), "key_check": key_check(key, salt).hex()}
    if _older(body["format_version"], ENCRYPTION_VERSION):
        body["format_version"] = ENCRYPTION_VERSION
    return Mac(key, salt)


def key_check(key: Key, salt: bytes) -> bytes:
    return key.derive(KEY_CHECK_INFO, salt, KEY_CHECK_BYTES)


def verifier(body: Mapping[str, Any], expected: str, key: Key | None, what: str) -> Verify:
    """How to check the manifest bytes its ``checksum`` covers, after the checks that need no bytes.

    Raises:
        KeyRequiredError, WrongKeyError, NotEncryptedError: the key given does not fit.
        CorruptCheckpointError: the ``encryption`` object or the checksum is malformed, or they disagree.
        FormatVersionError: encrypted with an algorithm or KDF this trainstate does not know.
    """
    if FIELD not in body:
        if expected.startswith(_PREFIX):
            raise CorruptCheckpointError(
                f"{what} carries a MAC ({MAC_ALGORITHM}) but no '{FIELD}' object: it was altered or damaged"
            )
        if key is not None:
            raise NotEncryptedError(
                f"{what} belongs to a plain checkpoint, but a key was given. A plain checkpoint is not "
                "authenticated (anyone can write one), so trainstate does not open it as if it were encrypted: "
                "open it without a key to read it as a plain checkpoint"
            )
        return lambda data: checksum.check(data, expected, what)
    salt, check = _parameters(body[FIELD], what)
    mac = expected[len(_PREFIX) :]
    if not expected.startswith(_PREFIX) or len(mac) != 64 or not _HEX.fullmatch(mac):
        raise CorruptCheckpointError(
            f"{what} is an encrypted checkpoint's, so its checksum must be {MAC_ALGORITHM}:<64 hex digits>; "
            f"found {expected!r:.40}: it was altered or damaged"
        )
    if key is None:
        raise KeyRequiredError(
            f"{what} belongs to an encrypted checkpoint ({ALGORITHM}) and no key was given: pass key= or "
            "key_env='VARIABLE' (CLI: --key-env VARIABLE). Without the key its tensor names, shapes and plain "
            "values can be read from the JSON, but trainstate opens nothing it cannot authenticate"
        )
    if not hmac.compare_digest(key_check(key, salt), check):
        raise WrongKeyError(
            f"{what} was encrypted with another key: the key given does not match its key check. Nothing was "
            "read; pass the key the checkpoint was saved with"
        )
    mac_key = key.derive(MAC_INFO, salt)

    def verify(data: bytes) -> None:
        found = hmac.new(mac_key, data, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(found, mac):
            raise TamperedCheckpointError(
                f"{what} failed authentication: the key is right (its key check matches) but its MAC does not "
                "match its bytes, so it was altered or damaged after it was written. Restore another checkpoint"
            )

    return verify


def _parameters(raw: Any, what: str) -> tuple[bytes, bytes]:
    """The salt and key check of an ``encryption`` object, once its algorithm and KDF are known ones."""
    if type(raw) is not dict:
        raise CorruptCheckpointError(f"{what}: '{FIELD}' should be an object, found {raw!r:.60}")
    for member, known in (("algorithm", ALGORITHM), ("kdf", KDF)):
        value = raw.get(member)
        if type(value) is not str:
            raise CorruptCheckpointError(f"{what}: '{FIELD}.{member}' should be a string, found {value!r:.60}")
        if value != known:
            raise FormatVersionError(
                f"{what} is encrypted with {member} {value!r:.40}, which this trainstate does not know (it knows "
                f"{known!r}): upgrade trainstate to read it"
            )
    out = []
    for member, size in (("salt", SALT_BYTES), ("key_check", KEY_CHECK_BYTES)):
        value = raw.get(member)
        if type(value) is not str or len(value) != 2 * size or not _HEX.fullmatch(value):
            raise CorruptCheckpointError(
                f"{what}: '{FIELD}.{member}' should be {2 * size} lowercase hex digits, found {value!r:.60}"
            )
        out.append(bytes.fromhex(value))
    return out[0], out[1]


def _older(version: str, than: str) -> bool:
    return tuple(map(int, version.split("."))) < tuple(map(int, than.split(".")))
