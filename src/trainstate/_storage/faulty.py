"""A local storage that fails on purpose: the Nth create, write, fsync or rename raises an OSError.

For reliability tests and tools/reliability.py: run a save against it for every N until it stops
failing, and check each time that the error is clear, the previous checkpoints are intact and nothing
is left behind.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path

from trainstate._storage.local import LocalStorage

OPERATIONS = ("create", "write", "fsync", "rename")


class FaultyStorage(LocalStorage):
    """Fails the ``at``-th call (1-based) of ``operation`` with ``error`` (default: disk full)."""

    def __init__(self, operation: str, at: int, error: int = errno.ENOSPC) -> None:
        if operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {OPERATIONS}")
        self.operation, self.at, self.error = operation, at, error
        self.calls: Counter[str] = Counter()

    @property
    def fired(self) -> bool:
        return self.calls[self.operation] >= self.at

    def _tick(self, operation: str) -> None:
        self.calls[operation] += 1
        if operation == self.operation and self.calls[operation] == self.at:
            raise OSError(self.error, os.strerror(self.error))

    def _create(self, path: str) -> int:
        self._tick("create")
        return super()._create(path)

    def _write(self, fd: int, view: memoryview) -> int:
        self._tick("write")
        return super()._write(fd, view)

    def _fsync(self, fd: int) -> None:
        self._tick("fsync")
        super()._fsync(fd)

    def _rename(self, src: Path, dst: Path) -> None:
        self._tick("rename")
        super()._rename(src, dst)

    def _exchange(self, a: Path, b: Path) -> bool:
        self._tick("rename")
        return super()._exchange(a, b)
