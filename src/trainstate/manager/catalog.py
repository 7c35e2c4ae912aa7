"""The catalog of a manager's directory: which committed checkpoints exist, their manifest facts, pins.

Everything here reads manifests only, never tensors. Names outside the manager's scheme are never listed
or touched. A directory lock keeps a second manager out.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
from pathlib import Path
from typing import Any

from .. import tree
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from ..format.manifest import MANIFEST_NAME
from ..reader import _read_manifest
from ..storage import LocalStorage, Storage, is_staging_name
from . import naming
from .policies import CheckpointInfo

log = logging.getLogger("trainstate")
PIN_FILE = "pinned.json"
LOCK_FILE = ".trainstate.lock"
META_KEY = "trainstate"  # the manager's facts inside the manifest metadata
REMOTE_SWEEP_AGE = 3600.0


class Catalog:
    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root
        self._cache: dict[str, tuple[float, int, CheckpointInfo]] = {}

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        out = []
        for name in self.storage.list(self.root):
            step = naming.step_of(name)
            if step is None:
                continue
            info = self._info(name, step)
            if info is not None:
                out.append(info)
        return sorted(out, key=lambda c: c.step)

    def _info(self, name: str, step: int) -> CheckpointInfo | None:
        stamp = self.storage.stat(self.storage.join(self.path(name), MANIFEST_NAME))
        if stamp is None:
            return None  # not committed
        pinned = self.is_pinned(name)
        cached = self._cache.get(name)
        if cached is not None and cached[:2] == (stamp.mtime, stamp.size):
            return _with_pin(cached[2], pinned)
        try:
            m = _read_manifest(self.storage, self.path(name))
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            return None  # deleted (or being deleted) since we listed the directory
        except CorruptCheckpointError as e:
            log.warning("skipping %s: %s", self.path(name), e)
            return None
        meta = tree.decode(m.metadata, lambda n: None)
        facts = meta.get(META_KEY, {}) if isinstance(meta, dict) else {}
        info = CheckpointInfo(
            name=name, step=step, created=m.created, metrics=dict(facts.get("metrics") or {}),
            epoch=facts.get("epoch"), pinned=pinned, nbytes=sum(f.size for f in m.files),
        )
        self._cache[name] = (stamp.mtime, stamp.size, info)
        return info

    def pin(self, name: str, reason: str = "") -> None:
        self._committed(name, "pin")
        if self.is_pinned(name):
            return  # already pinned: never remove a pin to rewrite it (a crash in between would unpin)
        pin = self.storage.join(self.path(name), PIN_FILE)
        self.storage.write(pin, [memoryview(json.dumps({"reason": reason}).encode())], fsync=True)

    def is_pinned(self, name: str) -> bool:
        return self.storage.stat(self.storage.join(self.path(name), PIN_FILE)) is not None

    def unpin(self, name: str) -> None:
        self._committed(name, "unpin")
        self.storage.delete(self.storage.join(self.path(name), PIN_FILE))

    def _committed(self, name: str, what: str) -> None:
        if self.storage.stat(self.storage.join(self.path(name), MANIFEST_NAME)) is None:
            raise CheckpointNotFoundError(f"cannot {what} {self.path(name)}: no committed checkpoint there")

    def delete(self, name: str) -> None:
        if naming.step_of(name) is None:
            raise CheckpointError(f"refusing to delete {name!r}: not a name this manager makes")
        self.storage.delete(self.path(name))
        self._cache.pop(name, None)

    def sweep(self) -> builtins.list[str]:
        """Remove leftovers of crashed saves and deletes; returns what was removed.

        On local disks the directory lock guarantees no save is in flight. Object stores have no lock, so
        there only leftovers untouched for ``REMOTE_SWEEP_AGE`` seconds are removed: a save another
        process is writing right now is never taken for a crash.
        """
        removed = []
        local = isinstance(self.storage, LocalStorage)
        for name in self.storage.list(self.root):
            if is_staging_name(name):
                if ".old-" in name and self.storage.recover(self.path(name[1:].split(".old-")[0])):
                    continue
            elif naming.step_of(name) is None or self.storage.stat(
                    self.storage.join(self.path(name), MANIFEST_NAME)) is not None:
                continue
            if not local and self.storage.age(self.path(name)) < REMOTE_SWEEP_AGE:
                continue
            self.storage.abort(self.path(name))
            removed.append(name)
        if removed:
            log.info("swept %d incomplete checkpoint(s) in %s: %s", len(removed), self.root, removed)
        return removed


def _with_pin(info: CheckpointInfo, pinned: bool) -> CheckpointInfo:
    if info.pinned == pinned:
        return info
    from dataclasses import replace

    return replace(info, pinned=pinned)


class DirectoryLock:
    """An advisory lock on the directory, so two managers never prune each other's checkpoints."""

    def __init__(self, directory: Path) -> None:
        import fcntl

        self._path = directory / LOCK_FILE
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise CheckpointError(
                f"another CheckpointManager (pid {holder}) is using {directory}; close it first"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def facts(step: int, epoch: int | None, metrics: dict[str, Any] | None, reason: str, now: float) -> dict[str, Any]:
    return {"step": step, "epoch": epoch, "metrics": dict(metrics or {}), "reason": reason, "time": now}


def ensure_directory(storage: Storage, root: str) -> None:
    if isinstance(storage, LocalStorage):
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create checkpoint directory {root}: {e.strerror}") from e
