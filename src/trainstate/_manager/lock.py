"""The directory lock: one writing CheckpointManager per local directory, held by that process alone.

``flock`` locks belong to an open file description, and ``fork()`` shares it: DataLoader workers forked
by the training process would keep the lock after the trainer died (a restart right after a SIGKILL was
refused for the seconds the orphaned workers lived) or after ``close()``. So every forked child closes
its copies of the lock descriptors at once (``os.register_at_fork``); only the process that took a
lock holds it. A lock whose manager is dropped without ``close()`` is released by the manager's
finalizer; a lock held by a dropped-but-uncollected manager of this very process is freed by one garbage
collection before the lock is refused.
"""

from __future__ import annotations

import fcntl
import gc
import os
import threading
import weakref
from pathlib import Path

from trainstate._format.run_dir import LOCK_FILE
from trainstate.errors import CheckpointError, StorageError

_live: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()
_live_guard = threading.Lock()


def _close_in_child() -> None:
    for lock in list(_live):
        lock._forget_in_child()


os.register_at_fork(after_in_child=_close_in_child)


class DirectoryLock:
    """An advisory lock on ``directory`` (released by :meth:`release`, process exit, or garbage collection)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / LOCK_FILE
        self._fd: int | None = None
        if not self._try(report=False):
            gc.collect()  # a manager this process dropped without close() may still hold it
            self._try(report=True)
        with _live_guard:
            _live.add(self)

    def _try(self, report: bool = False) -> bool:
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create the lock file {self._path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if not report:
                return False
            same = " (this process: call close() on the other manager, or del it)" if holder == str(os.getpid()) else ""
            raise CheckpointError(
                f"another CheckpointManager (pid {holder}){same} is using {self._path.parent}; close it first"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as e:  # e.g. a full disk: do not keep a lock nobody will release
            os.close(fd)
            raise StorageError(e.errno, f"cannot write the lock file {self._path}: {e.strerror}") from e
        self._fd = fd
        return True

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the last descriptor of the open file description: the flock goes with it

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # the child's copy only; the parent keeps its lock
            except OSError:
                pass
