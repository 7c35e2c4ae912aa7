"""Writing with chunk transforms (compression, encryption): tensors cut into chunks, each encoded on its way
to the data file.

With a :class:`~trainstate._transforms.Pipeline`, every tensor is cut into boxes of at most
``pipeline.chunk_bytes`` raw bytes (:func:`boxes`: runs of whole rows, so each box is one contiguous slice of
the tensor's C-order bytes, and one tensor still reads alone), and each box is encoded into one chunk, hashed
(stored bytes: checksum and pieces, as every chunk; raw bytes: kept in memory for incremental saves) and
handed to the storage before the next is made. Memory stays near one chunk per writer thread.

A data file's safetensors header comes first and lists every entry's byte offsets, known only once the
chunks are encoded. Where the storage can rewrite part of a file it wrote (``capabilities.rewrite``: local
disks) the file begins with room for the largest header its entries could need -- every number in it as
long as the largest the file could hold, since no chunk grows by more than ``MAX_GROWTH`` -- the chunks are
streamed after it, and the real header, padded with spaces to that length (safetensors allows trailing
spaces), is written into the room last. Elsewhere (object stores: one PUT, no seek) the file's encoded
chunks are kept until the last one is made, and the file is written whole with its exact header.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

from trainstate import _checksum as checksum
from trainstate._format import datafile, dtypes, manifest
from trainstate._save.encode import Entry
from trainstate._save.files import PIECE_BYTES, each_file
from trainstate._save.options import SaveOptions
from trainstate._storage import Storage
from trainstate._transforms import Pipeline, Place

_SMALL_BYTES = 64 << 10  # stored chunks under this are gathered into one buffer of up to _GATHER_BYTES
_GATHER_BYTES = 1 << 20

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offset, shape, and its bytes [begin, end) in the tensor


def boxes(shape: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """A tensor cut into boxes of at most ``limit`` bytes, in C order, each a contiguous run of its bytes.

    Cut along the first dimension whose one index holds at most ``limit`` bytes (the first for any tensor
    whose rows are small); the dimensions before it are 1 in every box, the ones after it whole.
    """
    total = math.prod(shape) * itemsize
    if total <= limit or not shape:
        return [((0,) * len(shape), shape, 0, total)]
    inner = [itemsize * math.prod(shape[d + 1 :]) for d in range(len(shape))]  # bytes of one index of dim d
    d = next((d for d in range(len(shape)) if inner[d] <= limit), len(shape) - 1)
    step = max(1, limit // inner[d])
    tail = (0,) * (len(shape) - d - 1)
    out: list[Box] = []
    for lead in itertools.product(*(range(n) for n in shape[:d])):
        base = sum(i * inner[k] for k, i in enumerate(lead))
        for start in range(0, shape[d], step):
            n = min(step, shape[d] - start)
            box = (*(1,) * d, n, *shape[d + 1 :])
            out.append(((*lead, start, *tail), box, base + start * inner[d], base + (start + n) * inner[d]))
    return out


class _Item(NamedTuple):
    """One chunk to write: a box of an entry, and the name its entry has in the data file's header."""

    entry: Entry
    box: Box
    name: str
    plain: bool  # the whole entry in a safetensors dtype: listed as itself when stored untransformed


class _Written(NamedTuple):
    """What was written for one chunk (never its bytes: they are the storage's once handed over)."""

    begin: int  # in the data section
    end: int
    transforms: tuple[dict[str, Any], ...]
    raw_checksum: str
    checksum: str
    pieces: manifest.Pieces | None


def _items(group: list[Entry], limit: int) -> list[_Item]:
    """Every chunk of a data file, named uniquely in its header: an entry of one chunk under its own name,
    chunk ``i`` of a larger one as ``<name>#<i>`` (with ``~`` added while that is taken)."""
    taken = {datafile.header_name(e.name) for e in group}
    out = []
    for e in group:
        cut = boxes(e.shape, dtypes.from_code(e.dtype).itemsize, limit)
        if len(cut) == 1:
            out.append(_Item(e, cut[0], datafile.header_name(e.name), dtypes.from_code(e.dtype).safetensors))
            continue
        for i, box in enumerate(cut):
            name = f"{e.name}#{i}"
            while name in taken:
                name += "~"
            taken.add(name)
            out.append(_Item(e, box, name, False))
    return out


def _member(item: _Item, begin: int, end: int, transformed: bool) -> dict[str, Any]:
    if item.plain and not transformed:
        return {"dtype": item.entry.dtype, "shape": list(item.entry.shape), "data_offsets": [begin, end]}
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def _header(members: list[tuple[str, dict[str, Any]]], length: int | None = None) -> bytes:
    """A safetensors header (length prefix included): padded to a multiple of 8, or with spaces to ``length``."""
    body: dict[str, Any] = {datafile.METADATA_KEY: {"format": "trainstate"}, **dict(members)}
    raw = json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode()
    pad = -(len(raw) + 8) % datafile.ALIGN if length is None else length - 8 - len(raw)
    if pad < 0:  # cannot happen: every number is bounded by the one the room was reserved for
        raise RuntimeError(f"a data file's header needs {8 + len(raw)} bytes, {length} were reserved")
    return struct.pack("<Q", len(raw) + pad) + raw + b" " * pad


def _room(items: list[_Item], pipeline: Pipeline) -> int:
    """The longest header these chunks can have: each member in its longer form, every number as large as
    the data section can be."""
    most = sum(pipeline.stored_bound(i.box[3] - i.box[2]) for i in items)
    members = []
    for i in items:
        forms = [{"dtype": "U8", "shape": [most], "data_offsets": [most, most]}]
        if i.plain:
            forms.append({"dtype": i.entry.dtype, "shape": list(i.entry.shape), "data_offsets": [most, most]})
        members.append((i.name, max(forms, key=lambda m: len(json.dumps(m, separators=(",", ":"))))))
    return len(_header(members))


