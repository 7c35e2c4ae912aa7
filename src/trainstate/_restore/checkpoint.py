"""open(): a lazy, validated view of one checkpoint.

Opening reads only the manifest and stats the data files; tensors are read when asked, each one checked
against its checksum. Reads go straight into the destination's memory (``preadv``) or, for a single
tensor, through a memory map of the data file. Files are opened with ``O_NOFOLLOW`` and every name and byte
range was validated by the manifest parser, so nothing outside the checkpoint is ever touched. A mapped
range is checked against the file's current size before it is touched (see ``Checkpoint._mapped``), so a
data file truncated while the checkpoint is open is a CorruptCheckpointError, not a SIGBUS.
"""

from __future__ import annotations

import difflib
import errno
import math
import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from trainstate import _tree as tree
from trainstate._format import checksum, datafile, dtypes, manifest
from trainstate._frameworks import NUMPY, adapter_for, adapter_named
from trainstate._storage import Storage, resolve
from trainstate.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnknownKeyError,
)

MAX_MANIFEST = manifest.MAX_BYTES


@dataclass(frozen=True)
class TensorInfo:
    """What the manifest says about one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    chunks: int


class Checkpoint:
    """A committed checkpoint opened for reading. Use as a context manager.

    Example:
        >>> with trainstate.open("ckpt/step_1200") as ck:
        ...     w = ck.read("model.fc.weight")
    """

    def __init__(self, path: str | os.PathLike[str], storage: Storage | None = None) -> None:
        self.storage, self.path = resolve(path, storage)
        self._maps: dict[str, mmap.mmap | None] = {}
        self._lock = threading.Lock()
        try:
            self.manifest = _read_manifest(self.storage, self.path)
            self._check_files()
            for f in self.manifest.files:  # map now: a checkpoint deleted after this stays readable (POSIX)
                self._map(f.path)
        except StorageError as e:
            if e.errno == errno.ENOENT:  # retention (or a user) deleted it under our feet
                raise CheckpointNotFoundError(f"{self.path} was deleted while it was being opened") from e
            raise

    # -- what is in it -------------------------------------------------------------------------

    @property
    def metadata(self) -> Any:
        return tree.decode(self.manifest.metadata)

    @property
    def created(self) -> float:
        return self.manifest.created

    def keys(self) -> list[str]:
        """Tensor names, in the order they appear in the saved state."""
        return list(dict.fromkeys(tree.tensor_names(self.manifest.tree)))

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self._entry(name)
        return TensorInfo(name, t.dtype, t.shape, t.nbytes, t.kind, len(t.chunks))

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    # -- reading --------------------------------------------------------------------------------

    def read(self, name: str, *, framework: str = "numpy", verify: bool = True) -> Any:
        """One tensor, memory-mapped when it is stored in one piece; checked against its checksum.

        Args:
            name: a name from :meth:`keys`.
            framework: ``"numpy"`` (read-only, memory-mapped array) or ``"torch"`` (a tensor of its own).
                A memory-mapped array reads the file for as long as it lives; copy it (``np.array``) if the
                file may be truncated meanwhile.
            verify: check the checksum (touches every byte once).
        """
        t = self._entry(name)
        mm = self._map(t.chunks[0].file) if len(t.chunks) == 1 and t.nbytes else None
        if mm is not None:
            c = t.chunks[0]
            view = self._mapped(mm, c.file, *c.byte_range)  # the array keeps it (and the mapping) alive
            if verify:
                checksum.check(view, c.checksum, f"tensor {name} ({c.file})")
            array = np.frombuffer(view, dtype=dtypes.from_code(t.dtype).numpy, count=math.prod(t.shape)).reshape(
                t.shape
            )
            if framework == "torch":
                return adapter_named("torch").from_numpy(array.copy())
            return NUMPY.finish(array, t.kind)
        adapter = adapter_named(framework)
        out = adapter.empty(t.dtype, t.shape)
        self.read_into(name, out, verify=verify)
        return adapter.finish(out, t.kind)

    def read_into(self, name: str, out: Any, *, verify: bool = True) -> None:
        """Read tensor ``name`` into the contiguous host array ``out`` of the right size."""
        t = self._entry(name)
        adapter = adapter_for(out) or NUMPY
        view = adapter.writable_view(out)
        if view is None or view.nbytes != t.nbytes:
            raise ValueError(f"read_into needs a contiguous host array of {t.nbytes} bytes for {name}")
        dst = np.frombuffer(view, dtype=np.uint8)
        if len(t.chunks) == 1 and t.chunks[0].shape == t.shape:
            c = t.chunks[0]
            with self._stored(c, verify, f"tensor {name} ({c.file})") as src:
                np.copyto(dst, np.frombuffer(src, dtype=np.uint8))
            return
        # Pieces written by several ranks: verify every piece before any byte reaches ``out``.
        whole = dst.view(dtypes.from_code(t.dtype).numpy).reshape(t.shape)
        sources = [self._stored(c, verify, f"tensor {name} chunk at {list(c.offset)} ({c.file})") for c in t.chunks]
        try:
            for c, src in zip(t.chunks, sources):
                box = tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))
                whole[box] = np.frombuffer(src, dtype=whole.dtype).reshape(c.shape)
        finally:
            for src in sources:
                src.release()

    def load(
        self,
        *,
        framework: str = "numpy",
        verify: bool = True,
        threads: int = 2,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
    ) -> Any:
        """The state as plain values and arrays (NumPy by default); tied tensors come back shared.

        ``include`` / ``exclude`` glob patterns keep only the matching parts.
        """
        from trainstate._restore import ABSENT, restore  # restore builds on this module

        return restore(
            self, ABSENT, include=include, exclude=exclude, framework=framework, verify=verify, threads=threads
        )

    def read_many(self, jobs: list[tuple[str, Any]], *, verify: bool = True, threads: int = 2) -> None:
        """``read_into`` for many ``(name, out)`` pairs, in file order, on ``threads`` threads."""

        def position(job: tuple[str, Any]) -> tuple[str, int]:
            c = self._entry(job[0]).chunks
            return (c[0].file, c[0].byte_range[0]) if c else ("", 0)

        jobs = sorted(jobs, key=position)
        threads = max(threads, self.storage.capabilities.read_parallelism)  # remote: latency-bound GETs
        lanes = _split_by_bytes(jobs, [self._entry(n).nbytes for n, _ in jobs], max(1, threads))
        failed = threading.Event()  # one damaged tensor stops every lane: nothing more is written

        def run(lane: list[tuple[str, Any]]) -> None:
            for name, out in lane:
                if failed.is_set():
                    return
                try:
                    self.read_into(name, out, verify=verify)
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

    def verify(self) -> None:
        """Re-check every checksum (data-file headers and tensors); raises CorruptCheckpointError."""
        self.verify_headers()
        for name in self.manifest.tensors:
            self.read(name, verify=True)

    # -- plumbing -------------------------------------------------------------------------------

    def _entry(self, name: str) -> manifest.TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self.manifest.tensors), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; ck.keys() lists them"
            raise UnknownKeyError(f"no tensor {name!r:.80} in {self.path}{hint}") from None

    def _file(self, name: str) -> str:
        return self.storage.join(self.path, name)

    def _check_files(self) -> None:
        for f in self.manifest.files:
            info = self.storage.stat(self._file(f.path))
            if info is None and self.storage.stat(self.storage.join(self.path, manifest.MANIFEST_NAME)) is None:
                raise CheckpointNotFoundError(f"{self.path} was deleted while it was being opened")
            if info is None:
                raise CorruptCheckpointError(f"data file {f.path} of {self.path} is missing")
            if not info.regular or info.is_dir:
                raise CorruptCheckpointError(f"{self._file(f.path)} is not a regular file (symlinks are refused)")
            if info.size != f.size:
                raise CorruptCheckpointError(
                    f"data file {f.path} has {info.size} bytes, the manifest says {f.size}: truncated or altered"
                )

    def verify_headers(self) -> None:
        """Check every data file's safetensors header against the manifest (a few KB per file)."""
        for f in self.manifest.files:
            self._check_header(f)

    def _check_header(self, f: manifest.FileEntry) -> None:
        prefix = bytearray(8)
        self._pread(f.path, memoryview(prefix), 0)
        n = datafile.header_length(bytes(prefix))
        if n > f.size:
            raise CorruptCheckpointError(f"{f.path}: header length runs past the end of the file")
        blob = bytearray(n)
        self._pread(f.path, memoryview(blob), 0)
        checksum.check(memoryview(blob), f.header_checksum, f"the header of {f.path}")

    def _stored(self, c: manifest.Chunk, verify: bool, what: str) -> memoryview:
        """The chunk's stored bytes, checked before anyone copies them anywhere.

        Straight from the page cache where the storage maps files, else through a buffer of the
        chunk's size. Verifying the source rather than the destination means a damaged tensor never
        lands in live state: an in-place restore that fails on a checksum leaves that tensor (and all
        not yet read) as they were.
        """
        begin, end = c.byte_range
        if begin == end:
            return memoryview(b"")
        mm = self._map(c.file)
        if mm is not None:
            view = self._mapped(mm, c.file, begin, end)
        else:
            view = memoryview(bytearray(end - begin))
            self._pread(c.file, view, begin)
        if verify:
            try:
                checksum.check(view, c.checksum, what)
            except BaseException:
                view.release()
                raise
        return view

    def _map(self, file: str) -> mmap.mmap | None:
        with self._lock:
            if file not in self._maps:
                mappable = self.storage.capabilities.memory_map
                self._maps[file] = self.storage.map(self._file(file)) if mappable else None
            return self._maps[file]

    def _mapped(self, mm: mmap.mmap, file: str, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` of a mapped data file, once the file is known to still hold them.

        Every access to a mapping goes through here. The files were checked against the manifest at
        open, but a file truncated since (by a user, a sync tool, a full disk) leaves the mapping
        longer than the file, and touching a page past the new end kills the process with SIGBUS
        instead of raising. ``mm.size()`` is the file's size now, not the mapping's length.
        """
        size = mm.size()
        if end > size:
            raise CorruptCheckpointError(
                f"data file {file} of {self.path} now has {size} bytes, but the manifest needs bytes up to "
                f"{end}: it was truncated after the checkpoint was opened. Do not modify checkpoint files "
                "while they are read; load another checkpoint"
            )
        with memoryview(mm) as whole:
            return whole[begin:end]

    def _pread(self, file: str, view: memoryview, offset: int) -> None:
        mm = self._map(file)  # mapped at open: still readable if the checkpoint was deleted since
        if mm is not None:
            with self._mapped(mm, file, offset, offset + len(view)) as src:
                view[:] = src
            return
        try:
            got = self.storage.read_into(self._file(file), offset, view)
        except StorageError as e:
            if e.errno == errno.ENOENT:  # retention, a user, or an overwrite's cleanup removed it meanwhile
                raise CheckpointNotFoundError(
                    f"{self.path} was deleted while it was being read: its data file {file} is gone (deleted, "
                    "or dropped by an overwrite of the checkpoint). Open it again, or load another checkpoint"
                ) from e
            raise
        if got != len(view):
            raise CorruptCheckpointError(f"{file} ended before byte {offset + len(view)}")

    def close(self) -> None:
        with self._lock:
            for mm in self._maps.values():
                try:
                    if mm is not None:
                        mm.close()
                except BufferError:
                    pass  # arrays handed out still use it; it closes when they go
            self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<trainstate.Checkpoint {str(self.path)!r}: {len(self.manifest.tensors)} tensors>"


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


def _read_manifest(storage: Storage, path: str) -> manifest.Manifest:
    # ``path`` itself may be a link the user made (``run/latest -> step_00000100``): followed. Every
    # name inside the checkpoint is checked with stat(), which sees links, so those are refused.
    info = storage.stat_followed(path)
    if info is None and storage.recover(path):
        info = storage.stat_followed(path)
    if info is None:
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    if not info.is_dir:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint directory")
    mpath = storage.join(path, manifest.MANIFEST_NAME)
    minfo = storage.stat(mpath)
    if minfo is None and storage.stat_followed(path) is None:
        raise CheckpointNotFoundError(f"{path} was deleted while it was being opened")
    if minfo is None:
        from trainstate._manager.naming import step_of  # not at the top: the manager imports this module

        steps = sorted(
            (n for n in storage.list(path) if step_of(n) is not None), key=lambda n: step_of(n) or 0, reverse=True
        )
        if steps:
            newest = next(
                (
                    storage.join(path, n)
                    for n in steps
                    if storage.stat(storage.join(path, n, manifest.MANIFEST_NAME)) is not None
                ),
                None,
            )
            raise CheckpointNotFoundError(
                f"{path} is a CheckpointManager's run directory, not one checkpoint: resume with "
                f"CheckpointManager({path!r}).restore_latest(state), or load one of its checkpoints"
                + (f", e.g. the newest, {newest}" if newest else " (none of them is committed yet)")
            )
        raise IncompleteCheckpointError(
            f"{path} has no {manifest.MANIFEST_NAME}: the save that wrote it never committed"
        )
    if not minfo.regular or minfo.is_dir:
        raise CorruptCheckpointError(f"{mpath} is not a regular file (symlinks are refused)")
    if minfo.size > MAX_MANIFEST:
        raise CorruptCheckpointError(
            f"{mpath} is {minfo.size} bytes, more than the {MAX_MANIFEST} a manifest may have: it is damaged or forged"
        )
    raw = bytearray(minfo.size)
    try:
        got = storage.read_into(mpath, 0, memoryview(raw))
    except StorageError as e:
        if e.errno == errno.ENOENT:
            raise CheckpointNotFoundError(f"{path} was deleted while it was being opened") from e
        raise
    if got != minfo.size:
        raise CorruptCheckpointError(f"{mpath} changed while it was read")
    return manifest.parse(raw, mpath)  # no copy: a refused manifest costs its size, once


def open_checkpoint(path: str | os.PathLike[str], storage: Storage | None = None) -> Checkpoint:
    """Open a checkpoint lazily: reads the manifest now, tensors when asked.

    Example:
        >>> with trainstate.open("ckpt/step_1200") as ck:
        ...     print(ck.metadata, ck.keys()[:3], ck.info("model.fc.weight"))
    """
    return Checkpoint(path, storage)
