"""Chunk transforms: byte-to-byte functions applied to a chunk's bytes before they are stored.

STAND-IN (issue 12, engineer C's branch): engineer T owns this package and writes the real module, with the
write-side ``Pipeline`` and the read-side ``Decoders``; this file holds exactly the contract's ``Place`` and
``Transform`` so that the encryption transform (``aes_gcm.py``) can be built and tested against them. At
merge, T's version replaces this file whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol


class Place(NamedTuple):
    """Where a chunk belongs; what encryption authenticates."""

    tensor: str
    dtype: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


class Transform(Protocol):
    name: str  # as written in the chunk's manifest "transforms" list

    def encode(self, raw: memoryview, place: Place) -> tuple[bytes | memoryview, dict[str, Any]] | None:
        """Stored bytes and this transform's manifest object (with "name"); None: not applied to this
        chunk (e.g. compression that did not pay)."""

    def decode(
        self, stored: memoryview, params: Mapping[str, Any], place: Place, raw_nbytes: int
    ) -> bytes | bytearray | memoryview:
        """Undo encode; raise CorruptCheckpointError (or a subclass C defines) on bad bytes."""