class _Chunks:
    """A data file's bytes: (optionally) the room for its header, then each chunk encoded when reached.

    Iterable more than once, so a storage may retry an upload from the start; each pass records what it
    wrote in :attr:`written` (encoding is deterministic: every pass writes the same bytes).
    """

    def __init__(self, items: list[_Item], pipeline: Pipeline, room: int) -> None:
        self.items, self.pipeline, self.room = items, pipeline, room
        self.written: list[_Written] = []

    def __iter__(self) -> Iterator[memoryview]:
        self.written = []
        if self.room:
            yield memoryview(b" " * self.room)
        at = 0
        gathered = bytearray()
        for _, items in itertools.groupby(self.items, key=lambda i: id(i.entry)):
            data: memoryview | None = None
            for item in items:
                e = item.entry
                if data is None:
                    data = e.adapter.byte_view(e.value)
                offset, shape, begin, end = item.box
                place = Place(e.name, e.dtype, tuple(o + p for o, p in zip(offset, e.offset)), shape)
                encoded = self.pipeline.encode(data[begin:end], place)
                stored = encoded.stored if isinstance(encoded.stored, memoryview) else memoryview(encoded.stored)
                sums = _sums(stored)
                self.written.append(_Written(at, at + stored.nbytes, encoded.transforms, encoded.raw_checksum, *sums))
                del encoded
                at += stored.nbytes
                if stored.nbytes < _SMALL_BYTES:  # gathered; never changed once handed out (a storage may keep it)
                    if len(gathered) + stored.nbytes > _GATHER_BYTES:
                        yield memoryview(gathered)
                        gathered = bytearray()
                    gathered += stored
                    continue
                if gathered:
                    yield memoryview(gathered)
                    gathered = bytearray()
                yield stored
            # Let go of this tensor before the next one's bytes are made (see write._FileViews); its last
            # chunk, stored raw, may be a view of it.
            del data, stored
            yield memoryview(b"")
        if gathered:
            yield memoryview(gathered)

    def header(self, length: int | None) -> bytes:
        """The real header for what the last pass wrote (``length``: padded to exactly that many bytes)."""
        return _header(
            [(i.name, _member(i, w.begin, w.end, bool(w.transforms))) for i, w in zip(self.items, self.written)],
            length,
        )


def _sums(stored: memoryview) -> tuple[str, manifest.Pieces | None]:
    """The stored bytes' checksum, and per-piece checksums when they span more than one piece."""
    if stored.nbytes <= PIECE_BYTES:
        return checksum.digest(stored), None
    whole, sums = checksum.Hasher(), []
    for begin in range(0, stored.nbytes, PIECE_BYTES):
        piece = stored[begin : begin + PIECE_BYTES]
        sums.append(checksum.digest(piece))
        whole.update(piece)
    return whole.result(), manifest.Pieces(PIECE_BYTES, tuple(sums))


def _write_file(
    storage: Storage, path: str, group: list[Entry], pipeline: Pipeline, fsync: bool
) -> tuple[int, bytes, _Chunks]:
    """Write one data file; its size, header and the chunks as written."""
    items = _items(group, pipeline.chunk_bytes)
    if storage.capabilities.rewrite:
        room = _room(items, pipeline)
        chunks = _Chunks(items, pipeline, room)
        size = storage.write(path, chunks, fsync=False)
        header = chunks.header(room)
        try:
            storage.rewrite(path, 0, header, fsync=fsync)
            return size, header, chunks
        except NotImplementedError:  # a wrapper that forwards the capability but not the method
            storage.delete(path)
    chunks = _Chunks(items, pipeline, 0)
    views = list(chunks)  # the whole file's stored bytes, until the header is known
    header = chunks.header(None)
    size = storage.write(path, [memoryview(header), *views], fsync=fsync)
    return size, header, chunks


def write_encoded(
    storage: Storage,
    tmp: str,
    entries: list[Entry],
    groups: list[list[Entry]],
    names: list[str],
    pipeline: Pipeline,
    options: SaveOptions,
) -> tuple[tuple[manifest.FileEntry, ...], dict[str, manifest.TensorEntry]]:
    """:func:`~trainstate._save.write.write_data` with transforms (``pipeline``: ``options.encoding``): each
    group of entries as a data file of encoded chunks, ``options.writers(storage)`` files at once; the files'
    and the tensors' manifest entries."""

    def write(name: str, group: list[Entry]) -> tuple[int, bytes, _Chunks]:
        return _write_file(storage, storage.join(tmp, name), group, pipeline, options.fsync)

    results = each_file(write, names, groups, options.writers(storage))
    files = []
    found: dict[str, list[manifest.Chunk]] = {}
    for name, (size, header, chunks) in zip(names, results):
        files.append(manifest.FileEntry(name, size, checksum.digest(header)))
        for item, w in zip(chunks.items, chunks.written):
            e, (offset, shape, _, _) = item.entry, item.box
            found.setdefault(e.name, []).append(
                manifest.Chunk(
                    name,
                    (len(header) + w.begin, len(header) + w.end),
                    tuple(o + p for o, p in zip(offset, e.offset)),
                    shape,
                    w.checksum,
                    w.transforms,
                    w.pieces,
                    w.raw_checksum,
                )
            )
    tensors = {e.name: manifest.TensorEntry(e.dtype, e.global_shape, e.kind, tuple(found[e.name])) for e in entries}
    return tuple(files), tensors
