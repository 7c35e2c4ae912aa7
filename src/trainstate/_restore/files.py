"""The bytes of a checkpoint's data files, checked on the way: files mapped once (:class:`DataFiles`), chunks
cut into spans (a piece, or a whole small chunk, with the checksum that covers it), spans grouped into
batches in file order, and batches run on lanes of equal bytes (see read.py for why). Every span is hashed,
then copied: no byte that fails its checksum is written."""

from __future__ import annotations

import errno
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import numpy as np

from trainstate import _checksum as checksum
from trainstate._format import manifest
from trainstate._storage import Storage
from trainstate._transforms import Decoders
from trainstate.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError

BATCH_BYTES = 1 << 20  # small chunks read together, up to this many bytes: one size check, one range
REMOTE_BATCH_BYTES = 64 << 20  # one ranged read where files are not mapped (latency-bound)
_BIG_COPY = 64 << 10  # copies at least this large go through NumPy, which lets the other lanes run
_GAP = 4 << 10  # neighbours this close share a batch (a partial restore leaves larger holes unread)


class DataFiles:
    """The checkpoint's data files: mapped at open where the storage maps files, read by range elsewhere.

    Mapping at open keeps a checkpoint readable if it is deleted later (POSIX). Every access to a map goes
    through :meth:`mapped`, which checks the file's current size first: a file truncated since (by a user,
    a sync tool, a full disk) leaves the map longer than the file, and touching a page past the new end
    kills the process with SIGBUS instead of raising.
    """

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path
        self.where: dict[str, str] = {}  # files stored outside the checkpoint (a run's shared pool) -> path
        self._maps: dict[str, mmap.mmap | memoryview | None] = {}
        self._lock = threading.Lock()

    def location(self, file: str) -> str:
        """Where a data file the manifest lists is: in the checkpoint, or (pool files) in its run's pool."""
        return self.where.get(file) or self.storage.join(self.path, file)

    def map(self, file: str) -> mmap.mmap | memoryview | None:
        maps = self._maps
        if file in maps:
            return maps[file]
        with self._lock:
            if file not in maps:
                mappable = self.storage.capabilities.memory_map
                maps[file] = self.storage.map(self.location(file)) if mappable else None
            return maps[file]

    def mapped(self, mm: mmap.mmap | memoryview, file: str, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` of a mapped file, once the file is known to still hold them."""
        size = _backed(mm)  # the file's size now, not the map's length
        if end > size:
            raise CorruptCheckpointError(
                f"data file {file} of {self.path} now has {size} bytes, but the manifest needs bytes up to "
                f"{end}: it was truncated after the checkpoint was opened. Do not modify checkpoint files "
                "while they are read; load another checkpoint"
            )
        with memoryview(mm) as whole:
            return whole[begin:end]

    def pread(self, file: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``file`` at ``offset``."""
        mm = self.map(file)  # mapped at open: still readable if the checkpoint was deleted since
        if mm is not None:
            with self.mapped(mm, file, offset, offset + len(view)) as src:
                view[:] = src
            return
        try:
            got = self.storage.read_into(self.location(file), offset, view)
        except StorageError as e:
            if e.errno == errno.ENOENT:  # retention, a user, or an overwrite's cleanup removed it meanwhile
                raise CheckpointNotFoundError(
                    f"{self.path} was deleted while it was being read: its data file {file} is gone (deleted, "
                    "or dropped by an overwrite of the checkpoint). Open it again, or load another checkpoint"
                ) from e
            raise
        if got != len(view):
            raise CorruptCheckpointError(f"{file} ended before byte {offset + len(view)}: it was truncated")

    def stored(self, c: manifest.Chunk, verify: bool, what: str) -> memoryview:
        """A chunk's stored bytes, checked (piece by piece where it has pieces) before anyone copies them."""
        begin, end = c.byte_range
        if begin == end:
            return memoryview(b"")
        return self._checked(c.file, begin, end, chunk_spans(c, None, what) if verify else [])

    def _checked(self, file: str, lo: int, hi: int, spans: list[Span]) -> memoryview:
        """Bytes ``[lo, hi)`` of ``file`` (mapped, or read into a buffer), each of ``spans`` checked."""
        mm = self.map(file)
        if mm is not None:
            view = self.mapped(mm, file, lo, hi)
        else:
            view = memoryview(bytearray(hi - lo))
            self.pread(file, view, lo)
        try:
            for span in spans:
                check_span(view[span.begin - lo : span.end - lo], span)
        except BaseException:
            view.release()
            raise
        return view

    def rows(self, c: manifest.Chunk, rows: tuple[int, int], verify: bool, what: str) -> memoryview:
        """Rows ``[rows)`` (along the first dimension) of a chunk's stored bytes, checked.

        A chunk with pieces is read and checked only over the pieces that cover those rows; any other chunk
        is read and checked whole.
        """
        begin, end = c.byte_range
        row_bytes = (end - begin) // max(1, c.shape[0]) if c.shape else end - begin
        lo, hi = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        p = c.pieces
        if p is None or (lo == begin and hi == end) or lo >= hi:
            with self.stored(c, verify, what) as whole:
                return whole[lo - begin : hi - begin]
        first, last = (lo - begin) // p.size, (hi - begin - 1) // p.size
        span_lo, span_hi = begin + first * p.size, min(end, begin + (last + 1) * p.size)
        spans = chunk_spans(c, None, what)[first : last + 1] if verify else []
        return self._checked(c.file, span_lo, span_hi, spans)[lo - span_lo : hi - span_lo]

    def close(self) -> None:
        with self._lock:
            for mm in self._maps.values():
                try:
                    if mm is not None:  # a view lent by the storage: released, its owner is free again
                        mm.close() if isinstance(mm, mmap.mmap) else mm.release()
                except BufferError:
                    pass  # arrays handed out still use it; it closes when they go
            self._maps.clear()


def _backed(mm: mmap.mmap | memoryview) -> int:
    """How many bytes of a map the file under it still holds (all of a view of plain memory).

    A view may be part of a mapped file (a packed checkpoint's member): then it is the file's size now,
    less where the view starts in the map, that counts.
    """
    if isinstance(mm, mmap.mmap):
        return mm.size()
    owner = mm.obj
    if not isinstance(owner, mmap.mmap) or not mm.nbytes:
        return mm.nbytes
    start = np.frombuffer(mm, np.uint8).ctypes.data - np.frombuffer(owner, np.uint8).ctypes.data
    return max(0, min(mm.nbytes, owner.size() - start))


# -- spans and batches ------------------------------------------------------------------------------


class Span(NamedTuple):
    """Stored bytes ``[begin, end)`` of one file, the checksum over them, and where they land."""

    begin: int
    end: int
    dst: memoryview | None  # flat bytes to fill; None to check only
    checksum: str  # the manifest's checksum string over these bytes
    what: str  # the tensor, for messages
    piece: int  # index among the chunk's pieces; -1 for a whole chunk
    pieces: int


@dataclass(slots=True)
class Batch:
    """Spans of one file read together, or (``fill`` set) a tensor stored as several boxes."""

    file: str
    begin: int
    end: int
    spans: list[Span]
    fill: Callable[[], None] | None = None


def chunk_spans(c: manifest.Chunk, dst: memoryview | None, what: str) -> list[Span]:
    begin, end = c.byte_range
    p = c.pieces
    if p is None:
        return [Span(begin, end, dst, c.checksum, what, -1, 1)]
    n = len(p.checksums)
    return [
        Span(b, min(b + p.size, end), None if dst is None else dst[b - begin : b + p.size - begin], s, what, i, n)
        for i, (b, s) in enumerate(zip(range(begin, end, p.size), p.checksums))
    ]


def check_span(src: memoryview, span: Span) -> None:
    found = checksum.value_of(src)
    if found != checksum.expected_value(span.checksum, span.what):
        where = span.what if span.piece < 0 else f"{span.what}, piece {span.piece + 1} of {span.pieces}"
        raise checksum.mismatch(f"{where} (bytes {span.begin}-{span.end})", span.checksum, found)


def batching(storage: Storage, total: int, verify: bool, threads: int) -> tuple[int, int]:
    """(batch limit, lanes) for reading ``total`` bytes of spans: where files are not mapped (object stores),
    larger ranged reads and more of them at once (latency-bound); enough batches for every lane."""
    caps = storage.capabilities
    remote = bool(caps.target_file_bytes)
    threads = max(threads, caps.read_parallelism)
    limit = REMOTE_BATCH_BYTES if remote or not verify else BATCH_BYTES
    return max(1, min(limit, -(-total // max(1, threads)))), threads


def batch_spans(spans_by_file: list[tuple[str, Span]], limit: int) -> list[Batch]:
    """Spans (sorted by file and offset) grouped: close neighbours together up to ``limit`` bytes."""
    out: list[Batch] = []
    for file, s in spans_by_file:
        last = out[-1] if out else None
        if (
            last is not None
            and last.file == file
            and last.fill is None
            and s.end - last.begin <= limit
            and last.end <= s.begin <= last.end + _GAP
        ):
            last.spans.append(s)
            last.end = s.end
        else:
            out.append(Batch(file, s.begin, s.end, [s]))
    return out


def _run_batch(files: DataFiles, b: Batch, verify: bool) -> None:
    if b.fill is not None:
        b.fill()
        return
    mm = files.map(b.file)
    if mm is not None:
        src = files.mapped(mm, b.file, b.begin, b.end)
    else:
        only = b.spans[0].dst if len(b.spans) == 1 and not verify else None
        if only is not None:  # unchecked and alone: straight into its destination
            files.pread(b.file, only, b.begin)
            return
        src = memoryview(bytearray(b.end - b.begin))
        files.pread(b.file, src, b.begin)
    base = b.begin
    with src:
        for s in b.spans:
            piece = src[s.begin - base : s.end - base]
            if verify:
                check_span(piece, s)
            if s.dst is None:
                continue
            if s.end - s.begin >= _BIG_COPY:
                np.copyto(np.frombuffer(s.dst, np.uint8), np.frombuffer(piece, np.uint8))
            else:
                s.dst[:] = piece


def _split_by_bytes(jobs: list[Any], sizes: list[int], lanes: int) -> list[list[Any]]:
    """Cut an ordered job list into at most ``lanes`` contiguous runs of about equal bytes."""
    total = sum(sizes) or 1
    out: list[list[Any]] = [[]]
    acc = 0
    for job, size in zip(jobs, sizes):
        if acc >= total * len(out) / lanes and len(out) < lanes:
            out.append([])
        out[-1].append(job)
        acc += size
    return [lane for lane in out if lane]


def run_lanes(files: DataFiles, batches: list[Batch], verify: bool, threads: int) -> None:
    run_jobs([partial(_run_batch, files, b, verify) for b in batches], [b.end - b.begin for b in batches], threads)


def run_jobs(jobs: list[Callable[[], None]], sizes: list[int], threads: int) -> None:
    """Run ``jobs`` (in file order) on up to ``threads`` lanes of about equal bytes, each lane front to back;
    the first failure stops every lane before its next job, and is raised."""
    lanes = _split_by_bytes(jobs, sizes, max(1, threads))
    failed = threading.Event()

    def run(lane: list[Callable[[], None]]) -> None:
        for job in lane:
            if failed.is_set():
                return
            try:
                job()
            except BaseException:
                failed.set()
                raise

    if len(lanes) <= 1:
        for lane in lanes:
            run(lane)
        return
    with ThreadPoolExecutor(len(lanes), thread_name_prefix="trainstate-read") as pool:
        futures = [pool.submit(run, lane) for lane in lanes]
    for f in futures:
        f.result()


# -- the readers --------------------------------------------------------------------------------------


Box = tuple[tuple[int, ...], tuple[int, ...]]  # offset and shape of a part of a tensor


def meets(c: manifest.Chunk, region: Box) -> bool:
    return all(co < ro + rs and ro < co + cs for co, cs, ro, rs in zip(c.offset, c.shape, *region)) and all(region[1])


class Opened(Protocol):
    """What reading, planning and restoring need of an open checkpoint (:class:`~trainstate._restore.checkpoint.
    Checkpoint` is one): the modules below ``checkpoint.py`` name this, never the class that imports them."""

    storage: Storage
    files: DataFiles
    decoders: Decoders
    manifest: manifest.Manifest

    @property
    def metadata(self) -> Any: ...

    def verify_headers(self) -> None: ...
