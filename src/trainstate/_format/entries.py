"""A manifest's entries: each tensor (:class:`TensorEntry`) as boxes stored in data files (:class:`Chunk`,
checked whole or in :class:`Pieces`), and each data file (:class:`FileEntry`). The manifest (manifest.py)
holds them; a collective save's :class:`~trainstate._format.chunk_table.ChunkTable` makes them on lookup."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainstate._format import dtypes


@dataclass(frozen=True)
class Pieces:
    """Checksums of a chunk's stored bytes cut into consecutive pieces of ``size`` bytes (the last may be
    shorter): piece ``i`` is ``[begin + i * size, min(end, begin + (i + 1) * size))`` of the byte range."""

    size: int
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor stored contiguously (C order) in one data file."""

    file: str
    byte_range: tuple[int, int]  # absolute offsets in the file, end exclusive
    offset: tuple[int, ...]  # where the box starts in the tensor
    shape: tuple[int, ...]  # the box's shape
    checksum: str  # over the stored bytes
    transforms: tuple[dict[str, Any], ...] = ()
    pieces: Pieces | None = None  # the same bytes checked piece by piece (format 1.1; optional)
    # the raw bytes' checksum, as the writer computed it (in memory only: see _transforms.raw_checksum)
    raw_checksum: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    kind: str  # what the saver held: "torch", "numpy" or "numpy-scalar"
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * dtypes.from_code(self.dtype).itemsize

    def _replace_chunks(self, chunks: tuple[Chunk, ...]) -> TensorEntry:
        return TensorEntry(self.dtype, self.shape, self.kind, chunks)


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    header_checksum: str  # over the safetensors header, length prefix included
    pool: bool = False  # in the run's shared pool, not the checkpoint (format 1.4; trainstate._incremental)
    new: bool = False  # a pool file this checkpoint's own save wrote (informational)
