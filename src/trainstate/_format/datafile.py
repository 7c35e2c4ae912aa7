"""Data files laid out as safetensors.

A data file is ``u64 little-endian header length N`` + ``N bytes of JSON header`` (padded with spaces to a
multiple of 8) + the tensor bytes, back to back with no holes. The header maps each stored name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the end of the header, exactly
as safetensors expects, so ``safetensors.safe_open`` reads any file whose entries use safetensors dtypes.
Entries whose bytes are not a plain tensor (an unknown-to-safetensors dtype, a partial chunk, transformed
bytes) are listed as ``U8`` of their byte length.

The header's own ``__metadata__`` key is reserved by safetensors, so a tensor whose name is ``__metadata__``
(``{"__metadata__": tensor}``) is listed under another name: see :func:`header_name`. The manifest keeps the
user's name; only the header entry is renamed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from trainstate.errors import CorruptCheckpointError

ALIGN = 8
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
METADATA_KEY = "__metadata__"  # safetensors' reserved header key: string metadata, not a tensor


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def header_name(name: str) -> str:
    """The name a tensor is listed under in a data file's header.

    ``__metadata__`` followed by zero or more ``~`` gets one more ``~`` (``__metadata__`` is listed as
    ``__metadata__~``); every other name is kept. The mapping is one-to-one, so header names stay unique,
    and it leaves the reserved key to the header's string metadata, as safetensors readers expect.
    """
    return name + "~" if name.rstrip("~") == METADATA_KEY else name


def build_header(entries: list[HeaderEntry], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Serialize a header for ``entries`` (named as in the manifest) in order.

    Returns the header bytes and each entry's file offset.
    """
    body: dict[str, object] = {METADATA_KEY: metadata}
    rel = 0
    rel_offsets = []
    for e in entries:
        entry = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [rel, rel + e.nbytes]}
        body[header_name(e.name)] = entry
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
