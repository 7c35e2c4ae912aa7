"""Record every mutation a piece of trainstate work makes to the files under a root directory.

The local backend, and everything else trainstate does to local files (the lock, pins, history records, the
local tier), goes through Python's ``os`` functions (``os.open``, ``os.write``, ``os.fsync``, ``os.rename``,
``os.unlink``, ``os.mkdir``, ... also as ``Path`` and ``shutil.rmtree`` call them) and, for small files,
``open()``. While a :class:`Recorder` is active those are wrapped in this process: each call runs as usual, and
if it changed something under the root, an :class:`Op` is appended, in the order the calls returned (a lock
serializes the background writer threads' calls). ``renameat2(RENAME_EXCHANGE)``, which the local backend calls
through ctypes, is recorded by wrapping ``LocalStorage._exchange``.

What the crash-state generator needs: the directory tree before (:meth:`Recorder.__enter__` takes it), the
operations, and marks the workload sets (``mark("saved 3")`` once a save returned).
"""

from __future__ import annotations

import builtins
import io
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainstate._storage.local import LocalStorage


@dataclass(frozen=True)
class Op:
    """One mutation: ``kind`` is mkdir, create, write, truncate, fsync, rename, exchange, unlink or rmdir; paths
    are relative to the root; ``data`` and ``offset`` for a write, ``size`` for a truncate; ``at`` when it was
    recorded (the system's monotonic clock: several processes' recordings of one machine merge by it)."""

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
    dirs, files = set(), {}
    for dirpath, _, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            dirs.add(rel)
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                files[os.path.normpath(os.path.join(rel, name))] = p.read_bytes()
    return Image(dirs, files)


