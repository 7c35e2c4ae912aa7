"""Where checkpoints live: the storage interface and its backends.

``resolve`` picks the backend for a path: plain paths and ``file://`` URLs are the local filesystem.
``resolve_source`` is its reading twin: it also takes a packed checkpoint (bytes, a buffer, a binary file,
or a packed file's path) and reads it through ``packed.PackedStorage``; writers never get one.
The contract a backend meets (abstract methods, named capabilities, the commit protocol) is in base.py.
"""

from __future__ import annotations

import errno
import os
import uuid

from trainstate._format.run_dir import PROBE_PREFIX, is_staging_name
from trainstate._storage.base import Capabilities, FileInfo, Storage
from trainstate._storage.local import LocalStorage
from trainstate._storage.packed import Packed, PackedStorage, is_packed_file
from trainstate.errors import InvalidArgumentError

__all__ = [
    "Capabilities",
    "FileInfo",
    "LocalStorage",
    "Source",
    "Storage",
    "check",
    "is_staging_name",
    "resolve",
    "resolve_source",
]  # FsspecStorage: .fsspec

_LOCAL = LocalStorage()
_PROBE = "probe"
_REMOTE: dict[str, Storage] = {}
Source = str | os.PathLike[str] | Packed  # what a reader opens: a checkpoint's location, or a packed one


def resolve(path: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """The backend for ``path`` and the path in that backend's terms.

    Plain paths and ``file://`` URLs are the local filesystem; any other ``scheme://`` goes through fsspec
    (``pip install trainstate[s3]`` for s3://), with credentials from the environment. Pass ``storage=``
    (e.g. ``FsspecStorage.from_url(url, **options)``) for explicit options.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        packed = isinstance(path, (bytes, bytearray, memoryview)) and bool(path)
        raise InvalidArgumentError(
            f"a checkpoint location is a non-empty path or URL, got {path!r:.60}"
            + (
                "; a packed checkpoint in memory is read-only: save to a directory, then trainstate.pack it"
                if packed
                else ""
            )
        )
    text = os.fspath(path)
    if isinstance(text, bytes):
        raise InvalidArgumentError(f"a checkpoint location is a str path or URL, got {path!r:.60}")
    if storage is not None:
        return storage, storage.strip(text)
    if text.startswith("file://"):
        return _LOCAL, text[len("file://") :]
    if "://" in text:
        protocol = text.split("://", 1)[0]
        if protocol not in _REMOTE:
            from trainstate._storage.fsspec import FsspecStorage

            _REMOTE[protocol] = FsspecStorage.from_url(text)
        backend = _REMOTE[protocol]
        return backend, backend.strip(text)
    return _LOCAL, text


def resolve_source(source: Source, storage: Storage | None = None) -> tuple[Storage, str]:
    """:func:`resolve` for readers: a packed checkpoint in memory, in a binary file object or in a local file
    (one that starts with the archive's magic bytes) is read through a :class:`PackedStorage`."""
    if not isinstance(source, (str, os.PathLike)):
        if storage is not None:
            raise InvalidArgumentError("storage= is for checkpoint paths; a packed checkpoint is read from itself")
        backend = PackedStorage.from_source(source)
        return backend, backend.root
    text = os.fspath(source)
    if storage is None and isinstance(text, str) and (local := _local_path(text)) and is_packed_file(local):
        backend = PackedStorage.from_file(local)
        return backend, backend.root
    return resolve(source, storage)


def _local_path(text: str) -> str | None:
    if text.startswith("file://"):
        return text[len("file://") :]
    return None if "://" in text else text


def check(location: str | os.PathLike[str], storage: Storage | None = None) -> None:
    """Make sure ``location`` is reachable and writable: write, read back and delete a small probe.

    Raises:
        StorageError: with the backend's reason (no such bucket, permission denied, unreachable, ...).

    Example:
        >>> trainstate.check_storage("s3://bucket/run1")   # before a long job, not after it
    """
    from trainstate.errors import StorageError

    backend, root = resolve(location, storage)
    backend = backend.without_retries()  # a pre-flight check should fail fast, not back off for a minute
    payload = os.urandom(64)
    try:
        # The probe is written the way a save writes (begin, write, read back), so whatever a save
        # needs of the location (its directories, a staging area) is tried too.
        staging = backend.begin(backend.join(root, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"), overwrite=False)
        probe = backend.join(staging, _PROBE)
        try:
            backend.write(probe, [memoryview(payload)], fsync=True)
            back = bytearray(len(payload))
            if backend.read_into(probe, 0, memoryview(back)) != len(payload) or bytes(back) != payload:
                raise StorageError(errno.EIO, "the bytes read back differ from the bytes written")
        except BaseException:
            backend.abort(staging, [_PROBE])
            raise
        backend.delete(staging)  # a fresh name, the probe's alone
    except StorageError as e:
        raise StorageError(e.errno, f"{os.fspath(location)} is not usable for checkpoints: {e}") from e
    except OSError as e:
        raise StorageError(e.errno, f"{os.fspath(location)} is not usable for checkpoints: {e}") from e
