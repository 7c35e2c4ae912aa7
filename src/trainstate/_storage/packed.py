"""A packed checkpoint as a storage: read-only, each file a view of one buffer (docs/format.md §10).

``trainstate.open`` and ``trainstate.load`` take a packed checkpoint where they take a path, so the reader
(manifest checks, checksums, partial restores) is the one every checkpoint goes through: this backend only
answers its questions from the archive. It declares ``memory_map``, and ``map`` returns a read-only
memoryview of the member, so tensors are hashed and copied straight from the caller's buffer and
``Checkpoint.read`` returns arrays that are views of it (no copy).

What counts as a packed checkpoint (:data:`Packed`):

- bytes-like objects: ``bytes``, ``bytearray``, ``memoryview``, ``mmap.mmap``, or anything else with the
  buffer protocol whose memory is contiguous (a NumPy ``uint8`` array). The buffer is borrowed, not copied,
  while the checkpoint is open: a ``bytearray`` cannot be resized meanwhile, and changing its bytes is
  caught by the checksums like any other damage;
- binary file objects open for reading (``open(path, "rb")``, ``io.BytesIO``, a member of a zip file): the
  archive is read from the current position to the end. A regular file is memory-mapped, a ``BytesIO``
  read through ``getvalue()`` (CPython hands over its buffer: no copy); any other stream (a pipe, a zip
  member) is read into memory;
- the path of a regular file that starts with the archive's magic bytes (``resolve_source`` checks), which
  is memory-mapped: ``trainstate inspect model.tsar`` works as for a directory.

Saving into any of these is refused: the write methods raise :class:`InvalidArgumentError`.

A mapped file truncated while a checkpoint reads it is a CorruptCheckpointError, not a SIGBUS: the reader
checks the file's current size through the view's owner (``read._backed``). For an ``mmap`` the caller
made with a non-zero ``offset`` that check cannot know the offset; do not truncate such a file meanwhile.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
from collections.abc import Iterable, Sequence
from typing import BinaryIO, NoReturn

from trainstate._format import archive
from trainstate._storage.base import Capabilities, FileInfo, Storage
from trainstate.errors import InvalidArgumentError, StorageError

Buffer = bytes | bytearray | memoryview | mmap.mmap  # or anything else with the buffer protocol
Packed = Buffer | BinaryIO
BUFFER_NAME = "<packed checkpoint>"  # the checkpoint's path in messages, for one that has no file name
_CAPABILITIES = Capabilities(memory_map=True)


class PackedStorage(Storage):
    """One packed checkpoint: the archive in ``source`` (anything with the buffer protocol) from byte ``start``.

    The archive's header, index and padding are checked here, before anything is read; the files inside
    are checked by the reader, as for a directory (``root`` names it in messages). No view of ``source`` is
    kept between calls: ``map`` lends a new one, which the reader releases when the checkpoint is closed, so
    the caller's buffer is free again (resizable, closable) once the checkpoint and the arrays read from it
    are gone.
    """

    def __init__(self, source: Buffer, start: int = 0, root: str = BUFFER_NAME) -> None:
        self.root = root
        self._source = source
        with _flat(source) as whole:
            members, _ = archive.read_index(whole[start:], root)
        self._files = {m.name: (start + m.offset, m.length) for m in members}

    @classmethod
    def from_source(cls, source: Packed) -> PackedStorage:
        """The archive in bytes, a buffer or a binary file object (see the module docstring)."""
        if isinstance(source, (bytes, bytearray, memoryview, mmap.mmap)):
            return cls(source)
        if hasattr(source, "read"):
            return cls(*_file_source(source))
        return cls(source)  # type: ignore[arg-type] # other buffers (a NumPy array); _flat refuses the rest

    @classmethod
    def from_file(cls, path: str) -> PackedStorage:
        """The packed checkpoint file at ``path``, memory-mapped; ``path`` names it in messages."""
        try:
            with open(path, "rb") as f:
                return cls(*_file_source(f), root=path)
        except OSError as e:
            raise StorageError(e.errno, f"cannot read the packed checkpoint {path}: {e.strerror or e}") from e

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    # -- reading -------------------------------------------------------------------------------------

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        begin, length = self._place(path)
        with _flat(self._source) as whole:
            src = whole[begin + min(offset, length) : begin + min(offset + out.nbytes, length)]
            out[: src.nbytes] = src
            return src.nbytes

    def stat(self, path: str) -> FileInfo | None:
        if path.rstrip("/") == self.root:
            return FileInfo(0, is_dir=True, regular=True)
        name = self._name_of(path)
        return FileInfo(self._files[name][1], is_dir=False, regular=True) if name else None

    def list(self, path: str) -> list[str]:
        return sorted(self._files) if path.rstrip("/") == self.root else []

    def map(self, path: str) -> memoryview:
        begin, length = self._place(path)
        return _flat(self._source)[begin : begin + length]

    def strip(self, url: str) -> str:
        return url

    # -- writing: refused ------------------------------------------------------------------------------

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        _read_only(path)

    def delete(self, path: str) -> None:
        _read_only(path)

    def begin(self, final: str, *, overwrite: bool) -> str:
        _read_only(final)

    def commit(self, staging: str, final: str, files: Sequence[str], *, overwrite: bool, fsync: bool) -> None:
        _read_only(final)

    # -- helpers -------------------------------------------------------------------------------------

    def _name_of(self, path: str) -> str | None:
        parent, _, name = path.rpartition("/")
        return name if parent == self.root.rstrip("/") and name in self._files else None

    def _place(self, path: str) -> tuple[int, int]:
        """Where the file ``path`` is in the source: its first byte and its length."""
        name = self._name_of(path)
        if name is None:
            raise StorageError(errno.ENOENT, f"{path}: no such file in the packed checkpoint")
        return self._files[name]


def _read_only(path: str) -> NoReturn:
    raise InvalidArgumentError(
        f"{path} is a packed checkpoint, which is read-only: save to a directory, then trainstate.pack it"
    )


def _flat(source: Buffer) -> memoryview:
    """A new read-only view of ``source`` as flat bytes."""
    try:
        view = memoryview(source)
    except TypeError:
        raise InvalidArgumentError(
            f"expected a checkpoint path, or a packed checkpoint as bytes, a buffer or a binary file open for "
            f"reading; got {type(source).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError("a packed checkpoint's buffer must be contiguous memory")
    return (view if view.format == "B" and view.ndim == 1 else view.cast("B")).toreadonly()


def _file_source(f: BinaryIO) -> tuple[Buffer, int]:
    """What holds a binary file object's bytes, and where its current position is in it (module docstring).

    A ``BytesIO`` gives its bytes without a copy (``getvalue`` hands over its buffer until it is written to).
    """
    if isinstance(f, io.TextIOBase) or not getattr(f, "readable", lambda: True)():
        raise InvalidArgumentError(
            f"a packed checkpoint's file must be open for reading in binary mode ('rb'), got {f!r:.80}"
        )
    if isinstance(f, io.BytesIO):
        return f.getvalue(), f.tell()
    fd = _regular_fd(f)
    if fd is not None:
        start = f.tell()
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), start
        except ValueError:  # an empty file
            return b"", 0
    data = f.read()
    if not isinstance(data, (bytes, bytearray)):
        raise InvalidArgumentError(f"reading a packed checkpoint's file gave {type(data).__name__}, not bytes")
    return data, 0


def _regular_fd(f: BinaryIO) -> int | None:
    """The descriptor of a regular file under ``f`` (one that can be mapped), else None."""
    try:
        fd = f.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is both
        return None


def is_packed_file(path: str) -> bool:
    """Whether ``path`` is a regular file (not a FIFO, which would block) that starts with the magic bytes."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            return f.read(len(archive.MAGIC)) == archive.MAGIC
    except OSError:
        return False
