"""Object stores and other remote filesystems through fsspec: s3://, gs://, az://, memory://, ...

Stores without rename get a different commit protocol from local disks: data files are written straight
into the checkpoint's prefix under names unique to this save (``data-<save id>-00000.safetensors``), and
the manifest — one atomic PUT — is written last and is the commit. Until it lands, readers see either
nothing (a new checkpoint: no manifest) or the previous checkpoint whole (an overwrite: the old
manifest still points at the old files, which were not touched). After the commit, data files the save
did not write (the saver passes their names to ``commit``) are deleted; a failed save deletes what it
wrote. The manifest itself is never read here.

Reads are byte ranges (``cat_file(start, end)``), so opening a checkpoint fetches only its manifest and
reading one tensor fetches only that tensor. A large range is fetched as parts of 8 MiB up to
``part_size``, up to ``read_parallelism`` at once and together about 1/8 of the range, each copied into
the caller's buffer as it lands: reading a chunk holds that one buffer, never a second whole copy of it.
Files are uploaded in parts of ``part_size`` bytes, and several files go up at once (the saver spreads
tensors over many files for remote stores). Transient errors (connection resets, timeouts, throttling)
are retried with exponential backoff. Credentials come from where fsspec and the store's SDK look
(environment, config files, ``storage_options``), never from the checkpoint.
"""

from __future__ import annotations

import errno
import logging
import posixpath
import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import DELETE_MARKER
from trainstate._optional import optional
from trainstate._storage.base import Capabilities, FileInfo, Storage
from trainstate.errors import CheckpointExistsError, MissingDependencyError, StorageError

log = logging.getLogger("trainstate")
T = TypeVar("T")

_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_PERMANENT_ERRNO = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EEXIST, errno.EINVAL}
_MIN_READ_PART = 8 << 20  # the ranged-GET size object stores recommend; smaller parts cost more requests


