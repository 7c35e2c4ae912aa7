"""The storage interface: the few operations a checkpoint needs from wherever its bytes live.

What a backend author implements
--------------------------------
Seven abstract methods, so an incomplete backend fails when it is constructed, not at its first use:
``write``, ``read_into``, ``stat``, ``list``, ``delete``, ``begin`` and ``commit``. Backends translate
their native errors into :class:`~trainstate.errors.StorageError` (``raise ... from e``).

Everything else a caller may use has a default that is safe for any backend: ``abort``, ``map``,
``hide`` / ``unhide``, ``recover``, ``age``, ``stat_followed``, ``without_retries`` and the path helpers
``strip`` / ``join`` / ``name``. What a backend *can do* beyond the abstract methods is declared once,
in :attr:`Storage.capabilities` (a frozen :class:`Capabilities`); callers ask it, never the class. A
backend that declares nothing, or a wrapper that forgets to forward its inner backend's capabilities,
gets :class:`Capabilities`' defaults, which are the conservative answers: no lock taken (so leftovers are
swept only once they are old), un-commit by removing the manifest instead of a rename, data files named
uniquely per save, no memory maps, no extra parallelism. Slower or untidier, never wrong.

The commit protocol
-------------------
``begin(final)`` returns a staging location: a fresh hidden sibling that ``commit`` renames into place
(``atomic_rename``), or ``final`` itself (``in_place``: data files go straight to where readers look,
under names unique to this save, and the manifest, written last, is the commit). The saver then writes
every data file and the manifest into it and calls ``commit(staging, final, files)`` with the names it
wrote, relative to the checkpoint; an in-place backend deletes the data files of the checkpoint it
replaced that are not among them. No backend ever parses a manifest. On failure the saver calls
``abort(staging, files)`` with the data files no manifest can name yet. Either way a reader sees a
checkpoint whole with its manifest, or nothing.
"""

from __future__ import annotations

