"""Many tensors' chunks as columns: the manifest's tensor table of a save by many ranks.

A collective save of R ranks x T sharded tensors commits R x T chunks (a million at 1,024 x 1,000). As
Python objects — a Chunk with its tuples and strings each — they cost microseconds apiece to receive,
merge and serialize: seconds on rank 0 while every rank waits for the commit. Here they stay NumPy
columns from the ranks' messages to the manifest's bytes. The canonical JSON of the chunks
(docs/format.md, the same bytes ``json.dumps`` gives) is laid out as one byte matrix, a row per chunk with
zero bytes for padding, and the padding squeezed out in one pass. Looking a tensor up builds its
:class:`~trainstate._format.entries.TensorEntry`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np

from trainstate._cores import DEFAULT_THREADS
from trainstate._format.entries import Chunk, Pieces, TensorEntry

Header = tuple[str, str, tuple[int, ...]]  # dtype code, kind, global shape

# Bytes a JSON string may hold as they are (ASCII, printable, no quote or backslash); 0 is padding.
_PLAIN = np.zeros(256, dtype=bool)
_PLAIN[0x20:0x7F] = True
_PLAIN[[0x22, 0x5C]] = False
_PLAIN[0] = True  # padding, if only at the end (checked apart)
_PLAIN_BYTES = bytes(np.flatnonzero(_PLAIN).astype(np.uint8))


class ChunkTable(Mapping[str, "TensorEntry"]):
    """Tensors ``names[i]`` (``headers[i]``) and their chunks, one row each, grouped by tensor and ordered
    by offset within one.

    Row ``k`` is a box (``offsets[k]``, ``shapes[k]``: the first ``len(headers[tensor[k]][2])`` columns)
    of tensor ``tensor[k]``, stored in ``files[file[k]]`` at ``ranges[k]`` with checksum ``checksums[k]``
    (bytes, ASCII) and, for large chunks, ``pieces[k]``; a transformed (compressed) chunk's transforms are
    ``transforms[k]`` (sparse as ``pieces``: a chunk stored raw has none).
    """

    def __init__(
        self,
        names: list[str],
        headers: list[Header],
        tensor: np.ndarray,
        offsets: np.ndarray,
        shapes: np.ndarray,
        files: list[str],
        file: np.ndarray,
        ranges: np.ndarray,
        checksums: np.ndarray,
        pieces: dict[int, Pieces],
        transforms: dict[int, tuple[dict[str, Any], ...]] | None = None,
    ) -> None:
        self.names, self.headers = names, headers
        self.tensor, self.offsets, self.shapes = tensor, offsets, shapes
        self.files, self.file, self.ranges, self.checksums, self.pieces = files, file, ranges, checksums, pieces
        self.transforms = {k: t for k, t in (transforms or {}).items() if t}
        self._ids = {name: i for i, name in enumerate(names)}
        cut = np.flatnonzero(np.diff(tensor)) + 1
        begin = np.r_[0, cut] if len(tensor) else np.zeros(0, np.int64)
        self._rows = dict(zip(tensor[begin].tolist(), zip(begin.tolist(), np.r_[cut, len(tensor)].tolist())))

    def __getitem__(self, name: str) -> TensorEntry:

        i = self._ids[name]
        dtype, kind, shape = self.headers[i]
        begin, end = self._rows.get(i, (0, 0))
        d = len(shape)
        chunks = tuple(
            Chunk(
                self.files[int(self.file[k])],
                (int(self.ranges[k, 0]), int(self.ranges[k, 1])),
                tuple(self.offsets[k, :d].tolist()),
                tuple(self.shapes[k, :d].tolist()),
                self.checksums[k].decode(),
                self.transforms.get(k, ()),
                self.pieces.get(k),
            )
            for k in range(begin, end)
        )
        return TensorEntry(dtype, shape, kind, chunks)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._ids

    def canonical_json(self) -> bytes | None:
        """The ``tensors`` object of the manifest as canonical JSON, or None where a string in it would need
        escaping (the caller then takes the general path)."""
        parts = self.canonical_json_parts()
        return None if parts is None else b"".join(parts)

    def canonical_json_parts(self, lines: bool = False) -> list[bytes | memoryview] | None:
        """:meth:`canonical_json` in pieces, for a caller that joins it with more (one copy, not two); with
        ``lines``, in the manifest's line layout (``manifest_lines.py``): each tensor on a line of its own."""
        files = np.array(self.files, dtype="S") if self.files else np.zeros(0, "S1")
        if not (_plain(self.checksums) and _plain(files)) or (self.ranges < 0).any() or (self.offsets < 0).any():
            return None
        n, width = len(self.tensor), self.offsets.shape[1]
        dims = np.array([len(h[2]) for h in self.headers], dtype=np.int64)[self.tensor]
        rows = _Rows(n)
        rows.text('{"byte_range":[')
        rows.digits(self.ranges[:, 0])
        rows.text(",")
        rows.digits(self.ranges[:, 1])
        rows.text('],"checksum":"')
        rows.strings(_bytes(self.checksums))
        rows.text('","file":"')
        rows.strings(_bytes(files)[self.file])
        rows.text('","offset":[')
        rows.numbers(self.offsets, dims, width)
        rows.text("]")
        before = rows.lengths.copy()  # where a chunk's "pieces" member goes: after "offset"
        rows.text(',"shape":[')
        rows.numbers(self.shapes, dims, width)
        rows.text("]")
        after = rows.lengths.copy()  # and its "transforms" member: after "shape", the last in key order
        rows.text("},")
        text, starts = rows.squeezed()
        # what goes into the rows' text, in the order of the places it goes (a row's pieces before its transforms)
        inserts = sorted(
            [(int(starts[k] + before[k]), 0, k) for k in self.pieces]
            + [(int(starts[k] + after[k]), 1, k) for k in self.transforms]
        )
        places = [at for at, _, _ in inserts]
        out: list[bytes | memoryview] = [b"{"]
        tails: dict[Header, bytes] = {}  # a model has a few distinct headers
        for j, name in enumerate(sorted(self._ids)):
            i = self._ids[name]
            header = self.headers[i]
            first, last = self._rows.get(i, (0, 0))
            out.append((b",\n" if j else b"\n") if lines else (b"," if j else b""))
            out.append(encode_basestring_ascii(name).encode() + b':{"chunks":[')
            begin, end = int(starts[first]), int(starts[last]) - (last > first)  # the last row's "," dropped
            for k in range(bisect.bisect_left(places, begin), bisect.bisect_left(places, end)):
                at, what, row = inserts[k]
                member = _pieces_json(self.pieces[row]) if what == 0 else _transforms_json(self.transforms[row])
                out += [text[begin:at], member]
                begin = at
            out.append(text[begin:end])
            tail = tails.get(header)
            if tail is None:
                dtype, kind, shape = header
                tail = tails[header] = b'],"dtype":%s,"kind":%s,"shape":%s}' % (
                    _dumps(dtype),
                    _dumps(kind),
                    _dumps(shape),
                )
            out.append(tail)
        out.append(b"\n}" if lines and self._ids else b"}")
        return out


