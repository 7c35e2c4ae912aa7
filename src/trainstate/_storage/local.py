"""The local filesystem, with its commit protocol: stage in a hidden sibling, fsync, rename into place.

A save writes every data file and then the manifest into a hidden sibling of the target,
``.trainstate-tmp-<name in hex>-<random>`` (base.staging_name: no scanner of checkpoint names sees ``<name>`` there),
fsyncs each file and the directory, and renames the directory to ``<name>``; then it fsyncs the parent
so the rename itself is durable. Readers only ever see ``<name>`` with its manifest, or nothing.

Overwriting swaps the two directories in one ``renameat2(RENAME_EXCHANGE)`` call, so there is no moment
when ``<name>`` is missing; the old checkpoint then sits in the staging directory and is deleted. Where
that call is unavailable (non-Linux), the old one is first renamed to ``.trainstate-old-<name in hex>-<random>``: a crash
between the two renames leaves the old checkpoint there, complete, for :meth:`recover` to put back.

Every primitive (create, write, fsync, rename) is a method of its own, so a fault-injecting subclass
can fail any one of them (storage/faulty.py).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import staged_target, staging_name
from trainstate._storage.base import Capabilities, FileInfo, Storage
from trainstate.errors import CheckpointExistsError, StorageError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_MAX_IO = 1 << 30
T = TypeVar("T")


_CAPABILITIES = Capabilities(
    atomic_rename=True, locking=True, in_place=False, memory_map=True, symlinks=True, makedirs=True, rewrite=True
)


class LocalStorage(Storage):
    """Checkpoints on a local or shared POSIX filesystem.

    Commits by rename (stage in a hidden ``.trainstate-tmp-*`` sibling, fsync, rename; ``RENAME_EXCHANGE`` to
    overwrite), locks a manager's directory with ``flock`` and reads tensors through memory maps. Every
    plain path gets one without asking; its methods are :class:`Storage`'s.

    Example:
        >>> storage = trainstate.LocalStorage()
        >>> trainstate.save("ckpt/step_5", state, storage=storage)   # the same as without storage=
        >>> storage.list("ckpt")
        ['step_5']
    """

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    # -- the abstract operations -----------------------------------------------------------------

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        fd = self._guard(path, "create", lambda: self._create(path))
        written = 0
        try:
            for view in views:
                view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                pos = 0
                while pos < len(view):
                    pos += self._guard(path, "write", lambda: self._write(fd, view[pos : pos + _MAX_IO]))  # noqa: B023 - called at once
                written += pos
            if fsync:
                self._guard(path, "fsync", lambda: self._fsync(fd))
        finally:
            os.close(fd)
        return written

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError as e:
            raise StorageError(e.errno, f"cannot open {path}: {e.strerror}") from e
        pos = 0
        try:
            while pos < len(out):
                n = os.preadv(fd, [out[pos : pos + _MAX_IO]], offset + pos)
                if n == 0:
                    break
                pos += n
        except OSError as e:
            raise StorageError(e.errno, f"reading {path} failed: {e.strerror}") from e
        finally:
            os.close(fd)
        return pos

    def stat(self, path: str) -> FileInfo | None:
        return self._stat(path, follow=False)

    def stat_followed(self, path: str) -> FileInfo | None:
        return self._stat(path, follow=True)

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StorageError(e.errno, f"cannot list {path}: {e.strerror}") from e

    def delete(self, path: str) -> None:
        p = Path(path)
        if not p.is_dir() or p.is_symlink():
            p.unlink(missing_ok=True)
            return
        trash = p.parent / staging_name(p.name, "del")
        self._guard(path, "rename", lambda: self._rename(p, trash))  # out of sight first, then delete
        shutil.rmtree(trash, ignore_errors=True)

    def begin(self, final: str, *, overwrite: bool) -> str:
        target = Path(final)
        self._check_target(target, overwrite)
        tmp = target.parent / staging_name(target.name, "tmp")
        try:
            make_directories(target.parent)
            tmp.mkdir()
        except OSError as e:
            raise StorageError(e.errno, f"cannot create a staging directory beside {final}: {e.strerror}") from e
        return str(tmp)

    def commit(self, staging: str, final: str, files: Sequence[str], *, overwrite: bool, fsync: bool) -> None:
        tmp, target = Path(staging), Path(final)
        if fsync:
            self._guard(staging, "fsync", lambda: self._fsync_dir(tmp))
        self._check_target(target, overwrite)
        replaced = None
        if target.exists() and any(target.iterdir()):
            replaced = self._replace(tmp, target)
        else:  # onto nothing, or onto an empty directory
            self._guard(final, "rename", lambda: self._rename(tmp, target))
        try:
            if fsync:  # the rename is durable before the checkpoint it replaced is deleted
                self._guard(final, "fsync", lambda: self._fsync_dir(target.parent))
        finally:
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)

    # -- optional operations ---------------------------------------------------------------------

    def sync_directory(self, path: str) -> None:
        self._guard(path, "fsync", lambda: self._fsync_dir(Path(path)))

    def abort(self, staging: str, files: Sequence[str]) -> None:
        shutil.rmtree(staging, ignore_errors=True)  # the staging directory is this save's alone

    def rewrite(self, path: str, offset: int, data: bytes, *, fsync: bool) -> None:
        fd = self._guard(path, "open", lambda: os.open(path, os.O_WRONLY | _NOFOLLOW))
        try:
            view = memoryview(data)
            self._guard(path, "seek", lambda: os.lseek(fd, offset, os.SEEK_SET))
            pos = 0
            while pos < len(view):
                pos += self._guard(path, "write", lambda: self._write(fd, view[pos:]))  # noqa: B023 - called at once
            if fsync:
                self._guard(path, "fsync", lambda: self._fsync(fd))
        finally:
            os.close(fd)

    def age(self, path: str) -> float:
        """Seconds since ``path`` or an entry directly inside it last changed (0 if it is gone).

        Example:
            >>> trainstate.LocalStorage().age("runs/exp1") < 60   # a save committed within the minute
            True
        """
        try:
            newest = os.lstat(path).st_mtime
            with os.scandir(path) as entries:
                for entry in entries:
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except NotADirectoryError:
            pass
        except OSError:
            return 0.0
        return max(0.0, time.time() - newest)

    def map(self, path: str) -> mmap.mmap | None:
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError as e:
            raise StorageError(e.errno, f"cannot open {path}: {e.strerror}") from e
        try:
            if os.fstat(fd).st_size == 0:
                return None
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)  # tensors are mostly read front to back
        return mm

    def hide(self, path: str) -> str | None:
        p = Path(path)
        hidden = p.parent / staging_name(p.name, "del")
        try:
            self._rename(p, hidden)
        except FileNotFoundError:
            return None if not p.exists() else str(hidden)
        except OSError as e:
            raise StorageError(e.errno, f"cannot move {path} aside: {e.strerror}") from e
        return str(hidden)

    def unhide(self, hidden: str, path: str) -> None:
        self._guard(path, "rename", lambda: self._rename(Path(hidden), Path(path)))

    def recover(self, final: str) -> bool:
        target = Path(final)
        if target.exists():
            return False
        try:
            entries = sorted(os.listdir(target.parent))
        except OSError:
            return False
        for entry in entries:
            old = target.parent / entry
            if staged_target(entry) == (target.name, "old") and (old / MANIFEST_NAME).exists():
                os.rename(old, target)
                return True
        return False

    def strip(self, url: str) -> str:
        return url[len("file://") :] if url.startswith("file://") else url

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def name(self, path: str) -> str:
        return os.path.basename(os.path.normpath(path))

    # -- primitives (a fault-injecting subclass overrides these) ---------------------------------

    def _create(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)

    def _write(self, fd: int, view: memoryview) -> int:
        return os.write(fd, view)

    def _fsync(self, fd: int) -> None:
        os.fsync(fd)

    def _fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._fsync(fd)
        finally:
            os.close(fd)

    def _rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def _exchange(self, a: Path, b: Path) -> bool:
        renameat2 = _renameat2()
        if renameat2 is None:
            return False
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False  # filesystem or kernel without RENAME_EXCHANGE
        raise OSError(err, os.strerror(err), str(b))

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _stat(path: str, *, follow: bool) -> FileInfo | None:
        try:
            st = os.stat(path, follow_symlinks=follow)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StorageError(e.errno, f"cannot stat {path}: {e.strerror}") from e
        regular = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
        return FileInfo(st.st_size, stat.S_ISDIR(st.st_mode), regular, st.st_mtime)

    @staticmethod
    def _guard(path: str, what: str, op: Callable[[], T]) -> T:
        try:
            return op()
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(e.errno, f"{what} failed for {path}: {e.strerror or e}") from e

    def _replace(self, tmp: Path, target: Path) -> Path:
        """Put ``tmp`` in ``target``'s place; returns where the old checkpoint now is (to delete)."""
        if self._guard(str(target), "rename", lambda: self._exchange(tmp, target)):
            return tmp  # now holds the old checkpoint
        old = target.parent / staging_name(target.name, "old")
        self._guard(str(target), "rename", lambda: self._rename(target, old))
        try:
            self._guard(str(target), "rename", lambda: self._rename(tmp, target))
        except BaseException:
            os.rename(old, target)  # put the old one back; if even that fails, recover() will
            raise
        return old

    @staticmethod
    def _check_target(final: Path, overwrite: bool) -> None:
        """Refuse to replace anything unless asked; never replace a non-empty directory that is not ours."""
        if not final.exists() and not final.is_symlink():
            return
        if not final.is_dir() or final.is_symlink():
            raise CheckpointExistsError(f"{final} exists and is not a checkpoint directory; refusing to replace it")
        if (final / MANIFEST_NAME).exists():
            if not overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {final}; pass overwrite=True to replace it"
                )
        elif any(final.iterdir()):
            raise CheckpointExistsError(
                f"{final} is a non-empty directory without a trainstate manifest; refusing to replace it"
            )


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, or None where there is none (not Linux, an old glibc, musl without it).

    Looked up among the symbols the process has loaded already (``dlopen(NULL)``), never with
    ``ctypes.util.find_library``: that runs ``ldconfig -p`` in a subprocess, and on a save thread racing a
    DataLoader's fork the forked worker inherits the pipe the subprocess is waited on, so the save hangs.
    """
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:  # pragma: no cover - a platform without dlopen(NULL)
        return None


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a directory's entry to stable storage (OSError as the system raised it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_directory(path: str, what: str) -> None:
    """Create directory ``path`` (and its parents) if missing, durably (:func:`make_directories`); ``what``
    names it in the error."""
    try:
        make_directories(Path(path))
    except OSError as e:
        raise StorageError(e.errno, f"cannot create {what} {path}: {e.strerror}") from e


def make_directories(path: Path) -> None:
    """``mkdir -p path``, each directory it creates made durable: its parent is fsynced after it, so a crash
    cannot take back a directory (and every checkpoint committed in it) whose own contents were flushed. A
    filesystem that cannot fsync a directory (EINVAL) is left as it is."""
    missing = []
    at = path
    while not os.path.lexists(at) and at.parent != at:
        missing.append(at)
        at = at.parent
    path.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        try:
            fsync_path(created.parent)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