import mmap
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FileInfo:
    """What ``Storage.stat`` says about one path.

    Attributes:
        size: bytes (of a file).
        is_dir: whether it is a directory.
        regular: a plain file or directory, not a symlink or device.
        mtime: last modification time, seconds since the epoch (0.0 where the backend does not say).

    Example:
        >>> info = trainstate.LocalStorage().stat("ckpt/manifest.json")
        >>> info.is_dir, info.regular, info.size > 0
        (False, True, True)
    """

    size: int
    is_dir: bool
    regular: bool  # a plain file or directory, not a symlink or device
    mtime: float = 0.0


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the abstract methods; callers ask this instead of checking the class.

    The defaults are what is safe to assume of a backend that says nothing. A wrapping backend forwards
    its inner backend's value (``return self.inner.capabilities``), replacing only the fields its
    wrapping changes (``dataclasses.replace``: one that transforms bytes cannot offer maps of them).

    Attributes:
        atomic_rename: ``begin`` stages in a fresh sibling that ``commit`` renames into place, and
            ``hide`` / ``unhide`` move a whole checkpoint out of sight and back in one step. Without it,
            retention un-commits a checkpoint by removing its manifest (keeping the bytes to put back).
        locking: paths are directories of this machine on which ``flock`` works: the manager holds a
            lock file in its directory, so one writer at a time, and sweeps leftovers of crashed saves
            at once. Without it, several writers may share a directory and leftovers are swept only once
            ``age`` says nobody has touched them for an hour.
        in_place: ``begin`` may return the final location itself, so data files land where readers look
            while an older checkpoint is still committed there: the saver names them uniquely per save.
            True by default: unique names are correct for every backend, fixed names only for staging.
        memory_map: ``map`` returns read-only memory maps (or views of memory); readers then read
            tensors through them.
        symlinks: a user's path may be a symlink (their ``latest -> step_00000100``): ``stat_followed``
            follows it and the real path names the checkpoint and its siblings.
        makedirs: directories are real and must exist before files go in them: the manager creates its
            directory (the lock file lives there).
        target_file_bytes: if set, the saver cuts the state into files of about this size, so a large
            state is many moderate files written at once (latency-bound stores).
        read_parallelism: reads a reader keeps in flight at once (at least the caller's ``threads``).
        write_parallelism: files a saver writes at once (at least the caller's ``threads``).
        rewrite: ``rewrite`` overwrites bytes of a file just written, in place: a save with compression
            then streams each data file and writes its header last. Without it, such a save holds one
            data file's compressed bytes in memory until its header is known.

    Example:
        >>> class Metered(trainstate.Storage):  # forwards every call to self.inner, counting bytes
        ...     @property
        ...     def capabilities(self) -> trainstate.Capabilities:
        ...         return self.inner.capabilities  # the same locking, renames, maps and parallelism
    """

    atomic_rename: bool = False
    locking: bool = False
    in_place: bool = True
    memory_map: bool = False
    symlinks: bool = False
    makedirs: bool = False
    target_file_bytes: int | None = None
    read_parallelism: int = 1
    write_parallelism: int = 1
    rewrite: bool = False


class Storage(ABC):
    """Where checkpoints live. Paths are plain strings; :meth:`join` builds them.

    Subclass it and implement the seven abstract methods; override :attr:`capabilities` and the optional
    methods that go with them (``hide`` for ``atomic_rename``, ``map`` for ``memory_map``, ...). Pass an
    instance as ``storage=`` to ``save``, ``load``, ``open`` or ``CheckpointManager``; plain paths get
    :class:`LocalStorage` and URLs :class:`FsspecStorage` without it.

    Example:
        >>> class Metered(trainstate.Storage):   # a wrapper counting the bytes written
        ...     def __init__(self, inner: trainstate.Storage) -> None:
        ...         self.inner, self.written = inner, 0
        ...     capabilities = property(lambda self: self.inner.capabilities)
        ...     def write(self, path, views, *, fsync):
        ...         n = self.inner.write(path, views, fsync=fsync)
        ...         self.written += n
        ...         return n
        ...     # read_into, stat, list, delete, begin, commit (and the optional ones): forward likewise
        >>> trainstate.save("ckpt/step_5", state, storage=Metered(trainstate.LocalStorage()))
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend can do (see :class:`Capabilities`); the conservative defaults unless overridden.

        Example:
            >>> trainstate.LocalStorage().capabilities.atomic_rename
            True
        """
        return Capabilities()

    @abstractmethod
    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        """Write the file ``path`` from ``views`` in order; returns bytes written.

        Data files are always new names. Where ``capabilities.in_place`` is set, an overwriting save writes
        ``manifest.json`` over the committed one (that replacement is the commit), so replace an existing
        file rather than refusing it. Raise :class:`StorageError` for the backend's own errors.

        ``views`` may be iterated again from the start, so an upload can be retried.

        Example:
            >>> storage.write("run/notes.txt", [memoryview(b"hello")], fsync=False)
            5
        """

    @abstractmethod
    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``path`` at ``offset``; returns bytes read (fewer only at the end of the file).

        Example:
            >>> buf = bytearray(5)
            >>> storage.read_into("run/notes.txt", 0, memoryview(buf)), bytes(buf)
            (5, b'hello')
        """

    @abstractmethod
    def stat(self, path: str) -> FileInfo | None:
        """Facts about ``path``, or None if nothing is there. Symlinks are reported, not followed.

        Example:
            >>> storage.stat("run/notes.txt").size
            5
            >>> storage.stat("run/missing") is None
            True
        """

    @abstractmethod
    def list(self, path: str) -> list[str]:
        """Names directly inside the directory ``path``; empty if it does not exist.

        Example:
            >>> sorted(storage.list("runs/exp1"))
            ['step_00000500', 'step_00001000']
        """

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file or a whole directory (a checkpoint, a leftover), never leaving it visible half-deleted.

        Example:
            >>> storage.delete("run/notes.txt")
        """

    @abstractmethod
    def begin(self, final: str, *, overwrite: bool) -> str:
        """Check that ``final`` may be written and return the staging location to write into.

        A fresh location of its own, or ``final`` itself for stores that write in place (see the module
        docstring). Refuse (``CheckpointExistsError``) a committed checkpoint unless ``overwrite``, and
        anything that is not a checkpoint.

        Example:
            >>> staging = storage.begin("ckpt/step_5", overwrite=False)   # e.g. 'ckpt/.trainstate-tmp-...'
            >>> storage.write(storage.join(staging, "manifest.json"), [memoryview(b"{}")], fsync=True)
            >>> storage.commit(staging, "ckpt/step_5", ["manifest.json"], overwrite=False, fsync=True)
        """

    @abstractmethod
    def commit(self, staging: str, final: str, files: Sequence[str], *, overwrite: bool, fsync: bool) -> None:
        """Make the finished ``staging`` visible as ``final`` (replacing it if ``overwrite``), atomically.

        ``files`` are the names this save wrote, relative to the checkpoint, the manifest included: what
        a backend that writes in place keeps, dropping the replaced checkpoint's other data files.

        Example:
            >>> storage.commit(staging, "ckpt/step_5", ["data-0.safetensors", "manifest.json"],
            ...                overwrite=False, fsync=True)
        """

    # -- optional, with defaults that are safe for any backend ------------------------------------

    def abort(self, staging: str, files: Sequence[str]) -> None:
        """Throw away an unfinished save: ``files`` are the names in ``staging`` that no manifest can name.

        The default deletes exactly those; a backend whose staging location is its own (a fresh
        directory) removes all of it.

        Example:
            >>> staging = storage.begin("ckpt/step_5", overwrite=False)
            >>> try:
            ...     storage.write(storage.join(staging, "data-0.safetensors"), views, fsync=True)
            ... except trainstate.StorageError:
            ...     storage.abort(staging, ["data-0.safetensors"])
            ...     raise
        """
        for name in files:
            self.delete(self.join(staging, name))

    def rewrite(self, path: str, offset: int, data: bytes, *, fsync: bool) -> None:
        """Overwrite bytes ``[offset, offset + len(data))`` of the file ``path`` that this save has just
        written (``capabilities.rewrite`` backends), then flush the whole file if ``fsync``.

        A data file's header comes first but lists sizes known only once its compressed chunks are made:
        the saver reserves the header's room, streams the chunks and writes the header last. Where this
        raises NotImplementedError (the default), the saver writes the file again whole.

        Example:
            >>> storage.write("run/data.bin", [memoryview(bytes(8)), memoryview(b"payload")], fsync=False)
            15
            >>> storage.rewrite("run/data.bin", 0, (7).to_bytes(8, "little"), fsync=True)  # the header, last
        """
        raise NotImplementedError(f"{type(self).__name__} cannot rewrite part of a file")

    def map(self, path: str) -> mmap.mmap | memoryview | None:
        """A read-only memory map of the file (``memory_map`` backends); None where there is none.

        A backend whose files are already in memory (a packed checkpoint) returns a read-only memoryview.

        Example:
            >>> m = trainstate.LocalStorage().map("ckpt/manifest.json")
            >>> bytes(m[:1])
            b'{'
        """
        return None

    def age(self, path: str) -> float:
        """Seconds since anything under ``path`` last changed.

        0 where the backend cannot tell: something of unknown age may be another writer's save in
        flight, so it is never swept as abandoned.

        Example:
            >>> storage.age("runs/exp1/.trainstate-tmp-737465705f35-1a2b") > 3600   # abandoned for an hour?
        """
        return 0.0

    def without_retries(self) -> Storage:
        """This storage failing fast, for one-off checks; backends that retry override it.

        Example:
            >>> quick = storage.without_retries()
            >>> quick.stat("s3://bucket/run1")    # a bad endpoint fails now, not after minutes of retries
        """
        return self

    def stat_followed(self, path: str) -> FileInfo | None:
        """:meth:`stat`, but a symlink at ``path`` itself is followed (stores without links: the same).

        Only for the path a user gave (their ``latest -> step_00000100`` link); names inside a
        checkpoint always go through :meth:`stat`, so a link there is seen and refused.

        Example:
            >>> storage.stat("runs/exp1/latest").regular            # the link itself
            False
            >>> storage.stat_followed("runs/exp1/latest").is_dir    # what it points to
            True
        """
        return self.stat(path)

    def sync_directory(self, path: str) -> None:
        """Make the names in directory ``path`` durable (a file written there with ``fsync=True`` has its
        bytes flushed, not its name). Where a write is durable once it returns (object stores), nothing to do.

        Example:
            >>> storage.write("runs/exp1/step_00000500/pinned.json", [memoryview(b"{}")], fsync=True)
            >>> storage.sync_directory("runs/exp1/step_00000500")   # the new name survives a crash too
        """
        return None

    def hide(self, path: str) -> str | None:
        """Move a checkpoint directory out of sight in one atomic step; returns where it went.

        Called only where ``capabilities.atomic_rename``; None if nothing was there to move.

        Example:
            >>> hidden = storage.hide("runs/exp1/step_00000500")    # gone from listings at once
            >>> storage.delete(hidden)                              # then removed at leisure
        """
        return None

    def unhide(self, hidden: str, path: str) -> None:
        """Put a checkpoint moved away by :meth:`hide` back where it was.

        Example:
            >>> hidden = storage.hide("runs/exp1/step_00000500")
            >>> storage.unhide(hidden, "runs/exp1/step_00000500")   # changed our mind: back in place
        """
        raise NotImplementedError(f"{type(self).__name__} declares atomic_rename but cannot unhide")

    def recover(self, final: str) -> bool:
        """Put back a checkpoint a crash left mid-commit; True if it did.

        Example:
            >>> storage.recover("ckpt/step_5")   # False: nothing was left mid-commit
            False
        """
        return False

    def strip(self, url: str) -> str:
        """A user's path or URL in this backend's own terms.

        Example:
            >>> trainstate.LocalStorage().strip("file:///data/ckpt")
            '/data/ckpt'
        """
        return url

    def join(self, *parts: str) -> str:
        """A path made of ``parts``, in this backend's terms (``/``-separated by default).

        Example:
            >>> storage.join("runs/exp1", "step_00000500", "manifest.json")
            'runs/exp1/step_00000500/manifest.json'
        """
        return posixpath.join(*parts)

    def name(self, path: str) -> str:
        """The last component of ``path`` (a trailing ``/`` ignored).

        Example:
            >>> storage.name("runs/exp1/step_00000500/")
            'step_00000500'
        """
        return posixpath.basename(path.rstrip("/"))
