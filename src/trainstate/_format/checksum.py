"""Chunk and manifest checksums: xxh3-64, written as ``"xxh3_64:<16 hex digits>"``.

xxh3 hashes at tens of GB/s on one core, so checking every byte on every load costs little next to the
read itself. The algorithm name travels with the digest, so a later format can add another.
"""

from __future__ import annotations

import xxhash

from trainstate.errors import CorruptCheckpointError

ALGORITHM = "xxh3_64"


def digest(data: bytes | memoryview) -> str:
    """The checksum string of ``data``."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


class Hasher:
    """Incremental form of :func:`digest`, for bytes that arrive in pieces."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def result(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def check(data: bytes | memoryview, expected: str, what: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``what`` unless ``data`` hashes to ``expected``."""
    algorithm = expected.split(":", 1)[0]
    if algorithm != ALGORITHM:
        raise CorruptCheckpointError(f"{what}: unknown checksum algorithm {algorithm!r}")
    found = digest(data)
    if found != expected:
        raise CorruptCheckpointError(
            f"checksum mismatch in {what}: manifest says {expected}, the bytes hash to {found}; "
            "the checkpoint is damaged — restore from an older checkpoint"
        )
