"""Encryption keys: where a key comes from, and the one object that holds its bytes.

A key is 32 random bytes (AES-256). The user gives it as an argument (``key=``: the bytes, or them written
as 64 hex digits or in base64) or names an environment variable that holds it (``key_env="NAME"``), and it
is turned into a :class:`Key` once, at the call's entry. From there on only that object travels: it is never
written into a checkpoint, and its bytes never appear in its repr, a log line, an error message or an
exception's args, and it refuses to be pickled. Every error about a key says what kind of value was found
(its type and length), never the value itself, and no error raised while decoding one is chained to it.

What the key protects is derived from it with HKDF-SHA256 (RFC 5869, :func:`hkdf_sha256`): the AES-GCM key
of every chunk (``_transforms/aes_gcm.py``), and per checkpoint the manifest's MAC key and its key check
(``_format/manifest_mac.py``). The derivations are in docs/format.md §12.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
from typing import Any, NoReturn

from trainstate.errors import InvalidArgumentError

KEY_BYTES = 32
_HEX = re.compile(r"[0-9A-Fa-f]{64}")
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{43}={0,1}")  # 32 bytes: 43 characters and one '=' of padding
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_HOW = (
    "a key is 32 random bytes: pass them as bytes, as 64 hex digits or in base64; make one with "
    "`trainstate keygen` (or trainstate.generate_key())"
)


class Key:
    """An encryption key in memory: 32 bytes that only derive subkeys, and show up nowhere.

    Built by :func:`resolve`; users pass bytes or strings, never this class.
    """

    __slots__ = ("_material",)

    def __init__(self, material: bytes) -> None:
        if type(material) is not bytes or len(material) != KEY_BYTES:
            _bad(f"got {_describe(material)}")
        self._material = material

    def derive(self, info: bytes, salt: bytes = b"", length: int = KEY_BYTES) -> bytes:
        """A subkey for one purpose (``info``), optionally bound to a ``salt``: HKDF-SHA256."""
        return hkdf_sha256(self._material, salt, info, length)

    def __repr__(self) -> str:
        return "<trainstate encryption key>"

    __str__ = __repr__

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise InvalidArgumentError(
            "an encryption key is never pickled (it would be written out): give each process the key "
            "itself, e.g. through an environment variable and key_env="
        )

    def __copy__(self) -> Key:
        return self

    def __deepcopy__(self, memo: Any) -> Key:
        return self


KeyLike = bytes | bytearray | memoryview | str | Key


def resolve(key: KeyLike | None = None, key_env: str | None = None) -> Key | None:
    """The :class:`Key` a call was given through ``key=`` or ``key_env=``, or None for neither.

    Raises:
        InvalidArgumentError: both were given, the variable is not set, or the value is not a key of
            32 bytes; the message never contains the value.
    """
    if key is not None and key_env is not None:
        raise InvalidArgumentError("give the encryption key once: key= or key_env=, not both")
    if key_env is not None:
        return _from_environment(key_env)
    if key is None or isinstance(key, Key):
        return key
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        if len(raw) != KEY_BYTES:
            _bad(f"got {len(raw)} bytes")
        return Key(raw)
    if isinstance(key, str):
        return Key(_parse(key, "key="))
    _bad(f"got {_describe(key)}")


def _from_environment(name: Any) -> Key:
    if not isinstance(name, str) or not _VARIABLE.fullmatch(name) or _looks_like_a_key(name):
        # A key passed as key_env by mistake must not be echoed back: name it only when it is a plain name.
        raise InvalidArgumentError(
            f"key_env takes the NAME of an environment variable that holds the key (e.g. key_env="
            f"'TRAINSTATE_KEY'), got {_describe(name)}; to pass the key itself use key="
        )
    value = os.environ.get(name)
    if value is None:
        raise InvalidArgumentError(
            f"the environment variable {name} is not set: it should hold the encryption key (64 hex digits "
            "or base64 of 32 bytes; make one with `trainstate keygen`)"
        )
    return Key(_parse(value, f"the environment variable {name}"))


def _parse(text: str, where: str) -> bytes:
    """32 bytes from 64 hex digits or base64 (standard or URL-safe, padding optional); surrounding
    whitespace (a newline from a key file) is ignored."""
    text = text.strip()
    if _HEX.fullmatch(text):
        return bytes.fromhex(text)
    if _BASE64.fullmatch(text):
        padded = text.rstrip("=") + "="
        try:
            raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) == KEY_BYTES:
            return raw
    _bad(f"{where} holds {_describe(text)}, which is neither 64 hex digits nor base64 of 32 bytes")


def _looks_like_a_key(text: str) -> bool:
    text = text.strip()
    return bool(_HEX.fullmatch(text) or _BASE64.fullmatch(text))


def _describe(value: Any) -> str:
    """What kind of value was given, without the value."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return f"a {type(value).__name__}"


def _bad(found: str) -> NoReturn:
    raise InvalidArgumentError(f"not an encryption key: {found}; {_HOW}") from None


def generate_key() -> str:
    """A new random encryption key, as 64 hex digits: what ``key=`` and a ``key_env`` variable take.

    Store it where your secrets go (a secret manager, a file only you can read); trainstate never stores
    it, and a checkpoint encrypted with it cannot be read without it.

    Example:
        >>> key = trainstate.generate_key()
        >>> trainstate.save("ckpt/step_1200", state, key=key)
        >>> trainstate.load("ckpt/step_1200", state, key=key)
    """
    return secrets.token_hex(KEY_BYTES)


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF with SHA-256 (RFC 5869): extract with ``salt`` (empty: 32 zero bytes), expand to ``length``."""
    prk = hmac.new(salt or bytes(hashlib.sha256().digest_size), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for counter in range(1, -(-length // hashlib.sha256().digest_size) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
    return out[:length]
