"""Record every mutation a piece of trainstate work makes to the files under a root directory.

The local backend, and everything else trainstate does to local files (the lock, pins, history records, the
local tier), goes through Python's ``os`` functions and ``open()``. While a :class:`Recorder` is active these are
wrapped in this process:

* ``os``: open (O_CREAT, O_TRUNC), write, pwrite, writev, pwritev, sendfile, copy_file_range, ftruncate,
  truncate, fsync, fdatasync, rename, replace, link, symlink, unlink, remove, mkdir, rmdir (also as ``Path``,
  ``shutil`` and ``tempfile`` call them);
* ``open()`` / ``io.open`` / ``io.FileIO`` (so ``Path.write_bytes``, ``os.fdopen``) on a file under the root
  run on Python's own implementation of io (``_pyio``), whose buffers reach the file through ``os.write``: a
  write is recorded when it reaches the file (a flush), not when it enters a buffer;
* ``mmap.mmap``: a writable map's bytes are recorded as a write at its ``flush()`` and ``close()``;
* ``renameat2(RENAME_EXCHANGE)``, which the local backend calls through ctypes, by wrapping
  ``LocalStorage._exchange``.

Each call that touches the root runs under one lock with its recording, so the operations are recorded in the
order they ran, whichever thread made them. A file descriptor's path is read from ``/proc/self/fd`` at each
call (a file renamed while open is recorded under its new name). Each :class:`Op` carries the monotonic clock:
when it returned, or, for an fsync, when it started (an operation of another process counts as flushed by the
fsync only if it returned before the fsync began), so several processes' recordings merge (``collective.py``).

What the crash-state generator needs: the directory tree before (:meth:`Recorder.__enter__` takes it), the
operations, and marks the workload sets (``mark("committed 3")`` once a save returned). Whatever the recorder
misses shows: ``campaign`` replays the recording and compares it with the tree the work left
(:func:`~.states.replayed`), and stops on a difference.
"""

from __future__ import annotations

import _pyio
import builtins
import fcntl
import io
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainstate._storage.local import LocalStorage


@dataclass(frozen=True)
class Op:
    """One mutation: ``kind`` is mkdir, create, write, truncate, fsync, rename, exchange, link, unlink or rmdir;
    paths are relative to the root (``path2``: the new name of a rename, exchange or link); ``data`` and
    ``offset`` for a write, ``size`` for a truncate; ``at`` the monotonic clock (see the module docstring)."""

    kind: str
    path: str
    path2: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0
    at: int = field(default_factory=time.monotonic_ns)


@dataclass
class Image:
    """A directory tree: its directories and its files' bytes (paths relative to the root)."""

    dirs: set[str]
    files: dict[str, bytes]


def snapshot(root: Path) -> Image:
    """The tree under ``root``; a symbolic link counts as a file holding what it points to."""
    dirs, files = set(), {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            dirs.add(rel)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            if p.is_file():
                files[os.path.normpath(os.path.join(rel, name))] = p.read_bytes()
    return Image(dirs, files)


class Recorder:
    """Wraps ``os``, ``open()`` and ``mmap`` while active; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self.marks: list[tuple[int, str]] = []  # (number of ops recorded so far, label)
        self.before = Image(set(), {})
        self._lock = threading.RLock()
        self._saved: dict[str, Any] = {}

    # -- the workload's side ------------------------------------------------------------------------

    def mark(self, label: str) -> None:
        with self._lock:
            self.marks.append((len(self.ops), label))

    def wrote(self, path: Path) -> None:
        """Record that ``path`` was created and written whole by code this recorder cannot see (a C++ writer:
        ``torch.save``), as that code's unsynced writes."""
        absolute = os.path.realpath(path)
        self._add("create", absolute)
        self._add("write", absolute, offset=0, data=Path(absolute).read_bytes())

    # -- wrapping ----------------------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        self.before = snapshot(Path(self.root))
        names = [n for n in _WRAPPED if hasattr(os, n)]
        self._saved = {f"os.{n}": getattr(os, n) for n in names}
        self._saved.update({"open": builtins.open, "io.open": io.open, "io.FileIO": io.FileIO})
        self._saved.update({"mmap": mmap.mmap, "exchange": LocalStorage._exchange})
        for n in names:
            setattr(os, n, getattr(self, "_open_fd" if n == "open" else f"_{n}"))
        builtins.open = io.open = self._open  # type: ignore[assignment]
        io.FileIO = self._file_io  # type: ignore[assignment,misc]
        mmap.mmap = _recorded_map(self)  # type: ignore[misc]
        recorder = self

        def exchange(storage: LocalStorage, a: Path, b: Path) -> bool:
            with recorder._lock:
                done = recorder._saved["exchange"](storage, a, b)
                if done:
                    recorder._add("exchange", str(a), str(b))
            return bool(done)

        LocalStorage._exchange = exchange  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for name in _WRAPPED:
            if f"os.{name}" in self._saved:
                setattr(os, name, self._saved[f"os.{name}"])
        builtins.open, io.open = self._saved["open"], self._saved["io.open"]
        io.FileIO = self._saved["io.FileIO"]  # type: ignore[misc]
        mmap.mmap = self._saved["mmap"]  # type: ignore[misc]
        LocalStorage._exchange = self._saved["exchange"]  # type: ignore[method-assign]

    def _real(self, name: str) -> Any:
        return self._saved[f"os.{name}"]

    def _rel(self, path: str) -> str | None:
        absolute = os.path.normpath(path)
        if absolute == self.root or absolute.startswith(self.root + os.sep):
            return os.path.relpath(absolute, self.root)
        return None

    def _abs(self, path: Any, dir_fd: int | None = None) -> str:
        """``path`` made absolute, its directory's links resolved (not its last part: a link is a name)."""
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(self._fd_path(dir_fd) or "", path)
        elif not os.path.isabs(path):
            path = os.path.join(os.getcwd(), path)
        return os.path.realpath(os.path.dirname(path)) + os.sep + os.path.basename(path) if path else path

    def _fd_path(self, fd: int) -> str | None:
        """Where ``fd``'s file is now; None for one deleted, or not a file of this process's."""
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return None if path.endswith(" (deleted)") else path

    def _fd_under(self, fd: int) -> str | None:
        path = self._fd_path(fd)
        return path if path is not None and self._rel(path) is not None else None

    def _add(self, kind: str, path: str, path2: str = "", **kw: Any) -> None:
        rel = self._rel(path)
        rel2 = self._rel(path2) if path2 else ""
        if rel is None and not rel2:
            return
        with self._lock:
            self.ops.append(Op(kind, rel or "", rel2 or "", **kw))

    def _on_fd(self, fd: int, call: Callable[[], Any], record: Callable[[str, Any], None]) -> Any:
        """Run ``call`` on ``fd``; if its file is under the root, under the lock and then ``record(path,
        result)``."""
        path = self._fd_under(fd)
        if path is None:
            return call()
        with self._lock:
            result = call()
            record(path, result)
            return result

    def _on_paths(self, paths: list[str], call: Callable[[], Any], record: Callable[[], None]) -> Any:
        if all(self._rel(p) is None for p in paths):
            return call()
        with self._lock:
            result = call()
            record()
            return result

    # -- the wrapped calls ---------------------------------------------------------------------------

    def _open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """``open()``: a file under the root on ``_pyio`` (its writes reach ``os.write``, recorded)."""
        under = self._fd_under(file) if isinstance(file, int) else self._rel(self._abs(file))
        if under is None:
            return self._saved["open"](file, mode, *args, **kwargs)
        return _pyio.open(file, mode, *args, **kwargs)

    def _file_io(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return _pyio.FileIO(file, mode, *args, **kwargs)

    def _open_fd(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        absolute = self._abs(path, dir_fd)

        def opened() -> int:
            existed = os.path.lexists(absolute)
            fd = self._real("open")(path, flags, mode, dir_fd=dir_fd)
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            if flags & os.O_CREAT and not existed:
                self._add("create", absolute)
            elif flags & os.O_TRUNC and not is_dir:
                self._add("truncate", absolute, size=0)
            return int(fd)

        return int(self._on_paths([absolute], opened, lambda: None))

    def _write_at(self, fd: int, call: Callable[[], int], offset: int | None, data: Callable[[int], bytes]) -> int:
        """A write of ``data(n)`` (n: the bytes written) at ``offset`` (None: the fd's position, or its end
        with O_APPEND)."""

        def where() -> int:
            if offset is not None:
                return offset
            if _appending(fd):
                return os.fstat(fd).st_size
            return int(os.lseek(fd, 0, os.SEEK_CUR))

        at: list[int] = []

        def run() -> int:
            at.append(where())
            return call()

        def record(path: str, n: int) -> None:
            if n:
                self._add("write", path, offset=at[0], data=data(n))

        return int(self._on_fd(fd, run, record))

    def _write(self, fd: int, data: Any) -> int:
        return self._write_at(fd, lambda: self._real("write")(fd, data), None, lambda n: bytes(memoryview(data)[:n]))

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        return self._write_at(
            fd, lambda: self._real("pwrite")(fd, data, offset), offset, lambda n: bytes(memoryview(data)[:n])
        )

    def _writev(self, fd: int, buffers: Any) -> int:
        joined = b"".join(bytes(memoryview(b)) for b in buffers)
        return self._write_at(fd, lambda: self._real("writev")(fd, buffers), None, lambda n: joined[:n])

    def _pwritev(self, fd: int, buffers: Any, offset: int, *flags: Any) -> int:
        joined = b"".join(bytes(memoryview(b)) for b in buffers)
        return self._write_at(
            fd, lambda: self._real("pwritev")(fd, buffers, offset, *flags), offset, lambda n: joined[:n]
        )

    def _sendfile(self, out_fd: int, in_fd: int, offset: int | None, count: int, *args: Any, **kw: Any) -> int:
        start = offset if offset is not None else int(os.lseek(in_fd, 0, os.SEEK_CUR))
        return self._write_at(
            out_fd,
            lambda: self._real("sendfile")(out_fd, in_fd, offset, count, *args, **kw),
            None,
            lambda n: os.pread(in_fd, n, start),
        )

    def _copy_file_range(
        self, src: int, dst: int, count: int, offset_src: int | None = None, offset_dst: int | None = None
    ) -> int:
        start = offset_src if offset_src is not None else int(os.lseek(src, 0, os.SEEK_CUR))
        return self._write_at(
            dst,
            lambda: self._real("copy_file_range")(src, dst, count, offset_src, offset_dst),
            offset_dst,
            lambda n: os.pread(src, n, start),
        )

    def _fsync(self, fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        start = time.monotonic_ns()
        self._on_fd(number, lambda: self._real("fsync")(fd), lambda path, _: self._add("fsync", path, at=start))

    def _fdatasync(self, fd: int) -> None:
        start = time.monotonic_ns()
        self._on_fd(fd, lambda: self._real("fdatasync")(fd), lambda path, _: self._add("fsync", path, at=start))

    def _ftruncate(self, fd: int, size: int) -> None:
        self._on_fd(
            fd, lambda: self._real("ftruncate")(fd, size), lambda path, _: self._add("truncate", path, size=size)
        )

    def _truncate(self, path: Any, size: int) -> None:
        if isinstance(path, int):
            self._ftruncate(path, size)
            return
        a = self._abs(path)
        self._on_paths([a], lambda: self._real("truncate")(path, size), lambda: self._add("truncate", a, size=size))

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        a, b = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        call = lambda: self._real("rename")(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)  # noqa: E731
        self._on_paths([a, b], call, lambda: self._add("rename", a, b))

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        a, b = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        call = lambda: self._real("replace")(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)  # noqa: E731
        self._on_paths([a, b], call, lambda: self._add("rename", a, b))

    def _link(
        self,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        a, b = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        call = lambda: self._real("link")(  # noqa: E731
            src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks
        )
        self._on_paths([a, b], call, lambda: self._add("link", a, b))

    def _symlink(self, src: Any, dst: Any, target_is_directory: bool = False, *, dir_fd: int | None = None) -> None:
        """A link: recorded as a second name of what it points to (a file read through it reads that)."""
        b = self._abs(dst, dir_fd)
        a = os.path.realpath(os.path.join(os.path.dirname(b), os.fsdecode(src)))
        call = lambda: self._real("symlink")(src, dst, target_is_directory, dir_fd=dir_fd)  # noqa: E731
        self._on_paths([b], call, lambda: self._add("link", a, b))

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        a = self._abs(path, dir_fd)
        self._on_paths([a], lambda: self._real("unlink")(path, dir_fd=dir_fd), lambda: self._add("unlink", a))

    def _remove(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._unlink(path, dir_fd=dir_fd)

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        a = self._abs(path, dir_fd)
        self._on_paths([a], lambda: self._real("mkdir")(path, mode, dir_fd=dir_fd), lambda: self._add("mkdir", a))

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        a = self._abs(path, dir_fd)
        self._on_paths([a], lambda: self._real("rmdir")(path, dir_fd=dir_fd), lambda: self._add("rmdir", a))


def _appending(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)


def _recorded_map(recorder: Recorder) -> type:
    """``mmap.mmap`` whose writable maps of files under the root record their bytes at flush() and close()."""

    class RecordedMap(recorder._saved["mmap"]):  # type: ignore[misc]
        def __init__(self, fileno: int, length: int, *args: Any, **kwargs: Any) -> None:
            self.path = recorder._fd_under(fileno) if fileno >= 0 else None
            self.start = int(kwargs.get("offset", args[3] if len(args) > 3 else 0))

        def _keep(self) -> None:
            if self.path is not None and not self.closed:
                try:
                    data = self[:]
                except (TypeError, ValueError):  # not readable
                    return
                recorder._add("write", self.path, offset=self.start, data=bytes(data))

        def flush(self, *args: Any) -> Any:
            with recorder._lock:
                self._keep()
                return super().flush(*args)

        def close(self) -> None:
            with recorder._lock:
                self._keep()
                super().close()

    return RecordedMap


# os functions wrapped by name (os.open by _open_fd: _open is open()'s)
_WRAPPED = (
    "open",
    "write",
    "pwrite",
    "writev",
    "pwritev",
    "sendfile",
    "copy_file_range",
    "fsync",
    "fdatasync",
    "ftruncate",
    "truncate",
    "rename",
    "replace",
    "link",
    "symlink",
    "unlink",
    "remove",
    "mkdir",
    "rmdir",
)
