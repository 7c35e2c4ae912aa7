"""Checkpoints and run directories opened the way every command opens them, and the sizes they all show."""

from __future__ import annotations

from trainstate import open as open_checkpoint
from trainstate._cli._args import UsageError
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._manager import CheckpointInfo, CheckpointManager
from trainstate._restore.checkpoint import Checkpoint
from trainstate._storage import Storage, resolve
from trainstate.errors import CheckpointNotFoundError, StorageError


def require_dir(path: str) -> None:
    backend, root = resolve(path)
    info = backend.stat_followed(root)  # the user's own link to a directory counts as one
    if info is None:
        raise CheckpointNotFoundError(f"no such directory: {path}")
    if not info.is_dir:
        raise CheckpointNotFoundError(f"{path} is not a directory")


def open_ckpt(path: str, key_env: str | None = None) -> Checkpoint:
    """Open one checkpoint (an encrypted one with the key in the variable ``key_env``); a directory that
    exists but is none (a manager's) is a usage error."""
    try:
        return open_checkpoint(path, key_env=key_env)
    except CheckpointNotFoundError as e:
        backend, root = resolve(path)
        info = backend.stat_followed(root)
        if info is not None and info.is_dir:
            raise UsageError(f"{e}; 'trainstate ls {path}' lists its checkpoints") from None
        raise


def find_step(directory: str, step: int, key_env: str | None) -> CheckpointInfo:
    """The committed checkpoint of ``step`` in a manager's directory (``pin``, ``unpin``)."""
    require_dir(directory)
    for info in CheckpointManager(directory, read_only=True, key_env=key_env).list():
        if info.step == step:
            return info
    raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {directory}")


def manifest_size(backend: Storage, path: str) -> int:
    """The size of a checkpoint's manifest (0 if it went meanwhile, or cannot be looked at)."""
    try:
        info = backend.stat(backend.join(path, MANIFEST_NAME))
    except StorageError:
        return 0
    return info.size if info is not None else 0


def shared_size(ck: Checkpoint) -> int:
    """Of a checkpoint's data-file bytes, those in shared pool files an earlier save wrote (incremental)."""
    return sum(f.size for f in ck.manifest.files if f.pool and not f.new)
