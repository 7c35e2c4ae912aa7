"""The local commit protocol: stage in a hidden sibling, fsync, rename into place.

A save writes every data file and then the manifest into ``.<name>.tmp-<random>`` beside the target,
fsyncs each file and the directory, and renames the directory to ``<name>``; then it fsyncs the parent
so the rename itself is durable. Readers only ever see ``<name>`` with its manifest, or nothing.

Overwriting swaps the two directories in one ``renameat2(RENAME_EXCHANGE)`` call, so there is no moment
when ``<name>`` is missing; the old checkpoint then sits in the staging directory and is deleted. Where
that call is unavailable (non-Linux), the old one is first renamed to ``.<name>.old-<random>``: a crash
between the two renames leaves the old checkpoint there, complete, for :func:`recover` to put back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from pathlib import Path

from .errors import CheckpointExistsError, StorageError
from .format.manifest import MANIFEST_NAME

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_dir(final: Path) -> Path:
    """A fresh hidden sibling of ``final`` to build a checkpoint in."""
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise StorageError(e.errno, f"cannot create a staging directory beside {final}: {e.strerror}") from e
    return tmp


def is_staging_name(name: str) -> bool:
    """Whether a directory entry is a leftover of an unfinished save or delete (safe to sweep)."""
    return name.startswith(".") and any(tag in name for tag in (".tmp-", ".old-", ".del-"))


def remove(path: Path) -> None:
    """Delete a checkpoint so that it is never seen half-deleted: rename it out of sight, then delete."""
    trash = path.parent / f".{path.name}.del-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, trash)
    except OSError as e:
        raise StorageError(e.errno, f"cannot delete {path}: {e.strerror}") from e
    shutil.rmtree(trash, ignore_errors=True)


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(final: Path, overwrite: bool) -> None:
    """Refuse to replace anything unless asked; never replace a non-empty directory that is not ours."""
    if not final.exists() and not final.is_symlink():
        return
    if not final.is_dir() or final.is_symlink():
        raise CheckpointExistsError(f"{final} exists and is not a checkpoint directory; refusing to replace it")
    if (final / MANIFEST_NAME).exists():
        if not overwrite:
            raise CheckpointExistsError(f"a checkpoint already exists at {final}; pass overwrite=True to replace it")
    elif any(final.iterdir()):
        raise CheckpointExistsError(
            f"{final} is a non-empty directory without a trainstate manifest; refusing to replace it"
        )


def publish(tmp: Path, final: Path, *, fsync: bool) -> None:
    """Atomically make the finished staging directory ``tmp`` visible as ``final``."""
    if fsync:
        fsync_path(tmp, directory=True)
    try:
        if final.exists() and any(final.iterdir()):
            _replace(tmp, final)
        else:
            os.replace(tmp, final)  # onto nothing, or onto an empty directory
    except OSError as e:
        raise StorageError(e.errno, f"cannot commit {final}: {e.strerror}") from e
    if fsync:
        fsync_path(final.parent, directory=True)


def _replace(tmp: Path, final: Path) -> None:
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old checkpoint
        return
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # filesystem or kernel without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), str(b))


def recover(final: Path) -> bool:
    """Put back a checkpoint stranded by a crash between the two renames of the fallback overwrite."""
    if final.exists():
        return False
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        if (old / MANIFEST_NAME).exists():
            os.rename(old, final)
            return True
    return False


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
