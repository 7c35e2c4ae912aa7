"""The packed checkpoint: one checkpoint's files in one aligned, uncompressed archive (docs/format.md §10).

A packed checkpoint is what an application embeds (a model shipped inside a package, read from memory),
so the layout serves a reader that holds the whole archive as one buffer: a fixed 32-byte header, a small
JSON index, then each file of the checkpoint, unchanged, at a multiple of :data:`ALIGN`. A tensor's bytes
are then a slice of the buffer, as aligned as they are in the data file mapped from disk, and are read
without a copy. Everything a reader trusts is checked before any member is handed out: the header and the
index by the checksum in the header, the members by the checkpoint's own checksums (the manifest's, the
data-file headers', every tensor's), and every byte in between (padding) must be zero.

This module only lays out and checks the header and the index; ``_convert/pack.py`` writes archives and
``_storage/packed.py`` reads them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from trainstate import _checksum as checksum
from trainstate._format import manifest
from trainstate.errors import CorruptCheckpointError, FormatVersionError, InvalidArgumentError

MAGIC = b"\x89TSPACK\n"  # a high byte, the name, a newline: text-mode transfers and wrong files fail at once
MAJOR, MINOR = 1, 0
ALIGN = 4096  # every member starts on a page: aligned like a mapped file, and mappable on its own
HEADER = struct.Struct("<8sHHIQQ")  # magic, major, minor, index length, archive length, checksum
MAX_INDEX = 64 << 20  # a million files' worth; more is a damaged length, not an index
_SUMMED = 24  # the checksum covers the header before it, then the index
# An entry {"length":0,"name":"x","offset":0}, is 4 JSON values (braces, commas) in 35 bytes or more. An
# index packed tighter than 1 value per 8 bytes is forged ([{},{},...] or [1.5,1.5,...]), and refused
# before it is parsed: parsed, each of its values would be a Python object many times its bytes.
_BYTES_PER_VALUE = 8


@dataclass(frozen=True)
class Member:
    """One file of the checkpoint inside the archive: bytes ``[offset, offset + length)``."""

    name: str
    offset: int
    length: int


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def layout(files: list[tuple[str, int]]) -> tuple[bytes, list[Member], int]:
    """Where each ``(name, length)`` goes, in order: the head (header + index), the members, the total.

    The head is to be followed by zeros up to the first member, each member by zeros up to the next one;
    the archive ends with its last member.
    """
    start = padded(HEADER.size)
    while True:  # the index holds the offsets, which depend on the index's length: settle in a step or two
        members, at = [], start
        for name, length in files:
            members.append(Member(name, at, length))
            at = padded(at + length)
        total = members[-1].offset + members[-1].length if members else start
        index = _index_json(members)
        if padded(HEADER.size + len(index)) == start:
            break
        start = padded(HEADER.size + len(index))
    head = HEADER.pack(MAGIC, MAJOR, MINOR, len(index), total, 0)[:_SUMMED]
    return head + struct.pack("<Q", checksum.value_of(head + index)) + index, members, total


def _index_json(members: list[Member]) -> bytes:
    body = {"files": [{"name": m.name, "offset": m.offset, "length": m.length} for m in members]}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def read_index(data: memoryview, what: str) -> tuple[list[Member], int]:
    """Check an archive's header, index and padding; its members (in order) and its length.

    ``data`` may run on past the archive (an archive embedded in a larger file); it may not stop short.

    Raises:
        InvalidArgumentError: ``data`` is not a packed checkpoint at all.
        FormatVersionError: packed by a newer trainstate.
        CorruptCheckpointError: truncated, or damaged anywhere outside the members.
    """
    size = data.nbytes
    if size < HEADER.size:
        if size and bytes(data[: len(MAGIC)]) == MAGIC[: min(size, len(MAGIC))]:
            raise CorruptCheckpointError(
                f"{what} is truncated: {size} bytes, where the header of a packed checkpoint alone has "
                f"{HEADER.size}. Copy the whole file again"
            )
        raise _not_packed(data, what)
    magic, major, minor, n, total, summed = HEADER.unpack(data[: HEADER.size])
    if magic != MAGIC:
        raise _not_packed(data, what)
    if major > MAJOR:
        raise FormatVersionError(
            f"{what} was packed by a newer trainstate (archive version {major}.{minor}; this one reads "
            f"{MAJOR}.x): upgrade trainstate to read it"
        )
    if major < MAJOR:
        raise CorruptCheckpointError(f"{what}: archive version {major}.{minor} does not exist: the header is damaged")
    if n > MAX_INDEX or HEADER.size + n > size:
        raise CorruptCheckpointError(
            f"{what}: the header says an index of {n} bytes follows it, but only {size - HEADER.size} bytes do: "
            "the archive is truncated or damaged"
        )
    index = data[HEADER.size : HEADER.size + n]
    if checksum.value_of(bytes(data[:_SUMMED]) + bytes(index)) != summed:
        raise CorruptCheckpointError(
            f"{what}: checksum mismatch in the archive's header or index: the archive is damaged; pack the "
            "checkpoint again"
        )
    if total > size:
        raise CorruptCheckpointError(
            f"{what} is truncated: the archive is {total} bytes, only {size} are here. Copy the whole file again"
        )
    members = _members(index, what)
    _check_places(data, members, HEADER.size + n, total, what)
    return members, total


def _not_packed(data: memoryview, what: str) -> InvalidArgumentError:
    start = bytes(data[:16])
    return InvalidArgumentError(
        f"{what} is not a packed trainstate checkpoint: expected {len(MAGIC)} bytes {MAGIC!r} at its start, got "
        f"{data.nbytes} bytes starting {start!r}. Make one with trainstate.pack(CKPT), or pass a directory's "
        "path as a str"
    )


def _members(index: memoryview, what: str) -> list[Member]:
    """The index's entries, each with a legal, unique name and integer place (places are checked after)."""
    raw = bytes(index)
    values = raw.count(b",") + raw.count(b"{") + raw.count(b"[")  # each value past the first adds a comma
    if values * _BYTES_PER_VALUE > len(raw) + _BYTES_PER_VALUE:
        raise CorruptCheckpointError(
            f"{what}: the archive's index is malformed ({values} JSON values in {len(raw)} bytes; an index entry "
            f"takes at least {4 * _BYTES_PER_VALUE} bytes for its 4)"
        )
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or set(body) != {"files"} or not isinstance(body["files"], list):
            raise TypeError("the index is not {'files': [...]}")
        members = []
        for e in body["files"]:
            if not isinstance(e, dict) or set(e) != {"name", "offset", "length"}:
                raise TypeError(f"an entry is not {{name, offset, length}}: {e!r:.80}")
            name, offset, length = e["name"], e["offset"], e["length"]
            if any(type(v) is not int or v < 0 for v in (offset, length)):
                raise TypeError(f"{name!r:.80}: offset and length are not non-negative ints")
            if name != manifest.MANIFEST_NAME:
                manifest.check_file_name(name)
            members.append(Member(name, offset, length))
    except (ValueError, TypeError, KeyError, RecursionError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{what}: the archive's index is malformed ({e})") from None
    names = [m.name for m in members]
    if len(set(names)) != len(names) or manifest.MANIFEST_NAME not in names:
        raise CorruptCheckpointError(
            f"{what}: the archive's index must list {manifest.MANIFEST_NAME} and each file once, lists {names!r:.200}"
        )
    return members


def _check_places(data: memoryview, members: list[Member], head_end: int, total: int, what: str) -> None:
    """Members in order, aligned, not overlapping, ending the archive; every byte between them zero."""
    at = head_end
    for m in members:
        if m.offset != padded(at):
            raise CorruptCheckpointError(
                f"{what}: {m.name} is placed at byte {m.offset}, not at the first multiple of {ALIGN} after byte "
                f"{at}: the archive's index is damaged"
            )
        _zeros(data, at, m.offset, what)
        at = m.offset + m.length
    if at != total:
        raise CorruptCheckpointError(
            f"{what}: the archive's last file ends at byte {at}, the header says the archive ends at {total}"
        )


def _zeros(data: memoryview, begin: int, end: int, what: str) -> None:
    if bytes(data[begin:end]).count(0) != end - begin:
        raise CorruptCheckpointError(
            f"{what}: the padding in bytes [{begin}, {end}) of the archive is not zero: the archive is damaged"
        )
