"""zstd compression of chunks (the ``zstandard`` package, ``pip install "trainstate[zstd]"``).

Each chunk is one zstd frame that records its content size; a chunk whose frame would not be at least 2%
smaller than its raw bytes is stored raw (weights in float formats compress little, optimizer moments and
integer or sparse data much more, so the choice is made per chunk). The frame's declared size is checked
against the chunk's box before anything is decompressed: a forged frame cannot make the reader allocate
more than the box. Compressor and decompressor contexts are one per thread (they are not thread-safe), and
zstandard releases the GIL while it works, so writer and reader lanes compress in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from trainstate._optional import optional
from trainstate._transforms.base import Place, Transform
from trainstate.errors import CorruptCheckpointError, InvalidArgumentError

NAME = "zstd"
DEFAULT_LEVEL = 3
LEVELS = range(-7, 23)  # zstd's fast (negative) levels to its slowest, 22
PAYS = 0.98  # stored only when the frame is smaller than this fraction of the raw bytes
_SMALLEST = 64  # below this a frame's own header eats any gain


def _zstandard(needed_for: str) -> Any:
    with optional("zstandard", extra="zstd", needed_for=needed_for):
        import zstandard
    return zstandard


class Zstd:
    """The zstd transform; ``level`` matters only when writing (1 fast ... 22 small; default 3)."""

    name = NAME
    records_raw_checksum = True  # its params may carry the raw bytes' checksum (docs/format.md §5b)

    def __init__(self, level: int = DEFAULT_LEVEL, *, needed_for: str = 'compression="zstd"') -> None:
        self.level = level
        self._zstd = _zstandard(needed_for)
        self._local = threading.local()

    def encode(self, raw: memoryview, place: Place) -> tuple[bytes, dict[str, Any]] | None:
        if raw.nbytes < _SMALLEST:
            return None
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = self._zstd.ZstdCompressor(level=self.level, write_content_size=True)
        stored: bytes = compressor.compress(raw)
        if len(stored) >= PAYS * raw.nbytes:
            return None
        return stored, {"name": NAME}

    def decode(self, stored: memoryview, params: Mapping[str, Any], place: Place, raw_nbytes: int) -> bytes:
        zstd = self._zstd
        try:
            declared = zstd.frame_content_size(stored)
        except zstd.ZstdError as e:
            raise CorruptCheckpointError(f"tensor {place.tensor}: its chunk is not a zstd frame ({e})") from None
        if declared != raw_nbytes:  # checked before decompressing: a forged size allocates nothing
            raise CorruptCheckpointError(
                f"tensor {place.tensor}: its zstd frame at {list(place.offset)} says {declared} bytes, the box "
                f"holds {raw_nbytes}"
            )
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstd.ZstdDecompressor()
        try:
            raw: bytes = decompressor.decompress(stored, allow_extra_data=False)
        except zstd.ZstdError as e:
            raise CorruptCheckpointError(f"tensor {place.tensor}: its zstd frame does not decompress ({e})") from None
        return raw


def decoder(key: Any = None) -> Transform:
    """The registry's factory: reading needs no key."""
    return Zstd(needed_for="reading a zstd-compressed checkpoint")


def parse(spec: object) -> Zstd | None:
    """``compression=``: None, ``"zstd"`` or ``"zstd:LEVEL"`` (LEVEL from -7 to 22)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        name, sep, level = spec.partition(":")
        if name == NAME and not sep:
            return Zstd(DEFAULT_LEVEL)
        if name == NAME and level.lstrip("-").isdigit() and int(level) in LEVELS:
            return Zstd(int(level))
    raise InvalidArgumentError(
        f'compression takes None, "zstd" or "zstd:LEVEL" with LEVEL from {LEVELS[0]} to {LEVELS[-1]} (e.g. "zstd:9"), '
        f"got {spec!r:.60}"
    )
