"""Where checkpoints live: the storage interface and its backends.

``resolve`` picks the backend for a path: plain paths and ``file://`` URLs are the local filesystem.
"""

from __future__ import annotations

import os

from .base import FileInfo, Storage, is_staging_name
from .local import LocalStorage

__all__ = ["FileInfo", "LocalStorage", "Storage", "is_staging_name", "resolve"]  # FsspecStorage: .fsspec

_LOCAL = LocalStorage()
_REMOTE: dict[str, Storage] = {}


def resolve(path: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """The backend for ``path`` and the path in that backend's terms.

    Plain paths and ``file://`` URLs are the local filesystem; any other ``scheme://`` goes through fsspec
    (``pip install trainstate[s3]`` for s3://), with credentials from the environment. Pass ``storage=``
    (e.g. ``FsspecStorage.from_url(url, **options)``) for explicit options.
    """
    text = os.fspath(path)
    if storage is not None:
        return storage, storage.strip(text)
    if text.startswith("file://"):
        return _LOCAL, text[len("file://"):]
    if "://" in text:
        protocol = text.split("://", 1)[0]
        if protocol not in _REMOTE:
            from .fsspec import FsspecStorage

            _REMOTE[protocol] = FsspecStorage.from_url(text)
        backend = _REMOTE[protocol]
        return backend, backend.strip(text)
    return _LOCAL, text
