"""The storage interface: the few operations a checkpoint needs from wherever its bytes live.

Seven abstract methods, so an incomplete backend fails when it is constructed, not at its first use.
Backends translate their native errors into :class:`StorageError` (``raise ... from e``).

The commit protocol is each backend's: local disks stage in a hidden sibling and rename it into place;
stores without rename write the manifest (the commit marker) last. Either way a reader sees a checkpoint
with its manifest, or nothing.
"""

from __future__ import annotations

import mmap
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

STAGING_TAGS = (".tmp-", ".old-", ".del-")


@dataclass(frozen=True)
class FileInfo:
    size: int
    is_dir: bool
    regular: bool  # a plain file or directory, not a symlink or device
    mtime: float = 0.0


def is_staging_name(name: str) -> bool:
    """Whether a directory entry is a leftover of an unfinished save or delete (safe to sweep)."""
    return name.startswith(".") and any(tag in name for tag in STAGING_TAGS)


class Storage(ABC):
    """Where checkpoints live. Paths are plain strings; :meth:`join` builds them."""

    in_place = False  # True: data files go straight to the final location under unique names (no rename)
    target_file_bytes: int | None = None  # if set, the saver cuts the state into files of about this size

    @abstractmethod
    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        """Create the file ``path`` (it must not exist) from ``views`` in order; returns bytes written."""

    @abstractmethod
    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``path`` at ``offset``; returns bytes read (fewer only at the end of the file)."""

    @abstractmethod
    def stat(self, path: str) -> FileInfo | None:
        """Facts about ``path``, or None if nothing is there. Symlinks are reported, not followed."""

    @abstractmethod
    def list(self, path: str) -> list[str]:
        """Names directly inside the directory ``path``; empty if it does not exist."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file or a whole checkpoint directory, never leaving it visible half-deleted."""

    @abstractmethod
    def begin(self, final: str, *, overwrite: bool) -> str:
        """Check that ``final`` may be written and return a fresh staging location to write into."""

    @abstractmethod
    def commit(self, staging: str, final: str, *, overwrite: bool, fsync: bool) -> None:
        """Atomically make the finished ``staging`` visible as ``final`` (replacing it if ``overwrite``)."""

    # -- optional, with defaults -----------------------------------------------------------------

    def abort(self, staging: str) -> None:
        """Throw away an unfinished staging location."""
        self.delete(staging)

    def map(self, path: str) -> mmap.mmap | None:
        """A read-only memory map of the file, where the storage allows one."""
        return None

    def age(self, path: str) -> float:
        """Seconds since anything under ``path`` last changed; infinity where the backend cannot tell."""
        return float("inf")

    def without_retries(self) -> Storage:
        """This storage failing fast, for one-off checks; backends that retry override it."""
        return self

    def stat_followed(self, path: str) -> FileInfo | None:
        """:meth:`stat`, but a symlink at ``path`` itself is followed (stores without links: the same).

        Only for the path a user gave (their ``latest -> step_00000100`` link); names inside a
        checkpoint always go through :meth:`stat`, so a link there is seen and refused.
        """
        return self.stat(path)

    def hide(self, path: str) -> str | None:
        """Move a checkpoint directory out of sight in one atomic step; returns where it went.

        None where the backend cannot rename (object stores): callers then un-commit by removing the
        manifest instead. Readers see the checkpoint whole, or not at all.
        """
        return None

    def unhide(self, hidden: str, path: str) -> None:
        """Put a checkpoint moved away by :meth:`hide` back where it was."""
        raise NotImplementedError

    def recover(self, final: str) -> bool:
        """Put back a checkpoint a crash left mid-commit; True if it did."""
        return False

    def new_file_prefix(self) -> str:
        """The name prefix of this save's data files (unique per save where writes happen in place)."""
        return "data"

    def strip(self, url: str) -> str:
        """A user's path or URL in this backend's own terms."""
        return url

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def name(self, path: str) -> str:
        return posixpath.basename(path.rstrip("/"))