class FsspecStorage(Storage):
    """Checkpoints on any fsspec filesystem.

    Args:
        fs: an ``fsspec.AbstractFileSystem``.
        part_size: bytes per uploaded part, and the most bytes one ranged GET asks for.
        read_parallelism: ranged GETs in flight at once for one large read.
        retries: attempts after the first for transient errors.
        backoff: seconds before the first retry; doubles each time (with jitter).

    Attributes:
        fs: the fsspec filesystem.
        target_file_bytes: the saver cuts a state into files of about this size (64 MiB), uploaded in parallel.
        write_parallelism: files uploaded at once (8): each PUT is latency-bound.

    Example:
        >>> storage = trainstate.FsspecStorage(s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9000"), retries=8)
        >>> storage = trainstate.FsspecStorage.from_url("s3://bucket/run1", endpoint_url="http://127.0.0.1:9000")
        >>> trainstate.save("s3://bucket/run1/step_5", state, storage=storage)
    """

    target_file_bytes = 64 << 20  # the saver cuts state into files of about this size, uploaded in parallel
    write_parallelism = 8  # files uploaded at once: each PUT is latency-bound

    def __init__(
        self, fs: Any, *, part_size: int = 16 << 20, read_parallelism: int = 8, retries: int = 4, backoff: float = 0.2
    ) -> None:
        self.fs = fs
        self.part_size = part_size
        self.read_parallelism = max(1, read_parallelism)
        self.retries = retries
        self.backoff = backoff

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> FsspecStorage:
        """A storage for ``url``'s protocol; ``storage_options`` go to fsspec (credentials, endpoint, ...).

        Raises:
            MissingDependencyError: fsspec, or the protocol's fsspec backend, is not installed.
            StorageError: fsspec does not know the protocol.

        Example:
            >>> storage = trainstate.FsspecStorage.from_url("s3://bucket/run1", profile="training")
            >>> mgr = trainstate.CheckpointManager("s3://bucket/run1", storage=storage, every_steps=500)
        """
        protocol = url.split("://", 1)[0]
        with optional("fsspec", extra="s3", needed_for=f"{protocol}:// storage"):
            import fsspec  # type: ignore[import-untyped]
        try:
            fs = fsspec.filesystem(protocol, **storage_options)
        except ImportError as e:  # fsspec's message names the package; the s3 extra covers only S3
            raise MissingDependencyError(
                f"{protocol}:// needs an fsspec backend that is not installed ({e}); for S3: pip install "
                '"trainstate[s3]"'
            ) from e
        except ValueError as e:
            raise StorageError(errno.EINVAL, f"unknown storage protocol {protocol!r}: {e}") from e
        return cls(fs)

    @property
    def capabilities(self) -> Capabilities:
        """No rename, no lock, no maps: data files are written in place and the manifest PUT commits.

        Example:
            >>> trainstate.FsspecStorage.from_url("memory://").capabilities.atomic_rename
            False
        """
        return Capabilities(
            in_place=True,
            target_file_bytes=self.target_file_bytes,
            read_parallelism=self.read_parallelism,
            write_parallelism=self.write_parallelism,
        )

    def strip(self, url: str) -> str:
        return str(self.fs._strip_protocol(url))

    # -- the abstract operations -----------------------------------------------------------------

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        def upload() -> int:
            written = 0
            with self.fs.open(path, "wb", block_size=self.part_size) as f:
                for view in views:
                    f.write(view)
                    written += view.nbytes
            return written

        return self._retry(f"write {path}", upload)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` with ranged GETs, several at once when it is large.

        ``cat_file`` returns each part as a new bytes object (and the HTTP client joins the body from
        pieces on the way), so one GET for the whole range would hold two more copies of it. Parts in
        flight are instead kept to about 1/8 of the range (at least one part of ``_MIN_READ_PART``),
        each copied into ``out`` and dropped as soon as it lands.

        Example:
            >>> buf = bytearray(2**20)
            >>> storage.read_into("bucket/run1/step_5/data-0.safetensors", 0, memoryview(buf))   # 1 MiB
        """
        n = len(out)
        part = min(self.part_size, max(_MIN_READ_PART, -(-n // (8 * self.read_parallelism))))
        if n <= part:
            return self._read_part(path, offset, out)
        starts = range(0, n, part)
        lanes = max(1, min(self.read_parallelism, n // (8 * part)))

        def fetch(s: int) -> int | StorageError:
            return self._try_part(path, offset + s, out[s : s + part])

        results: Iterable[int | StorageError]
        if lanes == 1:
            results = map(fetch, starts)  # lazily: the loop below stops at the end of the file
        else:
            with ThreadPoolExecutor(lanes, thread_name_prefix="trainstate-get") as pool:
                results = list(pool.map(fetch, starts))
        got = 0
        for s, result in zip(starts, results):
            if isinstance(result, StorageError):  # a part wholly past the end: some stores refuse the range
                info = self.stat(path) if result.errno == errno.EINVAL else None
                if info is None or info.size > offset + s:
                    raise result
                result = 0
            got += result
            if result < min(part, n - s):
                break  # the file ended here; later parts are past its end
        return got

    def stat(self, path: str) -> FileInfo | None:
        def fresh_info() -> Any:
            # Never from a cached listing: another process may have committed (or deleted) since.
            self.fs.invalidate_cache(path)
            return self.fs.info(path)

        try:
            info = self._retry(f"stat {path}", fresh_info)
        except StorageError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        is_dir = info.get("type") == "directory"
        return FileInfo(int(info.get("size") or 0), is_dir, info.get("type") in ("file", "directory"), _mtime(info))

    def list(self, path: str) -> list[str]:
        try:
            entries = self._retry(f"list {path}", lambda: self.fs.ls(path, detail=False, refresh=True))
        except StorageError as e:
            if e.errno == errno.ENOENT:
                return []
            raise
        return sorted({posixpath.basename(str(p).rstrip("/")) for p in entries} - {""})

    def delete(self, path: str) -> None:
        info = self.stat(path)
        if info is None:
            return
        if info.is_dir:  # the manifest goes first: from then on the checkpoint is invisible
            manifest, marker = posixpath.join(path, MANIFEST_NAME), posixpath.join(path, DELETE_MARKER)
            if self.stat(manifest) is not None and self.stat(marker) is None:  # a kill leaves it "being deleted"
                self.write(marker, [memoryview(b"")], fsync=False)
            self._rm(manifest)
            rest = [posixpath.join(path, n) for n in self.list(path) if n != DELETE_MARKER]
            if rest:
                self._retry(f"delete {path}", lambda: self.fs.rm(rest, recursive=True))
            try:  # the marker last (and the directory, where the filesystem has them)
                self._retry(f"delete {path}", lambda: self.fs.rm(path, recursive=True))
            except StorageError as e:
                if e.errno != errno.ENOENT:  # nothing was left to remove
                    raise
        else:
            self._rm(path)

    def begin(self, final: str, *, overwrite: bool) -> str:
        if self.stat(posixpath.join(final, MANIFEST_NAME)) is not None:
            if not overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {final}; pass overwrite=True to replace it"
                )
        elif any(not _is_data_file(n) and n != DELETE_MARKER for n in self.list(final)):  # a delete's leftovers
            raise CheckpointExistsError(f"{final} holds objects that are not a trainstate checkpoint; refusing")
        return final

    def commit(self, staging: str, final: str, files: Sequence[str], *, overwrite: bool, fsync: bool) -> None:
        # The manifest is already in place: that PUT was the commit. Now drop the replaced data files.
        keep = set(files)
        for name in self.list(final):
            if (_is_data_file(name) and name not in keep) or name == DELETE_MARKER:  # an interrupted delete's
                self._rm(posixpath.join(final, name))

    # -- optional operations ---------------------------------------------------------------------

    def abort(self, staging: str, files: Sequence[str]) -> None:
        try:
            for name in files:
                self._rm(posixpath.join(staging, name))
        except StorageError as e:
            log.warning("could not clean up after a failed save in %s: %s", staging, e)

    def age(self, path: str) -> float:
        """Seconds since anything under ``path`` last changed (0 if unknown or empty).

        Example:
            >>> storage.age("bucket/run1/step_00000500")   # from the objects' modification times
        """
        newest = 0.0
        for name in self.list(path):
            info = self.stat(posixpath.join(path, name))
            newest = max(newest, info.mtime if info else 0.0)
        return time.time() - newest if newest else 0.0

    def without_retries(self) -> FsspecStorage:
        """The same filesystem, failing fast: for one-off checks such as check_storage().

        Example:
            >>> storage.without_retries().retries
            0
        """
        return type(self)(
            self.fs, part_size=self.part_size, read_parallelism=self.read_parallelism, retries=0, backoff=self.backoff
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _try_part(self, path: str, offset: int, out: memoryview) -> int | StorageError:
        try:
            return self._read_part(path, offset, out)
        except StorageError as e:
            return e

    def _read_part(self, path: str, offset: int, out: memoryview) -> int:
        data = self._retry(f"read {path}", lambda: self.fs.cat_file(path, start=offset, end=offset + len(out)))
        got = min(len(data), len(out))
        out[:got] = memoryview(data)[:got]
        return got

    def _rm(self, path: str) -> None:
        try:
            self._retry(f"delete {path}", lambda: self.fs.rm(path))
        except StorageError as e:
            if e.errno != errno.ENOENT:
                raise

    def _retry(self, what: str, op: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return op()
            except Exception as e:  # noqa: BLE001 - every backend has its own error types
                if _permanent(e) or attempt == self.retries:
                    raise _translate(what, e) from e
                delay = self.backoff * (2**attempt) * (0.5 + random.random())
                log.warning("%s failed (%s); retrying in %.2fs", what, e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


def _is_data_file(name: str) -> bool:
    return name.startswith("data-") and name.endswith(".safetensors")


def _permanent(e: BaseException) -> bool:
    if isinstance(e, _PERMANENT):
        return True
    return isinstance(e, OSError) and e.errno in _PERMANENT_ERRNO


def _translate(what: str, e: BaseException) -> StorageError:
    if isinstance(e, StorageError):
        return e
    if isinstance(e, FileNotFoundError):
        code = errno.ENOENT
    elif isinstance(e, PermissionError):
        code = errno.EACCES
    else:
        code = getattr(e, "errno", None) or errno.EIO
    return StorageError(code, f"{what} failed: {type(e).__name__}: {e}")


def _mtime(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if value is not None and hasattr(value, "timestamp"):
            return float(value.timestamp())
    return 0.0
