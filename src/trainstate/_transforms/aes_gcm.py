"""The ``aes-256-gcm`` chunk transform: each chunk encrypted and authenticated on its own.

AES-256 in GCM mode (the ``cryptography`` package, extra ``[crypto]``) with a fresh random 96-bit nonce per
chunk, written in the chunk's manifest object. GCM's tag (16 bytes, after the ciphertext) covers the bytes and
the chunk's *associated data*, which names its place: tensor name, dtype, box offset and shape
(:func:`associated_data`). A chunk moved to another tensor or another box, or its nonce changed, fails to
decrypt, as does a single flipped byte: :class:`~trainstate.errors.TamperedCheckpointError`.

The AES key is derived from the user's key alone (HKDF, :data:`CHUNK_KEY_INFO`), with no per-checkpoint
salt: a chunk is decrypted with nothing but the key, its place and its own manifest object, so a later
checkpoint may refer to an earlier one's chunk by copying its manifest entry (incremental checkpoints).
Random 96-bit nonces under one key stay below NIST's 2^-32 collision bound for 2^32 chunks (at 4 MiB a
chunk, 16 PiB encrypted under one key); docs/encryption.md says so.

docs/format.md §12 is the normative description.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Any

from trainstate._keys import Key
from trainstate._optional import optional
from trainstate._transforms.base import Place
from trainstate.errors import CorruptCheckpointError, KeyRequiredError, TamperedCheckpointError, UnsupportedValueError

NAME = "aes-256-gcm"
NONCE_BYTES = 12
TAG_BYTES = 16
CHUNK_KEY_INFO = b"trainstate aes-256-gcm chunk key v1"
AAD_PREFIX = b"trainstate aes-256-gcm chunk v1\x00"
MAX_CHUNK_BYTES = (1 << 31) - 1 - TAG_BYTES  # what one call of the library encrypts
_NONCE_HEX = frozenset("0123456789abcdef")


class AesGcm:
    """The transform, for writing (with a key) and reading (a key, or None: then reading a chunk raises
    :class:`~trainstate.errors.KeyRequiredError`). Thread-safe: it holds only the derived AES key."""

    name = NAME

    def __init__(self, key: Key | None) -> None:
        self._aead: Any = None
        if key is not None:
            with optional("cryptography", extra="crypto", needed_for="an encrypted checkpoint (aes-256-gcm)"):
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            self._aead = AESGCM(key.derive(CHUNK_KEY_INFO))

    def __repr__(self) -> str:
        return f"<trainstate {NAME} transform{'' if self._aead is not None else ' without a key'}>"

    def encode(self, raw: memoryview, place: Place) -> tuple[bytes, dict[str, Any]]:
        """The chunk encrypted (ciphertext then tag: ``raw.nbytes + 16`` bytes) and its manifest object."""
        aead = self._need_key(place)
        if raw.nbytes > MAX_CHUNK_BYTES:
            raise UnsupportedValueError(
                f"a chunk of {raw.nbytes} bytes of tensor {place.tensor!r:.80} is too large to encrypt in one "
                f"piece (at most {MAX_CHUNK_BYTES}); the writer cuts tensors into smaller chunks"
            )
        nonce = os.urandom(NONCE_BYTES)
        return aead.encrypt(nonce, raw, associated_data(place)), {"name": NAME, "nonce": nonce.hex()}

    def decode(self, stored: memoryview | bytes, params: Mapping[str, Any], place: Place, raw_nbytes: int) -> bytes:
        """The chunk's bytes before encryption, once its tag verified; ``raw_nbytes`` is not needed (a
        transform before this one, e.g. compression, may have made them fewer than the box's)."""
        aead = self._need_key(place)
        nonce = _nonce(params, place)
        size = stored.nbytes if isinstance(stored, memoryview) else len(stored)
        if size < TAG_BYTES:
            raise CorruptCheckpointError(
                f"{_where(place)} holds {size} stored bytes, fewer than an AES-GCM tag ({TAG_BYTES}): damaged"
            )
        from cryptography.exceptions import InvalidTag

        try:
            return bytes(aead.decrypt(nonce, stored, associated_data(place)))
        except InvalidTag:
            raise TamperedCheckpointError(
                f"{_where(place)} failed authentication (AES-GCM tag): its bytes or its nonce were changed, or "
                "it was moved here from another tensor or box. Nothing of it was used; restore another checkpoint"
            ) from None

    def _need_key(self, place: Place) -> Any:
        if self._aead is None:
            raise KeyRequiredError(
                f"tensor {place.tensor!r:.80} is encrypted ({NAME}) and no key was given: pass key= or key_env= "
                "(CLI: --key-env NAME)"
            )
        return self._aead


def associated_data(place: Place) -> bytes:
    """The bytes GCM authenticates beside a chunk: :data:`AAD_PREFIX`, then the tensor name (UTF-8) and
    the dtype code (ASCII), each after its length as a u32, then the rank as a u32 and the box's offset and
    shape as u64s, all little-endian (docs/format.md §12.2)."""
    name = place.tensor.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON allows one) as WTF-8
    dtype = place.dtype.encode("ascii")
    rank = len(place.shape)
    if len(place.offset) != rank:
        raise CorruptCheckpointError(f"{_where(place)}: its offset and shape differ in rank")
    return b"".join(
        [
            AAD_PREFIX,
            struct.pack("<I", len(name)),
            name,
            struct.pack("<I", len(dtype)),
            dtype,
            struct.pack(f"<I{rank}Q{rank}Q", rank, *place.offset, *place.shape),
        ]
    )


def _nonce(params: Mapping[str, Any], place: Place) -> bytes:
    nonce = params.get("nonce")
    if type(nonce) is not str or len(nonce) != 2 * NONCE_BYTES or not _NONCE_HEX.issuperset(nonce):
        raise CorruptCheckpointError(
            f"{_where(place)}: its {NAME} transform should carry a nonce of {2 * NONCE_BYTES} lowercase hex "
            f"digits, found {nonce!r:.40}"
        )
    return bytes.fromhex(nonce)


def _where(place: Place) -> str:
    return f"the chunk of tensor {place.tensor!r:.80} at {list(place.offset)} of shape {list(place.shape)}"
