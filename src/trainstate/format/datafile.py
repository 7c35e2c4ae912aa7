"""Data files laid out as safetensors.

A data file is ``u64 little-endian header length N`` + ``N bytes of JSON header`` (padded with spaces to a
multiple of 8) + the tensor bytes, back to back with no holes. The header maps each stored name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the end of the header, exactly
as safetensors expects, so ``safetensors.safe_open`` reads any file whose entries use safetensors dtypes.
Entries whose bytes are not a plain tensor (an unknown-to-safetensors dtype, a partial chunk, transformed
bytes) are listed as ``U8`` of their byte length.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..errors import CorruptCheckpointError

ALIGN = 8
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: list[HeaderEntry], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Serialize a header for ``entries`` in order; returns the header bytes and each entry's file offset."""
    body: dict[str, object] = {"__metadata__": metadata}
    rel = 0
    rel_offsets = []
    for e in entries:
        body[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [rel, rel + e.nbytes]}
        rel_offsets.append(rel)
        rel += e.nbytes
    raw = json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-(len(raw) + 8) % ALIGN)
    header = struct.pack("<Q", len(raw)) + raw
    return header, [len(header) + r for r in rel_offsets]


def parse_header(blob: bytes, file_size: int, what: str) -> dict[str, object]:
    """Parse and bounds-check a header read from the start of a file of ``file_size`` bytes."""
    if len(blob) < 8:
        raise CorruptCheckpointError(f"{what}: file too short for a header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER or 8 + n > file_size or 8 + n > len(blob):
        raise CorruptCheckpointError(f"{what}: header length {n} does not fit a file of {file_size} bytes")
    try:
        header = json.loads(blob[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{what}: header is not a JSON object")
    return header


def header_length(prefix: bytes) -> int:
    """Total header size (length prefix included) from the first 8 bytes of a file."""
    return 8 + int(struct.unpack("<Q", prefix[:8])[0])