class _Rows:
    """Lines of text built a field at a time for all rows at once. Each field is a (width, rows) uint8
    block — a row's text runs down a column, so every write is long and contiguous — with zero bytes as
    padding, squeezed out at the end."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.blocks: list[np.ndarray] = []
        self.lengths = np.zeros(n, dtype=np.int64)  # each row's text so far, padding left out

    def text(self, literal: str) -> None:
        self.blocks.append(np.frombuffer(literal.encode(), np.uint8)[:, None])
        self.lengths += len(literal)

    def strings(self, rows: np.ndarray) -> None:
        """Byte strings as an (n, width) block, zero-padded on the right."""
        self.blocks.append(rows.T)
        self.lengths += np.count_nonzero(rows, axis=1)

    def digits(self, x: np.ndarray, keep: np.ndarray | None = None) -> None:
        """Non-negative integers in decimal; nothing for the rows where ``keep`` is False."""
        top = int(x.max(initial=0))
        width = len(str(top))
        block = np.empty((width, self.n), dtype=np.uint8)
        rest: np.ndarray = x.astype(np.uint32 if top < 1 << 32 else np.uint64)  # narrow, unsigned: fast division
        for i in range(width - 1, -1, -1):
            quotient: np.ndarray = rest // 10
            block[i] = rest - quotient * 10
            rest = quotient
        block += ord("0")
        count = np.ones(self.n, dtype=np.int64)
        for i in range(width - 1):  # a leading zero (never the last digit) is padding
            big = x >= 10 ** (width - 1 - i)
            block[i] *= big
            count += big
        if keep is not None:
            block *= keep
            count *= keep
        self.blocks.append(block)
        self.lengths += count

    def numbers(self, columns: np.ndarray, dims: np.ndarray, width: int) -> None:
        """The comma-separated first ``dims[k]`` numbers of row ``k`` (a JSON array's inside)."""
        for j in range(width):
            keep = dims > j
            if j:
                self.blocks.append(keep.astype(np.uint8)[None, :] * np.uint8(ord(",")))
                self.lengths += keep
            self.digits(columns[:, j], keep)

    def squeezed(self, threads: int = DEFAULT_THREADS) -> tuple[memoryview, np.ndarray]:
        """Every row's text end to end, and where each row begins (then where the last one ends).

        A block of rows at a time (the block's matrix stays in cache while it is turned row-major and
        squeezed), on ``threads`` threads: NumPy lets go of the GIL for all of it, and on rank 0 of a
        collective save every other rank is waiting for this.
        """
        starts = np.r_[0, np.cumsum(self.lengths)]
        out = np.empty(int(starts[-1]), dtype=np.uint8)
        height = sum(len(b) for b in self.blocks)

        def block(begin: int) -> None:
            end = min(begin + _BLOCK_ROWS, self.n)
            matrix = np.empty((height, end - begin), dtype=np.uint8)
            at = 0
            for b in self.blocks:  # a literal is one column, the same for every row
                matrix[at : at + len(b)] = b if b.shape[1] != self.n else b[:, begin:end]
                at += len(b)
            flat = matrix.T.ravel()  # row after row
            out[starts[begin] : starts[end]] = flat[flat != 0]

        if threads > 1 and self.n > _BLOCK_ROWS:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(block, range(0, self.n, _BLOCK_ROWS)))
        else:
            for begin in range(0, self.n, _BLOCK_ROWS):
                block(begin)
        self.blocks = []
        return out.data, starts


_BLOCK_ROWS = 1 << 14


def _dumps(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _pieces_json(p: Pieces) -> bytes:
    return b',"pieces":' + _dumps({"bytes": p.size, "checksums": p.checksums})


def _transforms_json(t: tuple[dict[str, Any], ...]) -> bytes:
    return b',"transforms":' + _dumps(list(t))


def _plain(strings: np.ndarray) -> bool:
    """Whether fixed-width byte strings need no JSON escaping and hold no zero byte before their end."""
    if not strings.size:
        return True
    if strings.tobytes().translate(None, _PLAIN_BYTES):  # a byte outside the set is left
        return False
    nonzero = _bytes(strings) != 0
    return not (nonzero[:, 1:] & ~nonzero[:, :-1]).any()


def _bytes(strings: np.ndarray) -> np.ndarray:
    """An array of fixed-width byte strings as an (n, width) uint8 block (zero-padded on the right)."""
    return strings.view(np.uint8).reshape(len(strings), strings.dtype.itemsize)