class Recorder:
    """Wraps ``os`` (and ``open()``) while active; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self.marks: list[tuple[int, str]] = []  # (number of ops recorded so far, label)
        self.before = Image(set(), {})
        self._lock = threading.RLock()
        self._fds: dict[int, list[Any]] = {}  # fd -> [path (absolute), offset, is a directory]
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
        real = {name: getattr(os, name) for name in _WRAPPED}
        self._saved = {**{f"os.{k}": v for k, v in real.items()}, "open": builtins.open, "io.open": io.open}
        self._saved["exchange"] = LocalStorage._exchange
        for name in _WRAPPED:
            setattr(os, name, getattr(self, "_open_fd" if name == "open" else f"_{name}"))
        builtins.open = io.open = self._open  # type: ignore[assignment]
        recorder = self

        def exchange(storage: LocalStorage, a: Path, b: Path) -> bool:
            done = recorder._saved["exchange"](storage, a, b)
            if done:
                recorder._add("exchange", str(a), str(b))
            return bool(done)

        LocalStorage._exchange = exchange  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for name in _WRAPPED:
            setattr(os, name, self._saved[f"os.{name}"])
        builtins.open, io.open = self._saved["open"], self._saved["io.open"]
        LocalStorage._exchange = self._saved["exchange"]  # type: ignore[method-assign]

    def _real(self, name: str) -> Any:
        return self._saved[f"os.{name}"]

    def _rel(self, path: str) -> str | None:
        absolute = os.path.normpath(path)
        if absolute == self.root or absolute.startswith(self.root + os.sep):
            return os.path.relpath(absolute, self.root)
        return None

    def _abs(self, path: Any, dir_fd: int | None = None) -> str:
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            base = self._fds.get(dir_fd)
            parent = base[0] if base is not None else os.readlink(f"/proc/self/fd/{dir_fd}")
            path = os.path.join(parent, path)
        elif not os.path.isabs(path):
            path = os.path.join(os.getcwd(), path)
        return os.path.realpath(os.path.dirname(path)) + os.sep + os.path.basename(path) if path else path

    def _add(self, kind: str, path: str, path2: str = "", **kw: Any) -> None:
        rel = self._rel(path)
        rel2 = self._rel(path2) if path2 else ""
        if rel is None and not rel2:
            return
        with self._lock:
            self.ops.append(Op(kind, rel or "", rel2 or "", **kw))

    # -- the wrapped calls ---------------------------------------------------------------------------

    def _open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int) or not any(c in mode for c in "wax+"):
            return self._saved["open"](file, mode, *args, **kwargs)
        path = self._abs(file)
        existed = os.path.exists(path)
        f = self._saved["open"](file, mode, *args, **kwargs)
        if self._rel(path) is None:
            return f
        with self._lock:
            if not existed:
                self.ops.append(Op("create", self._rel(path) or ""))
            elif "w" in mode:
                self.ops.append(Op("truncate", self._rel(path) or "", size=0))
            self._fds[f.fileno()] = [path, 0, False]  # for an os.fsync(f.fileno())
        return _RecordedFile(f, self, path, "b" not in mode)

    def _open_fd(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        absolute = self._abs(path, dir_fd)
        existed = os.path.lexists(absolute)
        fd = self._real("open")(path, flags, mode, dir_fd=dir_fd)
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        with self._lock:
            self._fds[fd] = [absolute, 0, is_dir]
        if flags & os.O_CREAT and not existed:
            self._add("create", absolute)
        elif flags & os.O_TRUNC and not is_dir:
            self._add("truncate", absolute, size=0)
        return fd

    def _close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
        self._real("close")(fd)

    def _write(self, fd: int, data: Any) -> int:
        n = self._real("write")(fd, data)
        entry = self._fds.get(fd)
        if entry is not None:
            self._add("write", entry[0], offset=entry[1], data=bytes(memoryview(data)[:n]))
            entry[1] += n
        return int(n)

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        n = self._real("pwrite")(fd, data, offset)
        entry = self._fds.get(fd)
        if entry is not None:
            self._add("write", entry[0], offset=offset, data=bytes(memoryview(data)[:n]))
        return int(n)

    def _lseek(self, fd: int, pos: int, how: int) -> int:
        at = self._real("lseek")(fd, pos, how)
        entry = self._fds.get(fd)
        if entry is not None:
            entry[1] = at
        return int(at)

    def _fsync(self, fd: Any) -> None:
        self._real("fsync")(fd)
        number = fd if isinstance(fd, int) else fd.fileno()
        entry = self._fds.get(number)
        if entry is not None:
            self._add("fsync", entry[0])

    def _fdatasync(self, fd: int) -> None:
        self._real("fdatasync")(fd)
        entry = self._fds.get(fd)
        if entry is not None:
            self._add("fsync", entry[0])

    def _ftruncate(self, fd: int, size: int) -> None:
        self._real("ftruncate")(fd, size)
        entry = self._fds.get(fd)
        if entry is not None:
            self._add("truncate", entry[0], size=size)

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        a, b = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        self._real("rename")(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        self._add("rename", a, b)

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        a, b = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        self._real("replace")(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        self._add("rename", a, b)

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        absolute = self._abs(path, dir_fd)
        self._real("unlink")(path, dir_fd=dir_fd)
        self._add("unlink", absolute)

    def _remove(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._unlink(path, dir_fd=dir_fd)

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        absolute = self._abs(path, dir_fd)
        self._real("mkdir")(path, mode, dir_fd=dir_fd)
        self._add("mkdir", absolute)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        absolute = self._abs(path, dir_fd)
        self._real("rmdir")(path, dir_fd=dir_fd)
        self._add("rmdir", absolute)


# os functions wrapped by name (os.open by _open_fd: _open is open()'s)
_WRAPPED = (
    "open",
    "close",
    "write",
    "pwrite",
    "lseek",
    "fsync",
    "fdatasync",
    "ftruncate",
    "rename",
    "replace",
    "unlink",
    "remove",
    "mkdir",
    "rmdir",
)


class _RecordedFile:
    """A file opened with ``open()`` for writing: its writes recorded at the position they land."""

    def __init__(self, f: Any, recorder: Recorder, path: str, text: bool) -> None:
        self._f, self._recorder, self._path, self._text = f, recorder, path, text

    def write(self, data: Any) -> int:
        at = self._f.tell()
        n = self._f.write(data)
        raw = data.encode() if self._text else bytes(data)
        self._recorder._add("write", self._path, offset=at if not self._text else at, data=raw)
        return int(n)

    def __enter__(self) -> _RecordedFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self) -> Any:
        return iter(self._f)
