"""Wrapping backends: a user's Storage subclass that forwards calls to the backend it wraps.

This is what encryption, metrics or a cache in front of a store look like. ``Wrapping`` forwards
everything, the capabilities included, so it must behave exactly as the backend it wraps (same locking,
sweeping, renames, parallelism). ``Forwarding`` forgets the capabilities, and ``Minimal`` forwards
nothing but the abstract methods and the path helpers: both must get the conservative behaviour, never
a wrong one.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence

from trainstate._storage import Capabilities, FileInfo, Storage


class Minimal(Storage):
    """Forwards only the abstract methods and the path helpers; every other method is the base default."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        return self.inner.write(path, views, fsync=fsync)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        return self.inner.read_into(path, offset, out)

    def stat(self, path: str) -> FileInfo | None:
        return self.inner.stat(path)

    def list(self, path: str) -> list[str]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def begin(self, final: str, *, overwrite: bool) -> str:
        return self.inner.begin(final, overwrite=overwrite)

    def commit(self, staging: str, final: str, files: Sequence[str], *, overwrite: bool, fsync: bool) -> None:
        self.inner.commit(staging, final, files, overwrite=overwrite, fsync=fsync)

    def strip(self, url: str) -> str:
        return self.inner.strip(url)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def name(self, path: str) -> str:
        return self.inner.name(path)


class Forwarding(Minimal):
    """Forwards every method to ``inner``, but not :attr:`capabilities` (its author forgot them)."""

    def abort(self, staging: str, files: Sequence[str]) -> None:
        self.inner.abort(staging, files)

    def map(self, path: str) -> mmap.mmap | None:
        return self.inner.map(path)

    def age(self, path: str) -> float:
        return self.inner.age(path)

    def without_retries(self) -> Storage:
        return type(self)(self.inner.without_retries())

    def stat_followed(self, path: str) -> FileInfo | None:
        return self.inner.stat_followed(path)

    def hide(self, path: str) -> str | None:
        return self.inner.hide(path)

    def unhide(self, hidden: str, path: str) -> None:
        self.inner.unhide(hidden, path)

    def recover(self, final: str) -> bool:
        return self.inner.recover(final)

    def sync_directory(self, path: str) -> None:
        self.inner.sync_directory(path)


class Wrapping(Forwarding):
    """Forwards everything, capabilities included: indistinguishable from the backend it wraps."""

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities
