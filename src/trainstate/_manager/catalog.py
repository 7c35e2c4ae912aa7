"""The catalog of a manager's directory: which committed checkpoints exist, their manifest facts, pins.

Everything here reads manifests only, never tensors. Names outside the manager's scheme are never listed
or touched. A directory lock keeps a second manager out.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from trainstate import _tree as tree
from trainstate._format import run_dir as naming
from trainstate._format.added_keys import FACTS_KEY, declaration
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import DELETE_MARKER, PIN_FILE, POOL_DIR, PROBE_PREFIX, staged_target
from trainstate._incremental.gc import PoolCollector
from trainstate._keys import Key
from trainstate._manager.policies import CheckpointInfo
from trainstate._restore.checkpoint import _read_manifest
from trainstate._storage import Storage
from trainstate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    StorageError,
)

log = logging.getLogger("trainstate")
META_KEY = FACTS_KEY  # the manager's facts inside the manifest metadata
REMOTE_SWEEP_AGE = 3600.0
PIN_SETTLE_SECONDS = 2.0  # how long a pin waits for a retention pass that is looking at it


class Catalog:
    def __init__(self, storage: Storage, root: str, key: Key | None = None) -> None:
        self.storage = storage
        self.root = root
        self.key = key  # an encrypted run's: every manifest is authenticated with it
        self._cache: dict[str, tuple[float, int, CheckpointInfo]] = {}
        self.newer: dict[str, str] = {}  # checkpoints written by a newer trainstate: name -> why
        self.damaged: dict[str, str] = {}  # committed, but the manifest is unreadable: name -> why
        self._damaged_info: dict[str, CheckpointInfo] = {}  # ... as retention sees them (damaged_list)
        self.vanished: set[str] = set()  # listed, then gone before its manifest was read (retention, elsewhere)
        self._damage_seen: dict[str, tuple[float, int]] = {}
        self.pool = PoolCollector(storage, root)  # incremental runs: the shared pool's garbage collector
        self.has_pool = True  # whether the last listing saw a pool (a run without one is never collected)

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        out = []
        self.newer.clear()
        self.damaged.clear()
        self._damaged_info.clear()
        self.vanished.clear()
        names = self.storage.list(self.root)
        self.has_pool = POOL_DIR in names
        for name in names:
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
            if not self.storage.list(self.path(name)):
                self.vanished.add(name)  # deleted since the directory was listed
            return None  # not committed
        pin = self.pin_reason(name)
        cached = self._cache.get(name)
        if cached is not None and cached[:2] == (stamp.mtime, stamp.size):
            return _with_pin(cached[2], pin)
        try:
            m = _read_manifest(self.storage, self.path(name), self.key)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            self.vanished.add(name)
            return None  # deleted (or being deleted) since we listed the directory
        except FormatVersionError as e:
            self.newer[name] = str(e)  # not damage: the manager refuses to work beside it
            return None
        except CorruptCheckpointError as e:
            why = " ".join(str(e).split())
            if self._damage_seen.get(name) != (stamp.mtime, stamp.size):
                log.warning("skipping %s: %s", self.path(name), why)
                self._damage_seen[name] = (stamp.mtime, stamp.size)
            self.damaged[name] = why
            self._damaged_info[name] = _damaged(name, step, stamp.mtime, pin, self.path(name))
            return None
        meta = tree.decode(m.metadata)
        facts = meta.get(META_KEY, {}) if isinstance(meta, dict) else {}
        facts = facts if isinstance(facts, dict) else {}
        recorded = facts.get("step")
        if type(recorded) is int and recorded != step:  # a manifest copied over another step's (its bytes
            why = (  # are all in the run's pool, so nothing else would notice): not the checkpoint its name says
                f"its manifest records step {recorded}, not the step {step} its name says (copied from another "
                "checkpoint?)"
            )
            if self._damage_seen.get(name) != (stamp.mtime, stamp.size):
                log.warning("skipping %s: %s", self.path(name), why)
                self._damage_seen[name] = (stamp.mtime, stamp.size)
            self.damaged[name] = why
            self._damaged_info[name] = _damaged(name, step, stamp.mtime, pin, self.path(name))
            return None
        seq = facts.get("seq")
        metrics = facts.get("metrics")
        epoch = facts.get("epoch")
        info = CheckpointInfo(
            name=name,
            step=step,
            created=m.created,
            metrics={k: v for k, v in metrics.items() if isinstance(k, str)} if isinstance(metrics, dict) else {},
            epoch=epoch if type(epoch) is int else None,
            pinned=pin is not None,
            pin_reason=pin or "",
            nbytes=sum(f.size for f in m.files),
            shared=sum(f.size for f in m.files if f.pool and not f.new),
            pooled=sum(f.size for f in m.files if f.pool),
            seq=seq if type(seq) is int and seq >= 0 else None,
            path=self.path(name),
            manifest_nbytes=stamp.size,
        )
        self._cache[name] = (stamp.mtime, stamp.size, info)
        return info

    def damaged_list(self) -> builtins.list[CheckpointInfo]:
        """The checkpoints the last listing found damaged, as retention sees them: all that can be told
        without their manifest (name, step, pin, and the manifest's modification time for ``created``)."""
        return sorted(dict(self._damaged_info).values(), key=lambda c: c.step)  # a copy: list() may run meanwhile

    def committed(self, name: str) -> bool:
        """Whether ``name`` is still committed (a reader beside a job's retention finds it deleted meanwhile)."""
        return self.storage.stat(self.storage.join(self.path(name), MANIFEST_NAME)) is not None

    def next_seq(self) -> int:
        """The sequence number of the next commit: the highest in the directory + 1."""
        return 1 + max((c.seq for c in self.list() if c.seq is not None), default=0)

    def pin(self, name: str, reason: str = "") -> bool:
        """Pin a committed checkpoint; False if it was pinned already (its reason is left as it was).

        Safe beside a process that prunes: a pin is reported only once the pin file exists *and* the
        checkpoint is still committed, and :meth:`delete` checks for a pin after un-committing, so a
        reported pin is never deleted (see :meth:`delete`).
        """
        self._committed(name, "pin")
        if self.is_pinned(name):
            return False  # never remove a pin to rewrite it (a crash in between would unpin)
        pin = self.storage.join(self.path(name), PIN_FILE)
        try:
            self.storage.write(pin, [memoryview(json.dumps({"reason": reason}).encode())], fsync=True)
        except StorageError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise CheckpointNotFoundError(f"cannot pin {self.path(name)}: it was deleted meanwhile") from e
            if e.errno == errno.EEXIST:
                return False  # pinned by someone else just now
            raise
        manifest = self.storage.join(self.path(name), MANIFEST_NAME)
        deadline = time.monotonic() + PIN_SETTLE_SECONDS
        while self.storage.stat(manifest) is None:  # a retention pass may be checking for pins right now
            if time.monotonic() > deadline:
                raise CheckpointNotFoundError(f"cannot pin {self.path(name)}: retention deleted it meanwhile")
            time.sleep(0.01)
        try:  # a pin reported is one a crash does not take back: its name flushed too
            self.storage.sync_directory(self.path(name))
        except StorageError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise CheckpointNotFoundError(f"cannot pin {self.path(name)}: it was deleted meanwhile") from e
            raise
        return True

    def is_pinned(self, name: str) -> bool:
        return self.storage.stat(self.storage.join(self.path(name), PIN_FILE)) is not None

    def pin_reason(self, name: str) -> str | None:
        """The pin's reason ("" if none was given), or None when the checkpoint is not pinned."""
        path = self.storage.join(self.path(name), PIN_FILE)
        info = self.storage.stat(path)
        if info is None:
            return None
        raw = bytearray(min(info.size, 64 << 10))
        try:
            got = self.storage.read_into(path, 0, memoryview(raw))
            reason = json.loads(bytes(raw[:got])).get("reason", "")
        except (StorageError, ValueError, AttributeError, RecursionError):
            reason = ""  # unpinned meanwhile, or a pin file written by hand (or damaged): still a pin
        return reason if isinstance(reason, str) else ""

    def unpin(self, name: str) -> None:
        self._committed(name, "unpin")
        self.storage.delete(self.storage.join(self.path(name), PIN_FILE))

    def _committed(self, name: str, what: str) -> None:
        if self.storage.stat(self.storage.join(self.path(name), MANIFEST_NAME)) is None:
            raise CheckpointNotFoundError(f"cannot {what} {self.path(name)}: no committed checkpoint there")

    def delete(self, name: str) -> bool:
        """Delete a checkpoint for retention unless it is pinned; True if it was deleted.

        First take it out of sight — one rename where the storage has one, else remove the manifest
        (keeping its bytes) after marking the checkpoint as being deleted (``DELETE_MARKER``, so that a kill
        midway is not taken for an unfinished save) — then look for a pin: a pin written before that look is seen and the
        checkpoint is put back; a pin written after it finds no committed checkpoint and is not
        reported as a success (see :meth:`pin`). Either way a reported pin survives, and readers see the
        checkpoint whole or not at all.
        """
        if naming.step_of(name) is None:
            raise CheckpointError(f"refusing to delete {name!r}: not a name this manager makes")
        self._cache.pop(name, None)
        path = self.path(name)
        if self.is_pinned(name):
            return False
        hidden = self.storage.hide(path) if self.storage.capabilities.atomic_rename else None
        if hidden is not None:
            if self.storage.stat(self.storage.join(hidden, PIN_FILE)) is not None:
                self.storage.unhide(hidden, path)
                return False
            self.storage.delete(hidden)
            return True
        manifest = self.storage.join(path, MANIFEST_NAME)
        marker = self.storage.join(path, DELETE_MARKER)
        info = self.storage.stat(manifest)
        if info is not None:
            raw = bytearray(info.size)
            got = self.storage.read_into(manifest, 0, memoryview(raw))
            if self.storage.stat(marker) is None:  # a kill from here on leaves it listed as being deleted
                self.storage.write(marker, [memoryview(b"")], fsync=True)
            self.storage.delete(manifest)
            if self.is_pinned(name):
                self.storage.write(manifest, [memoryview(raw)[:got]], fsync=True)
                self.storage.delete(marker)
                return False
        self.storage.delete(path)
        return True

    def _put_back_pinned(self, hidden: str, name: str) -> bool:
        """A checkpoint that retention hid and then found pinned, left hidden by a crash: put it back."""
        where = self.path(hidden)
        if naming.step_of(name) is None or self.storage.stat(self.storage.join(where, PIN_FILE)) is None:
            return False
        if self.storage.stat(self.storage.join(where, MANIFEST_NAME)) is None or self.storage.stat(self.path(name)):
            return False
        self.storage.unhide(where, self.path(name))
        log.warning("put back pinned checkpoint %s, which a crash left hidden mid-retention", self.path(name))
        return True

    def sweep(self, *, locked: bool = False) -> builtins.list[str]:
        """Remove leftovers of crashed saves and deletes; returns what was removed.

        ``locked``: the caller holds the directory lock, so no save is in flight and every leftover goes.
        Without a lock (object stores) only leftovers untouched for ``REMOTE_SWEEP_AGE`` seconds are
        removed: a save another process is writing right now is never taken for a crash.
        """
        removed = []
        for name in self.storage.list(self.root):
            staged = staged_target(name)
            if staged is not None:
                target, tag = staged
                if tag == "old" and self.storage.recover(self.path(target)):
                    continue
                if tag == "del" and self._put_back_pinned(name, target):
                    continue
            elif name.startswith(PROBE_PREFIX):
                pass  # a check_storage() probe whose process died before deleting it
            elif (
                naming.step_of(name) is None
                or self.storage.stat(self.storage.join(self.path(name), MANIFEST_NAME)) is not None
            ):
                continue
            if not locked and self.storage.age(self.path(name)) < REMOTE_SWEEP_AGE:
                continue
            self.storage.delete(self.path(name))
            removed.append(name)
        removed += [f"{POOL_DIR}/{n}" for n in self.collect_pool(locked=locked)]  # after the leftovers went
        if removed:
            log.info("swept %d incomplete checkpoint(s) in %s: %s", len(removed), self.root, removed)
        return removed

    def collect_pool(
        self, *, locked: bool, keep: Collection[str] = (), mine: Collection[str] = ()
    ) -> builtins.list[str]:
        """Delete the shared pool's files that no manifest here names (incremental runs, see
        trainstate._incremental.gc); ``keep`` and ``mine`` as there. Nothing to do (not even a listing,
        a request on object stores) where the last listing of the run directory saw no pool."""
        if not self.has_pool:
            return []
        return self.pool.collect(locked=locked, min_age=REMOTE_SWEEP_AGE, keep=keep, mine=mine)


def _damaged(name: str, step: int, mtime: float, pin: str | None, path: str) -> CheckpointInfo:
    return CheckpointInfo(name, step, mtime, pinned=pin is not None, pin_reason=pin or "", path=path)


def _with_pin(info: CheckpointInfo, reason: str | None) -> CheckpointInfo:
    if info.pinned == (reason is not None) and info.pin_reason == (reason or ""):
        return info
    return replace(info, pinned=reason is not None, pin_reason=reason or "")


def facts(
    step: int,
    epoch: int | None,
    metrics: dict[str, Any] | None,
    reason: str,
    now: float,
    seq: int,
    added_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """What the manager records in each checkpoint's metadata (``seq`` orders commits; ``time`` is display;
    ``added_keys``: the top-level keys it added to the user's state, see trainstate._format.added_keys)."""
    return {
        "step": step,
        "epoch": epoch,
        "metrics": dict(metrics or {}),
        "reason": reason,
        "time": now,
        "seq": seq,
        **declaration(added_keys),
    }
