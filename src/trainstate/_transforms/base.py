"""What a chunk transform is (:class:`Transform`) and where its bytes sit (:class:`Place`): the vocabulary the
transform modules (zstd.py, aes_gcm.py) and the pipeline in ``__init__.py`` share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol


class Place(NamedTuple):
    """Where a chunk belongs: what an encryption transform authenticates, and what messages name."""

    tensor: str
    dtype: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


class Transform(Protocol):
    """One reversible byte transform. ``name`` is what the chunk's manifest ``transforms`` list says."""

    name: str

    def encode(self, raw: memoryview, place: Place) -> tuple[bytes | memoryview, dict[str, Any]] | None:
        """Stored bytes and this transform's manifest object (with ``"name"``); None: not applied to this
        chunk (compression that did not pay)."""
        ...

    def decode(
        self, stored: memoryview, params: Mapping[str, Any], place: Place, raw_nbytes: int
    ) -> bytes | bytearray | memoryview:
        """Undo :meth:`encode`; raise CorruptCheckpointError (or a subclass) on bad bytes. ``raw_nbytes`` is
        the size of the chunk's raw bytes (the end of the whole chain)."""
        ...
