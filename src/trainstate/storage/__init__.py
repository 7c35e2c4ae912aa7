"""Where checkpoints live: the storage interface and its backends.

``resolve`` picks the backend for a path: plain paths and ``file://`` URLs are the local filesystem.
"""

from __future__ import annotations

import os

from .base import FileInfo, Storage, is_staging_name
from .local import LocalStorage

__all__ = ["FileInfo", "LocalStorage", "Storage", "is_staging_name", "resolve"]

_LOCAL = LocalStorage()


def resolve(path: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """The backend for ``path`` and the path in that backend's terms."""
    text = os.fspath(path)
    if storage is not None:
        return storage, text
    if text.startswith("file://"):
        return _LOCAL, text[len("file://"):]
    if "://" in text:
        from ..errors import CheckpointError

        raise CheckpointError(f"no storage backend for {text.split('://')[0]}:// URLs yet")
    return _LOCAL, text
